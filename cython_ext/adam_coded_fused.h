/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the fused pass over 8- or 4-bit moments (qk: HZ_Q8 or HZ_Q4) with AVX2/FMA/
 * F16C intrinsics, for an fp32 or a bf16 master (mk, adam_m16_fused.h).  The codecs are
 * adam_q8_fused.h's and adam_q4_fused.h's.  Included only where the fused path exists.  No
 * include guard on purpose.
 *
 * 16 lanes per iteration, three passes over each block: (1) decode, the moments' update and
 * sqrt(v), new m and sqrt(v) to two L1 tiles, their largest magnitudes in registers; (2) the
 * params and their 16-bit copy from the tiles; (3) encode the tiles with the new scales.  The
 * same operations as the portable hz_q8_range / hz_q4_range (decode, hz_math_q8, encode), so
 * the same bits.  Taken by the portable path instead (hz_rest): a block whose length is not a
 * multiple of 16 (only a buffer's last), a block whose exp_avg scale times beta1 is NaN or
 * negative (hz_q8_mdec, hz_q4_mdec), and the encode of a block with an inf or NaN in its new
 * moments (hz_q8_pack32).  Why this shape: adam_q8_fused.h's measurements.
 *
 * 4-bit moments, single thread, 64K elements (in cache), bf16 grads in / bf16 params out over
 * them, Zen 3 shared (load 8-10), fastest call: 2.25 ns/param portable (auto-vectorized) ->
 * 0.93 fused, where 8-bit moments take 0.87 (twice the blocks per element: each block's
 * scales, inverses and pass boundaries); 10M params: 4.20 -> 1.81.  docs/measurements.md,
 * "The fused int4 pass and the fused bf16 master". */

static inline uint32_t HZ_FN(hz_hmax_epu32)(__m256i x) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

/* Prefetches the codes of element i (a block start when j, the element's index in its block,
 * is 0): once per 64-byte line, every 64 elements with 8-bit codes, every 128 with 4-bit. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_prefetch_codes)(const uint8_t *c, size_t i, size_t j, const int qk) {
    if (qk == HZ_Q8) HZ_FN(hz_prefetch)(c, i, 1, j);
    else if (j % 128u == 0) _mm_prefetch((const char *)c + i / 2, _MM_HINT_T0);
}

/* A block's new scales once passes 1 and 2 have run (mb, ub: the largest magnitudes of its new
 * m and sqrt(v) as float bits): 1 and the scales in *sm, *su, which the caller's encode uses
 * and then stores; or 0 for a block with inf or NaN in its new moments, which the portable
 * encode has then written, codes and scales. */
static inline int HZ_FN(hz_coded_scales)(const hz_adam_args *a, size_t b0, size_t n,
                                         const int qk, const float *mt, const float *ut,
                                         uint32_t mb, uint32_t ub, float *sm, float *su) {
    uint8_t *mc = (uint8_t *)a->exp_avg, *uc = (uint8_t *)a->exp_avg_sq;
    const size_t blk = b0 / (size_t)a->qblock;
    float *sm_out = a->m_scale + blk, *su_out = a->v_scale + blk;
    if (mb >= 0x7f800000u || ub >= 0x7f800000u) {
        if (qk == HZ_Q8) HZ_FN(hz_q8_encode)(mc + b0, uc + b0, sm_out, su_out, mt, ut, n);
        else HZ_FN(hz_q4_encode)(mc + b0 / 2, uc + b0 / 2, sm_out, su_out, mt, ut, n);
        return 0;
    }
    *sm = hz_q_scale(mb);
    *su = hz_q_scale(ub);
    return 1;
}

static inline __attribute__((always_inline)) void
HZ_FN(hz_coded_fused_body)(const hz_adam_args *a, size_t lo, size_t hi, const int gk,
                           const int ok, const int qk, const int mk, const int l2_on) {
    float mt[HZ_QBLOCK_MAX] __attribute__((aligned(64)));
    float ut[HZ_QBLOCK_MAX] __attribute__((aligned(64)));
    uint8_t *mc = (uint8_t *)a->exp_avg, *uc = (uint8_t *)a->exp_avg_sq;
    const void *grad = a->grad;
    void *pm = mk == HZ_BF16 ? (void *)a->master16 : (void *)a->param;  /* hz_p8 */
    uint16_t *out = (uint16_t *)a->out16;
    const __m256 gs = _mm256_set1_ps(a->grad_scale), decay = _mm256_set1_ps(a->decay);
    const __m256 l2 = _mm256_set1_ps(a->l2), c = _mm256_set1_ps(a->one_minus_beta1);
    const __m256 omb2 = _mm256_set1_ps(a->one_minus_beta2);
    const __m256 rbc2 = _mm256_set1_ps(a->inv_bc2_sqrt), eps = _mm256_set1_ps(a->eps);
    const __m256 ns = _mm256_set1_ps(a->neg_step), icap = _mm256_set1_ps(a->inv_ratio_cap);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const size_t bs = (size_t)a->qblock;
    const size_t pf_end = HZ_FN(hz_prefetch_end)(lo, hi);
    for (size_t b0 = lo; b0 < hi; b0 += bs) {
        size_t n = hi - b0 < bs ? hi - b0 : bs, blk = b0 / bs;
        const float msf = a->m_scale[blk] * a->beta1, usf = a->v_scale[blk] * a->sqrt_beta2;
        if ((n & 15u) || hz_bits(msf) > 0x7f800000u) {  /* see the top of this file */
            HZ_FN(hz_rest)(a, b0, b0 + n, mk);
            continue;
        }
        __m256 t[3];  /* the block's decode tables */
        if (qk == HZ_Q8) HZ_FN(hz_q8_tables)(msf, usf, t);
        else HZ_FN(hz_q4_tables)(msf, usf, t);
        __m256i mmax = _mm256_setzero_si256(), umax = _mm256_setzero_si256();
        for (size_t j = 0; j < n; j += 16) {  /* pass 1: decode, the moments, sqrt(v) */
            size_t i = b0 + j;
            if (i < pf_end) {  /* p: for pass 2 of a later block */
                HZ_FN(hz_prefetch)(pm, i + HZ_PREFETCH, mk == HZ_BF16 ? 2 : 4, j);
                HZ_FN(hz_prefetch)(grad, i + HZ_PREFETCH, gk == HZ_F32 ? 4 : 2, j);
                HZ_FN(hz_prefetch_codes)(mc, i + HZ_PREFETCH, j, qk);
                HZ_FN(hz_prefetch_codes)(uc, i + HZ_PREFETCH, j, qk);
            }
            __m256 md[2], vd[2];
            if (qk == HZ_Q8) HZ_FN(hz_q8_dec16)(mc + i, uc + i, t, md, vd);
            else HZ_FN(hz_q4_dec16)(mc + i / 2, uc + i / 2, t, md, vd);
            for (int h = 0; h < 2; ++h) {
                size_t e = i + 8 * h;
                __m256 g = _mm256_mul_ps(HZ_FN(hz_grad8)(grad, e, gk), gs);
                if (l2_on)
                    g = _mm256_fmadd_ps(l2, _mm256_mul_ps(HZ_FN(hz_p8)(pm, e, mk), decay), g);
                __m256 mi = _mm256_fmadd_ps(c, g, md[h]);
                __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, vd[h]);
                __m256 si = _mm256_sqrt_ps(vi);
                _mm256_store_ps(mt + j + 8 * h, mi);
                _mm256_store_ps(ut + j + 8 * h, si);
                mmax = _mm256_max_epu32(mmax, _mm256_castps_si256(_mm256_and_ps(mi, abs_mask)));
                /* si has no sign bit unless NaN (v >= +0): the raw max is the largest
                 * magnitude whenever it is finite, checked below */
                umax = _mm256_max_epu32(umax, _mm256_castps_si256(si));
            }
        }
        __m256i ctr = HZ_FN(hz_sr_ctr)(a, b0);
        for (size_t j = 0; j < n; j += 16) {  /* pass 2: the params and their 16-bit copy */
            __m256 pn[2];
            for (int h = 0; h < 2; ++h) {
                size_t e = b0 + j + 8 * h;
                __m256 mi = _mm256_load_ps(mt + j + 8 * h), si = _mm256_load_ps(ut + j + 8 * h);
                __m256 pi = _mm256_mul_ps(HZ_FN(hz_p8)(pm, e, mk), decay);
                __m256 cap = _mm256_mul_ps(_mm256_and_ps(mi, abs_mask), icap);
                __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_max_ps(cap, si), rbc2), eps);
                pn[h] = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(ns, mi), d));
            }
            HZ_FN(hz_pstore16)(pm, out, b0 + j, pn[0], pn[1], &ctr, ok, mk, 0);
        }
        float sm, su;
        if (!HZ_FN(hz_coded_scales)(a, b0, n, qk, mt, ut, HZ_FN(hz_hmax_epu32)(mmax),
                                    HZ_FN(hz_hmax_epu32)(umax), &sm, &su))
            continue;
        const __m256 im = _mm256_set1_ps(sm == 0.0f ? 0.0f : 1.0f / sm);
        const __m256 iu = _mm256_set1_ps(su == 0.0f ? 0.0f : 1.0f / su);
        size_t j = 0;
        for (; j + 32 <= n; j += 32) {  /* pass 3: encode */
            if (qk == HZ_Q8)
                HZ_FN(hz_q8_enc32)(mc + b0 + j, uc + b0 + j, mt + j, ut + j, im, iu, 0);
            else
                HZ_FN(hz_q4_enc32)(mc + (b0 + j) / 2, uc + (b0 + j) / 2, mt + j, ut + j, im, iu,
                                   0);
        }
        if (j < n) {  /* 16 left: n is a multiple of 16 here */
            if (qk == HZ_Q8)
                HZ_FN(hz_q8_enc32)(mc + b0 + j, uc + b0 + j, mt + j, ut + j, im, iu, 1);
            else
                HZ_FN(hz_q4_enc32)(mc + (b0 + j) / 2, uc + (b0 + j) / 2, mt + j, ut + j, im, iu,
                                   1);
        }
        a->m_scale[blk] = sm;
        a->v_scale[blk] = su;
    }
}

/* hz_coded_fused_body with the L2 flag a constant (AdamW: none; Adam: on), as hz_fused does:
 * the same operations on every lane, so the same bits. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_coded_fused)(const hz_adam_args *a, size_t lo, size_t hi, const int gk, const int ok,
                      const int qk, const int mk) {
    if (!a->l2_on) HZ_FN(hz_coded_fused_body)(a, lo, hi, gk, ok, qk, mk, 0);
    else HZ_FN(hz_coded_fused_body)(a, lo, hi, gk, ok, qk, mk, 1);
}
