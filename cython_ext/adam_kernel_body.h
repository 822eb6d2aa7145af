/* Per-ISA body of the CPU-Adam pass; included by adam_kernel.h once per variant with HZ_SUFFIX
 * (name suffix) and HZ_NO_INTRINSICS (1: portable C only, used as the reference variant in tests).
 * No include guard on purpose. */

#ifndef HZ_FN
#define HZ_CAT2(a, b) a##_##b
#define HZ_CAT(a, b) HZ_CAT2(a, b)
#define HZ_FN(name) HZ_CAT(name, HZ_SUFFIX)
#endif

#if !HZ_NO_INTRINSICS && HZ_X86 && defined(__F16C__) && defined(__AVX__)
#define HZ_USE_F16C 1
#else
#define HZ_USE_F16C 0
#endif
#if !HZ_NO_INTRINSICS && HZ_X86 && defined(__AVX512BF16__) && defined(__AVX512F__)
#define HZ_USE_BF16HW 1
#else
#define HZ_USE_BF16HW 0
#endif

static int HZ_FN(hz_features)(void) {
    int f = 0;
#ifdef __AVX2__
    f |= HZ_FEAT_AVX2;
#endif
#ifdef __AVX512F__
    f |= HZ_FEAT_AVX512F;
#endif
    f |= HZ_USE_F16C ? HZ_FEAT_F16C : 0;
    f |= HZ_USE_BF16HW ? HZ_FEAT_AVX512BF16 : 0;
    return f;
}

static void HZ_FN(hz_widen)(float *restrict dst, const uint16_t *restrict src, int kind, size_t n) {
    size_t k = 0;
    if (kind == HZ_BF16) {
        for (k = 0; k < n; ++k) dst[k] = hz_float((uint32_t)src[k] << 16);  /* exact */
        return;
    }
#if HZ_USE_F16C
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + k))));
    for (; k < n; ++k) dst[k] = _cvtsh_ss(src[k]);
#else
    for (; k < n; ++k) dst[k] = hz_half_to_float(src[k]);
#endif
}

static void HZ_FN(hz_narrow)(uint16_t *restrict dst, const float *restrict src, int kind, size_t n) {
    size_t k = 0;
    if (kind == HZ_F16) {
#if HZ_USE_F16C
        for (; k + 8 <= n; k += 8)
            _mm_storeu_si128((__m128i *)(dst + k),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + k), _MM_FROUND_TO_NEAREST_INT));
        for (; k < n; ++k) dst[k] = _cvtss_sh(src[k], _MM_FROUND_TO_NEAREST_INT);
#else
        for (; k < n; ++k) dst[k] = hz_float_to_half(src[k]);
#endif
        return;
    }
