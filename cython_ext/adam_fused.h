/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the fp32 / bf16-moment update with AVX2/FMA/F16C intrinsics, its 16-bit
 * conversions and prefetch helpers (also used by adam_q8_fused.h). Included only where the
 * fused path exists. No include guard on purpose. */

/* 8 lanes of float -> bfloat16, the same integer round-to-nearest-even as hz_float_to_bf16, for
 * every input (NaN included): the 8-lane tail, and hz_bf16x16's path for a NaN. */
static inline __m128i HZ_FN(hz_bf16x8_int)(__m256 x) {
    __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
    __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)),
                                    _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    __m256i q = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, q, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(r);
}

/* 8 bf16 -> 8 floats, exact: a broadcast load (no ALU op) and one in-lane byte shuffle that puts
 * element j in the top half of lane j over a zero low half, where vpmovzxwd + vpslld took two
 * ops of the two pipes that Zen 3 has for shifts and shuffles. */
static inline __m256 HZ_FN(hz_bf16x8_load)(const uint16_t *src) {
    const __m256i sel = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                                         -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1,
                                         14, 15);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)src)), sel));
}

/* 16 lanes (a: elements 0-7, b: 8-15; no NaN) -> 16 bf16 in order, hz_float_to_bf16's rounding
 * done on 16-bit halves: for u = H:L, (u + 0x7fff + (H & 1)) >> 16 is H + (L + (H & 1) > 0x8000),
 * and vpavgw's (L + lsb + 1) >> 1 (no overflow) is >= 0x4001 exactly then.  Checked against
 * hz_float_to_bf16 for all 2^32 inputs but NaN.  10 vector ops for 16 lanes where the 32-bit
 * form takes 16, 5 of them fewer on the shift/shuffle pipes. */
static inline __m256i HZ_FN(hz_bf16x16_rne)(__m256 a, __m256 b) {
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    __m256i x = _mm256_shuffle_epi8(_mm256_castps_si256(a), split);  /* a's lows, a's highs */
    __m256i y = _mm256_shuffle_epi8(_mm256_castps_si256(b), split);
    __m256i lo = _mm256_unpacklo_epi64(x, y), hi = _mm256_unpackhi_epi64(x, y);
    __m256i c = _mm256_avg_epu16(lo, _mm256_and_si256(hi, _mm256_set1_epi16(1)));
    __m256i up = _mm256_cmpgt_epi16(_mm256_setzero_si256(),  /* -1 where c >= 0x4001 */
                                    _mm256_add_epi16(c, _mm256_set1_epi16(0x3fff)));
    return _mm256_permute4x64_epi64(_mm256_sub_epi16(hi, up), 0xd8);
}

/* 16 lanes -> 16 bf16, bit-equal to hz_float_to_bf16 for every input.  nan: nonzero when a lane
 * of a or b may be NaN (the caller tests several streams with one compare); such vectors
 * (rare) take the exact 8-lane path.  Also with AVX512-BF16: vcvtneps2bf16 flushes subnormal
 * inputs to zero where torch rounds them, and its test for them per 8 lanes (5 ops) made the
 * hardware conversion the slower one.  bench_kernel_loop.py, 64K params in cache, the Xeon of
 * family 6 model 167, ns/param, hardware -> this: fp32 master with fp32 / bf16 moments (the
 * params' bf16 copy; and the moments) 0.41-0.43 / 0.59-0.64 -> 0.365 / 0.44-0.46, bf16
 * master with bf16 moments 0.63-0.70 -> 0.52-0.56 (two runs of each, 3 x 1500 calls). */
static inline __m256i HZ_FN(hz_bf16x16)(__m256 a, __m256 b, int nan) {
    if (__builtin_expect(nan, 0))
        return _mm256_set_m128i(HZ_FN(hz_bf16x8_int)(b), HZ_FN(hz_bf16x8_int)(a));
    return HZ_FN(hz_bf16x16_rne)(a, b);
}