#if HZ_USE_BF16HW
    const __m512i mant = _mm512_set1_epi32(0x007fffff), expo = _mm512_set1_epi32(0x7f800000);
    for (; k + 16 <= n; k += 16) {
        __m512 x = _mm512_loadu_ps(src + k);
        __m512i xi = _mm512_castps_si512(x);
        /* vcvtneps2bf16 flushes subnormal inputs to zero; torch rounds them.  Such lanes
         * (exponent 0, mantissa != 0) are rare, so take the integer path for that vector. */
        __mmask16 sub = _mm512_mask_testn_epi32_mask(_mm512_test_epi32_mask(xi, mant), xi, expo);
        if (sub) {
            for (size_t j = 0; j < 16; ++j) dst[k + j] = hz_float_to_bf16(src[k + j]);
        } else {
            _mm256_storeu_si256((__m256i *)(dst + k), (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
#endif
    for (; k < n; ++k) dst[k] = hz_float_to_bf16(src[k]);
}

/* The update, written op for op as torch's single-tensor Adam/AdamW evaluates it on CPU
 * (measured with torch 2.13: add(alpha), lerp and addcmul use one FMA each; addcdiv is
 * self + (value * t1) / t2).  fmaf is exactly rounded, so every variant and every tail agrees
 * bit for bit; gcc turns it into vfmadd and vectorizes it.  One deviation: torch divides
 * sqrt(v) by sqrt(bc2); we multiply by its reciprocal (rounded once, in double, by the caller).
 * Division and sqrt share one unpipelined unit per core (several cycles per 8 lanes each), and
 * a 2-vCPU host may be one core with SMT: the 100M-param ceiling in docs/design.md (28 B at 57 GB/s)
 * leaves ~1.7 cycles per element at 3.5 GHz, so three div/sqrt per element risk a compute-bound
 * pass.  The cost is <= 1.5 ulp more error
 * in the denominator (the tests' tolerance covers it); with bias correction off it is exact.
 * Flags are compile-time constants after inlining: each of the 4 callers is branch-free. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_math)(float *restrict p, float *restrict m, float *restrict v, const float *restrict g,
               size_t n, const hz_adam_args *a, const int l2_on, const int small) {
    const float gs = a->grad_scale, decay = a->decay, l2 = a->l2, c = a->lerp_coef;
    const float b2 = a->beta2, omb2 = a->one_minus_beta2, rbc2 = a->inv_bc2_sqrt, eps = a->eps;
    const float ns = a->neg_step;
    for (size_t i = 0; i < n; ++i) {
        float pi = p[i] * decay;                  /* AdamW: p *= 1 - lr*wd (1.0f: exact no-op) */
        float gi = g[i] * gs;                     /* grad * inv_loss_scale * clip_coef */
        if (l2_on) gi = fmaf(l2, pi, gi);         /* Adam: grad.add(p, alpha=wd) */
        float mi = m[i];
        mi = fmaf(c, gi - mi, small ? mi : gi);   /* exp_avg.lerp_(g, 1 - beta1) */
        float vi = fmaf(omb2 * gi, gi, b2 * v[i]); /* exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2) */
        float d = sqrtf(vi) * rbc2 + eps;         /* (sqrt(v) / sqrt(bc2)).add_(eps) */
        p[i] = pi + (ns * mi) / d;                /* p.addcdiv_(m, d, value=-lr/bc1) */
        m[i] = mi;
        v[i] = vi;
    }
}

static void HZ_FN(hz_math_any)(float *restrict p, float *restrict m, float *restrict v,
                               const float *restrict g, size_t n, const hz_adam_args *a) {
    if (a->l2_on) {
        if (a->lerp_small) HZ_FN(hz_math)(p, m, v, g, n, a, 1, 1);
        else HZ_FN(hz_math)(p, m, v, g, n, a, 1, 0);
    } else {
        if (a->lerp_small) HZ_FN(hz_math)(p, m, v, g, n, a, 0, 1);
        else HZ_FN(hz_math)(p, m, v, g, n, a, 0, 0);
    }
}

#include "adam_q8_portable.h"

/* Elements [lo, hi) in tiles: each tile of grads (and bf16 moments) is widened, updated and
 * narrowed while its lines are in L1, so memory sees each buffer once.  Portable C; the fused
 * loop below is the fast path where AVX2/FMA/F16C exist, and uses this one for its last < 8
 * elements. */
static void HZ_FN(hz_tiles)(const hz_adam_args *a, size_t lo, size_t hi) {
    float gbuf[HZ_TILE] __attribute__((aligned(64)));
    float mbuf[HZ_TILE] __attribute__((aligned(64)));
    float vbuf[HZ_TILE] __attribute__((aligned(64)));
    const int bf16_state = a->state_kind == HZ_BF16;
    if (a->state_kind == HZ_Q8) {
        HZ_FN(hz_q8_range)(a, lo, hi);
        return;
    }
    if (!bf16_state && a->grad_kind == HZ_F32 && a->out_kind == HZ_NONE) {  /* nothing to stage */
        HZ_FN(hz_math_any)(a->param + lo, (float *)a->exp_avg + lo, (float *)a->exp_avg_sq + lo,
                           (const float *)a->grad + lo, hi - lo, a);
        return;
    }
    for (size_t i = lo; i < hi; i += HZ_TILE) {
        size_t n = hi - i < HZ_TILE ? hi - i : HZ_TILE;
        const float *g;
        float *m = (float *)a->exp_avg + i, *v = (float *)a->exp_avg_sq + i;
        if (a->grad_kind == HZ_F32) {
            g = (const float *)a->grad + i;
        } else {
            HZ_FN(hz_widen)(gbuf, (const uint16_t *)a->grad + i, a->grad_kind, n);
            g = gbuf;
        }
        if (bf16_state) {
            HZ_FN(hz_widen)(mbuf, (const uint16_t *)a->exp_avg + i, HZ_BF16, n);
            HZ_FN(hz_widen)(vbuf, (const uint16_t *)a->exp_avg_sq + i, HZ_BF16, n);
            m = mbuf;
            v = vbuf;
        }
        HZ_FN(hz_math_any)(a->param + i, m, v, g, n, a);
        if (bf16_state) {
            HZ_FN(hz_narrow)((uint16_t *)a->exp_avg + i, mbuf, HZ_BF16, n);
            HZ_FN(hz_narrow)((uint16_t *)a->exp_avg_sq + i, vbuf, HZ_BF16, n);
        }
        if (a->out_kind != HZ_NONE)
            HZ_FN(hz_narrow)((uint16_t *)a->out16 + i, a->param + i, a->out_kind, n);
    }
}

#if HZ_USE_F16C && defined(__AVX2__) && defined(__FMA__)
#define HZ_FUSED 1
/* 8 lanes of float -> bfloat16, the same integer round-to-nearest-even as hz_float_to_bf16. */
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

static inline __m256 HZ_FN(hz_bf16x8_load)(const uint16_t *src) {  /* exact */
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}

static inline __m128i HZ_FN(hz_bf16x8)(__m256 x) {
#if HZ_USE_BF16HW && defined(__AVX512VL__)
    /* vcvtneps2bf16 flushes subnormal inputs to zero where torch rounds them: such vectors
     * (rare) take the integer path, so both give the same bits. */
    __m256i a = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
    __m256i sub = _mm256_andnot_si256(_mm256_cmpeq_epi32(a, _mm256_setzero_si256()),
                                      _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), a));
    if (!_mm256_testz_si256(sub, sub)) return HZ_FN(hz_bf16x8_int)(x);
    return (__m128i)_mm256_cvtneps_pbh(x);
#else
    return HZ_FN(hz_bf16x8_int)(x);
#endif
}

/* Outputs of at least this many elements per thread bypass the cache (streaming stores): the
 * buffer is only read again by the host->device copy, and a normal store first reads each line
 * (2 B/param more traffic).  Measured 10M params, 2 threads, Zen 3: 7.85 -> 7.55 ms. */
#define HZ_STREAM_MIN 131072

/* The whole update for 8 lanes per iteration, grads widened and the 16-bit copy cut in
 * registers: the same operations as hz_math (so the same bits) without staging through L1.
 * Measured 10M params, fp16 in / bf16 out, 2 threads, Zen 3: 10.05 ms staged, 7.55 fused,
 * against a 6.79 ms ceiling.  gk and ok are constants after inlining. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_fused)(const hz_adam_args *a, size_t lo, size_t hi, const int gk, const int ok,
                const int sk) {
    float *restrict p = a->param;
    float *restrict m = (float *)a->exp_avg, *restrict v = (float *)a->exp_avg_sq;
    uint16_t *restrict m16 = (uint16_t *)a->exp_avg, *restrict v16 = (uint16_t *)a->exp_avg_sq;
    const __m256 gs = _mm256_set1_ps(a->grad_scale), decay = _mm256_set1_ps(a->decay);
    const __m256 l2 = _mm256_set1_ps(a->l2), c = _mm256_set1_ps(a->lerp_coef);
    const __m256 b2 = _mm256_set1_ps(a->beta2), omb2 = _mm256_set1_ps(a->one_minus_beta2);
    const __m256 rbc2 = _mm256_set1_ps(a->inv_bc2_sqrt), eps = _mm256_set1_ps(a->eps);
    const __m256 ns = _mm256_set1_ps(a->neg_step);
    const int l2_on = a->l2_on, small = a->lerp_small;
    uint16_t *out = (uint16_t *)a->out16;
    /* Not when the output is the grad buffer: its lines are in cache, just read. */
    const int stream = ok != HZ_NONE && hi - lo >= HZ_STREAM_MIN && a->out16 != a->grad;
    size_t i = lo;
    if (stream) /* streaming stores need 16-byte alignment: plain path up to it */
        while (i < hi && ((uintptr_t)(out + i) & 15u)) ++i;
    if (i != lo) HZ_FN(hz_tiles)(a, lo, i < hi ? i : hi);
    for (; i + 8 <= hi; i += 8) {
        __m256 g;
        if (gk == HZ_F32) g = _mm256_loadu_ps((const float *)a->grad + i);
        else if (gk == HZ_F16)
            g = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)a->grad + i)));
        else
            g = HZ_FN(hz_bf16x8_load)((const uint16_t *)a->grad + i);
        __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
        g = _mm256_mul_ps(g, gs);
        if (l2_on) g = _mm256_fmadd_ps(l2, pi, g);
        __m256 mi = sk == HZ_F32 ? _mm256_loadu_ps(m + i) : HZ_FN(hz_bf16x8_load)(m16 + i);
        __m256 vo = sk == HZ_F32 ? _mm256_loadu_ps(v + i) : HZ_FN(hz_bf16x8_load)(v16 + i);
        mi = _mm256_fmadd_ps(c, _mm256_sub_ps(g, mi), small ? mi : g);
        __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(b2, vo));
        __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), rbc2), eps);
        __m256 pn = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(ns, mi), d));
        _mm256_storeu_ps(p + i, pn);
        if (sk == HZ_F32) {
            _mm256_storeu_ps(m + i, mi);
            _mm256_storeu_ps(v + i, vi);
        } else {
            _mm_storeu_si128((__m128i *)(m16 + i), HZ_FN(hz_bf16x8)(mi));
            _mm_storeu_si128((__m128i *)(v16 + i), HZ_FN(hz_bf16x8)(vi));
        }
        if (ok != HZ_NONE) {
            __m128i h = ok == HZ_F16 ? _mm256_cvtps_ph(pn, _MM_FROUND_TO_NEAREST_INT)
                                     : HZ_FN(hz_bf16x8)(pn);
            if (stream) _mm_stream_si128((__m128i *)(out + i), h);
            else _mm_storeu_si128((__m128i *)(out + i), h);
        }
    }
    if (i < hi) HZ_FN(hz_tiles)(a, i, hi);
    if (stream) _mm_sfence(); /* order the streamed lines before whoever reads them next */
}