/* Nonzero when a lane of a or b (of a, b, c or d) is NaN. */
static inline int HZ_FN(hz_any_nan2)(__m256 a, __m256 b) {
    return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}

static inline int HZ_FN(hz_any_nan4)(__m256 a, __m256 b, __m256 c, __m256 d) {
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                           _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
}

/* The 16-bit copy of 16 new params. */
static inline __m256i HZ_FN(hz_out16)(__m256 a, __m256 b, const int ok) {
    if (ok == HZ_F16)
        return _mm256_set_m128i(_mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT),
                                _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
    return HZ_FN(hz_bf16x16)(a, b, HZ_FN(hz_any_nan2)(a, b));
}

static inline __attribute__((always_inline)) __m256 HZ_FN(hz_grad8)(const void *grad, size_t i,
                                                                    const int gk) {
    if (gk == HZ_F32) return _mm256_loadu_ps((const float *)grad + i);
    if (gk == HZ_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)grad + i)));
    return HZ_FN(hz_bf16x8_load)((const uint16_t *)grad + i);
}

#include "adam_m16_fused.h"  /* the params of a bf16 master: hz_p8, hz_pstore16 */

/* Outputs of at least this many elements per thread bypass the cache (streaming stores): the
 * buffer is only read again by the host->device copy, and a normal store first reads each line
 * (2 B/param more traffic).  Measured 10M params, 2 threads, Zen 3: 7.85 -> 7.55 ms. */
#define HZ_STREAM_MIN 131072
/* Elements per round of hz_fused's two passes: two 1 KiB tiles, in L1 with everything else. */
#define HZ_SPLIT 256
/* Software prefetch distance, in elements, of the fused passes (one prefetch per 64-byte line
 * of each input stream), for calls of at least HZ_PREFETCH_MIN elements per thread.  The
 * hardware prefetchers alone left a thread short of lines in flight at 100M params: 2 threads,
 * Zen 3, the engine's call, ms/step fp32 / bf16 / int8 moments, medians of 7, A/B interleaved
 * both ways: 107 / 84 / 94 -> 96 / 71 / 80 (distances 512..4096 alike; 1 thread: no change).
 * Single thread: 1M elements 13-18% faster, 4M even, 64K-256K (in L3) 6-15% slower, hence
 * the minimum. */
#define HZ_PREFETCH 2048
#define HZ_PREFETCH_MIN 524288

/* The prefetching loops' bound: element i is fetched ahead while i < hz_prefetch_end(lo, hi),
 * that is, for calls of at least HZ_PREFETCH_MIN elements and while i + HZ_PREFETCH + 16 <=
 * hi.  One compare per 16 elements where the two tests took four or five instructions. */
static inline size_t HZ_FN(hz_prefetch_end)(size_t lo, size_t hi) {
    return hi - lo >= HZ_PREFETCH_MIN ? hi - (HZ_PREFETCH + 15) : 0;
}

/* Prefetches the line holding element i of a stream of es-byte elements, once per line when
 * called for every 16 elements (j: the element index in the round, a multiple of 16).  Always
 * inlined: gcc's IPA marks a non-inlined prefetch-only function const and deletes its calls. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_prefetch)(const void *base, size_t i, size_t es, size_t j) {
    if ((j * es) % 64u < 16u * es)
        _mm_prefetch((const char *)base + i * es, _MM_HINT_T0);
}

/* The whole update with the grads widened and the 16-bit copies cut in registers: the same
 * operations as hz_math (so the same bits) without staging through L1.  Each round of HZ_SPLIT
 * elements runs two passes, 16 lanes per iteration: the moments and sqrt(v) (new m and sqrt(v)
 * to two L1 tiles), then the param update from the tiles.  One pass did both, but the sqrt ->
 * div chain of each element (~40 cycles) left the out-of-order window too few independent
 * lanes: single thread, 64K elements (in cache), bf16 grads in / bf16 params out over them,
 * Zen 3, ns/param, fp32 moments / bf16 moments: one pass of 8 lanes 0.70 / 1.06, of 16 lanes
 * (hz_bf16x16, hz_bf16x8_load) 0.54 / 0.74, two passes 0.46 / 0.62 (HZ_SPLIT 64..1024 alike).
 * Measured 10M params, fp16 in / bf16 out, 2 threads, Zen 3: 10.05 ms staged through L1, 7.55
 * one fused pass, against a 6.79 ms ceiling.  gk, ok, sk and mk (the master: fp32, or bf16 as
 * adam_m16_fused.h loads and stores it) are constants after inlining. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_fused_body)(const hz_adam_args *a, size_t lo, size_t hi, const int gk, const int ok,
                     const int sk, const int mk, const int l2_on, const int small) {
    float mt[HZ_SPLIT] __attribute__((aligned(64)));
    float st[HZ_SPLIT] __attribute__((aligned(64)));
    void *pm = mk == HZ_BF16 ? (void *)a->master16 : (void *)a->param;  /* hz_p8 */
    float *restrict m = (float *)a->exp_avg, *restrict v = (float *)a->exp_avg_sq;
    uint16_t *restrict m16 = (uint16_t *)a->exp_avg, *restrict v16 = (uint16_t *)a->exp_avg_sq;
    const void *grad = a->grad;
    const __m256 gs = _mm256_set1_ps(a->grad_scale), decay = _mm256_set1_ps(a->decay);
    const __m256 l2 = _mm256_set1_ps(a->l2), c = _mm256_set1_ps(a->lerp_coef);
    const __m256 b2 = _mm256_set1_ps(a->beta2), omb2 = _mm256_set1_ps(a->one_minus_beta2);
    const __m256 rbc2 = _mm256_set1_ps(a->inv_bc2_sqrt), eps = _mm256_set1_ps(a->eps);
    const __m256 ns = _mm256_set1_ps(a->neg_step);
    uint16_t *out = (uint16_t *)a->out16;
    /* Not when the output is the grad buffer: its lines are in cache, just read.  Not with a
     * bf16 master: it is written back too, and read again at the next step. */
    const int stream = ok != HZ_NONE && hi - lo >= HZ_STREAM_MIN && a->out16 != a->grad &&
                       mk == HZ_F32;
    const size_t pf_end = HZ_FN(hz_prefetch_end)(lo, hi);
    size_t i = lo;
    if (stream) /* 32-byte streaming stores need 32-byte alignment: plain path up to it */
        while (i < hi && ((uintptr_t)(out + i) & 31u)) ++i;
    if (i != lo) HZ_FN(hz_tiles)(a, lo, i < hi ? i : hi);
    while (hi - i >= 16) {
        const size_t n = (hi - i < HZ_SPLIT ? hi - i : HZ_SPLIT) & ~(size_t)15;
        for (size_t j = 0; j < n; j += 16) {  /* pass 1: the moments, sqrt(v) */
            __m256 mn[2], vn[2];
            if (i + j < pf_end) {
                const size_t f = i + j + HZ_PREFETCH, es = sk == HZ_F32 ? 4 : 2;
                HZ_FN(hz_prefetch)(pm, f, mk == HZ_BF16 ? 2 : 4, j);
                HZ_FN(hz_prefetch)(m, f, es, j);
                HZ_FN(hz_prefetch)(v, f, es, j);
                HZ_FN(hz_prefetch)(grad, f, gk == HZ_F32 ? 4 : 2, j);
            }
            for (int h = 0; h < 2; ++h) {
                size_t e = i + j + 8 * h;
                __m256 g = _mm256_mul_ps(HZ_FN(hz_grad8)(grad, e, gk), gs);
                if (l2_on)
                    g = _mm256_fmadd_ps(l2, _mm256_mul_ps(HZ_FN(hz_p8)(pm, e, mk), decay), g);
                __m256 mi = sk == HZ_F32 ? _mm256_loadu_ps(m + e)
                                         : HZ_FN(hz_bf16x8_load)(m16 + e);
                __m256 vi = sk == HZ_F32 ? _mm256_loadu_ps(v + e)
                                         : HZ_FN(hz_bf16x8_load)(v16 + e);
                mi = _mm256_fmadd_ps(c, _mm256_sub_ps(g, mi), small ? mi : g);
                vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(b2, vi));
                _mm256_store_ps(mt + j + 8 * h, mi);
                _mm256_store_ps(st + j + 8 * h, _mm256_sqrt_ps(vi));
                if (sk == HZ_F32) {
                    _mm256_storeu_ps(m + e, mi);
                    _mm256_storeu_ps(v + e, vi);
                }
                mn[h] = mi;
                vn[h] = vi;
            }
            if (sk == HZ_BF16) {  /* one NaN test for both moments */
                int nan = HZ_FN(hz_any_nan4)(mn[0], vn[0], mn[1], vn[1]);
                _mm256_storeu_si256((__m256i *)(m16 + i + j),
                                    HZ_FN(hz_bf16x16)(mn[0], mn[1], nan));
                _mm256_storeu_si256((__m256i *)(v16 + i + j),
                                    HZ_FN(hz_bf16x16)(vn[0], vn[1], nan));
            }
        }
        __m256i ctr = HZ_FN(hz_sr_ctr)(a, i);
        for (size_t j = 0; j < n; j += 16) {  /* pass 2: the params and their 16-bit copy */
            __m256 pn[2];
            for (int h = 0; h < 2; ++h) {
                size_t e = i + j + 8 * h;
                __m256 pi = _mm256_mul_ps(HZ_FN(hz_p8)(pm, e, mk), decay);
                __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_load_ps(st + j + 8 * h), rbc2),
                                         eps);
                __m256 u = _mm256_mul_ps(ns, _mm256_load_ps(mt + j + 8 * h));
                pn[h] = _mm256_add_ps(pi, _mm256_div_ps(u, d));
            }
            HZ_FN(hz_pstore16)(pm, out, i + j, pn[0], pn[1], &ctr, ok, mk, stream);
        }
        i += n;
    }
    if (i < hi) HZ_FN(hz_rest)(a, i, hi, mk);  /* < 16 left */
    if (stream) _mm_sfence(); /* order the streamed lines before whoever reads them next */
}