#include "adam_q8_fused.h"

static void HZ_FN(hz_adam_range)(const hz_adam_args *a, size_t lo, size_t hi) {
    if (a->state_kind == HZ_Q8) {
        switch (a->grad_kind * 4 + a->out_kind) {
#define HZ_QCASE(gk, ok) case gk * 4 + ok: HZ_FN(hz_q8_fused)(a, lo, hi, gk, ok); return;
#define HZ_QCASES(gk) HZ_QCASE(gk, HZ_F16) HZ_QCASE(gk, HZ_BF16) HZ_QCASE(gk, HZ_NONE)
        HZ_QCASES(HZ_F32) HZ_QCASES(HZ_F16) HZ_QCASES(HZ_BF16)
#undef HZ_QCASES
#undef HZ_QCASE
        default: HZ_FN(hz_q8_range)(a, lo, hi); return;
        }
    }
    switch ((a->state_kind == HZ_BF16) * 16 + a->grad_kind * 4 + a->out_kind) {
#define HZ_CASE(sk, gk, ok) \
    case (sk == HZ_BF16) * 16 + gk * 4 + ok: HZ_FN(hz_fused)(a, lo, hi, gk, ok, sk); return;
#define HZ_CASES(sk) \
    HZ_CASE(sk, HZ_F32, HZ_F16) HZ_CASE(sk, HZ_F32, HZ_BF16) \
    HZ_CASE(sk, HZ_F16, HZ_NONE) HZ_CASE(sk, HZ_F16, HZ_F16) HZ_CASE(sk, HZ_F16, HZ_BF16) \
    HZ_CASE(sk, HZ_BF16, HZ_NONE) HZ_CASE(sk, HZ_BF16, HZ_F16) HZ_CASE(sk, HZ_BF16, HZ_BF16)
    HZ_CASES(HZ_F32)
    HZ_CASES(HZ_BF16)
    HZ_CASE(HZ_BF16, HZ_F32, HZ_NONE)
#undef HZ_CASES
#undef HZ_CASE
    default: HZ_FN(hz_tiles)(a, lo, hi); /* fp32 in and state, no output: auto-vectorized */
    }
}
#else
#define HZ_FUSED 0
static void HZ_FN(hz_adam_range)(const hz_adam_args *a, size_t lo, size_t hi) {
    HZ_FN(hz_tiles)(a, lo, hi);  /* also the 8-bit moments */
}
#endif

#undef HZ_USE_F16C
#undef HZ_USE_BF16HW
#undef HZ_FUSED