/* hz_fused_body with AdamW's flags as constants (no L2 term, torch.lerp's weight < 0.5: every
 * AdamW with beta1 > 0.5), the flags read at run time otherwise.  The constants drop the L2
 * test and the lerp's select from every 16 lanes; instructions per param, the engine's call
 * (bf16 grads in, bf16 params out over them; bench_kernel_loop.py --instructions), fp32 /
 * bf16 moments: 5.97 / 7.65 -> 4.91 / 6.98, with a bf16 master 6.90 / 8.78 -> 6.03 / 8.21.
 * The same operations on every lane, so the same bits.  adam_coded_fused.h does the same
 * with its L2 flag: alone it gained nothing there (gcc had hoisted that test), but without it
 * this file's second instance cost the int4 pass 10.55 -> 11.23 (code generation across the
 * one big function); with it int8 / int4 9.52 / 10.62, bf16 master 10.47 / 11.67. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_fused)(const hz_adam_args *a, size_t lo, size_t hi, const int gk, const int ok,
                const int sk, const int mk) {
    if (!a->l2_on && a->lerp_small) HZ_FN(hz_fused_body)(a, lo, hi, gk, ok, sk, mk, 0, 1);
    else HZ_FN(hz_fused_body)(a, lo, hi, gk, ok, sk, mk, a->l2_on, a->lerp_small);
}
