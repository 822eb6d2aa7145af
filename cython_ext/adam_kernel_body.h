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

/* ---- 8-bit moments: one block per iteration, decoded into L1 tiles, updated, encoded. */
static void HZ_FN(hz_q8_decode)(float *restrict m, float *restrict v, const uint8_t *restrict mc,
                                const uint8_t *restrict uc, float ms, float us, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        uint32_t c = mc[i];
        float f = hz_q_value(c & 0x7fu, HZ_QM_MBITS, HZ_QM_BIAS) * ms;
        m[i] = hz_float(hz_bits(f) | ((c & 0x80u) << 24));
        float u = hz_q_value(uc[i], HZ_QU_MBITS, HZ_QU_BIAS) * us;
        v[i] = u * u;
    }
}

static void HZ_FN(hz_q8_encode)(uint8_t *restrict mc, uint8_t *restrict uc, float *ms, float *us,
                                const float *restrict m, const float *restrict u, size_t n) {
    float sm = hz_q_scale(hz_absmax_bits(m, n)), su = hz_q_scale(hz_absmax_bits(u, n));
    float im = sm == 0.0f ? 0.0f : 1.0f / sm, iu = su == 0.0f ? 0.0f : 1.0f / su;
    for (size_t i = 0; i < n; ++i) {
        uint32_t b = hz_bits(m[i]);
        uint32_t k = hz_q_code(hz_float(b & 0x7fffffffu) * im, HZ_QM_MBITS, HZ_QM_BIAS, HZ_QM_TOP);
        mc[i] = (uint8_t)(k | (k ? (b >> 24) & 0x80u : 0u));  /* zero has one code */
        uc[i] = (uint8_t)hz_q_code(u[i] * iu, HZ_QU_MBITS, HZ_QU_BIAS, HZ_QU_TOP);
    }
    *ms = sm;
    *us = su;
}

/* hz_math with the ratio cap, writing sqrt(v) (what is stored) instead of v.  Exact Adam
 * keeps |m| <= R sqrt(v) with R = (1 - b1) / sqrt((1 - b2)(1 - b1^2 / b2)) (Cauchy-Schwarz
 * over the two moving averages, any gradients, any step): the cap never binds on exact
 * moments, and on quantized ones (a sqrt(v) rounded to zero in a block with a much larger
 * element) it keeps every update within exact Adam's own worst case. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_math_q8)(float *restrict p, float *restrict m, float *restrict v,
                  const float *restrict g, size_t n, const hz_adam_args *a, const int l2_on,
                  const int small) {
    const float gs = a->grad_scale, decay = a->decay, l2 = a->l2, c = a->lerp_coef;
    const float b2 = a->beta2, omb2 = a->one_minus_beta2, rbc2 = a->inv_bc2_sqrt, eps = a->eps;
    const float ns = a->neg_step, icap = a->inv_ratio_cap;
    for (size_t i = 0; i < n; ++i) {
        float pi = p[i] * decay;
        float gi = g[i] * gs;
        if (l2_on) gi = fmaf(l2, pi, gi);
        float mi = m[i];
        mi = fmaf(c, gi - mi, small ? mi : gi);
        float vi = fmaf(omb2 * gi, gi, b2 * v[i]);
        float si = sqrtf(vi);
        float cap = fabsf(mi) * icap;
        float d = (cap > si ? cap : si) * rbc2 + eps;  /* the operand order of vmaxps */
        p[i] = pi + (ns * mi) / d;
        m[i] = mi;
        v[i] = si;
    }
}

static void HZ_FN(hz_q8_range)(const hz_adam_args *a, size_t lo, size_t hi) {
    float gbuf[HZ_QBLOCK_MAX] __attribute__((aligned(64)));
    float mt[HZ_QBLOCK_MAX] __attribute__((aligned(64)));
    float vt[HZ_QBLOCK_MAX] __attribute__((aligned(64)));
    const size_t bs = (size_t)a->qblock;
    uint8_t *mc = (uint8_t *)a->exp_avg, *uc = (uint8_t *)a->exp_avg_sq;
    for (size_t i = lo; i < hi; i += bs) {  /* lo is a block start (the caller's contract) */
        size_t n = hi - i < bs ? hi - i : bs, blk = i / bs;
        const float *g;
        if (a->grad_kind == HZ_F32) {
            g = (const float *)a->grad + i;
        } else {
            HZ_FN(hz_widen)(gbuf, (const uint16_t *)a->grad + i, a->grad_kind, n);
            g = gbuf;
        }
        HZ_FN(hz_q8_decode)(mt, vt, mc + i, uc + i, a->m_scale[blk], a->v_scale[blk], n);
        if (a->l2_on) {
            if (a->lerp_small) HZ_FN(hz_math_q8)(a->param + i, mt, vt, g, n, a, 1, 1);
            else HZ_FN(hz_math_q8)(a->param + i, mt, vt, g, n, a, 1, 0);
        } else {
            if (a->lerp_small) HZ_FN(hz_math_q8)(a->param + i, mt, vt, g, n, a, 0, 1);
            else HZ_FN(hz_math_q8)(a->param + i, mt, vt, g, n, a, 0, 0);
        }
        if (a->out_kind != HZ_NONE)
            HZ_FN(hz_narrow)((uint16_t *)a->out16 + i, a->param + i, a->out_kind, n);
        HZ_FN(hz_q8_encode)(mc + i, uc + i, a->m_scale + blk, a->v_scale + blk, mt, vt, n);
    }
}

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

/* 8-bit moments, 8 lanes at a time: per block, decode + update + narrow in one pass that
 * keeps the new moments (m, sqrt v) in two L1 tiles and their largest magnitudes in
 * registers, then encode the tiles with the new scales.  The same operations as
 * hz_q8_decode / hz_math_q8 / hz_q8_encode, so the same bits; a block whose length is not a
 * multiple of 16 (only a buffer's last) takes that portable path. */
static inline __m256i HZ_FN(hz_q8_code8)(__m256 y, const int sh, const int bias, const int top) {
    __m256i u = _mm256_castps_si256(y);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, sh), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(
        u, _mm256_set1_epi32((1 << (sh - 1)) - 1)), lsb), sh);
    __m256i k = _mm256_sub_epi32(r, _mm256_set1_epi32(bias));
    return _mm256_min_epi32(k, _mm256_set1_epi32(top));  /* k < 0: hz_store16_u8 makes it 0 */
}

/* 16 int32 codes (<= 255; negative ones saturate to 0, the clamp of hz_q_code) -> 16 bytes. */
static inline void HZ_FN(hz_store16_u8)(uint8_t *dst, __m256i k0, __m256i k1) {
    __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(k0, k1), 0xd8);
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi16(_mm256_castsi256_si128(w),
                                                      _mm256_extracti128_si256(w, 1)));
}

static inline __m256 HZ_FN(hz_q8_value8)(__m256i k, const int sh, const int bias, __m256 s) {
    __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(bias)),
                                                     sh));
    f = _mm256_and_ps(f, _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, _mm256_setzero_si256())));
    return _mm256_mul_ps(f, s);
}

static inline uint32_t HZ_FN(hz_hmax_epu32)(__m256i x) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

static inline __attribute__((always_inline)) void
HZ_FN(hz_q8_fused)(const hz_adam_args *a, size_t lo, size_t hi, const int gk, const int ok) {
    float mt[HZ_QBLOCK_MAX] __attribute__((aligned(64)));
    float ut[HZ_QBLOCK_MAX] __attribute__((aligned(64)));
    float *restrict p = a->param;
    uint8_t *mc = (uint8_t *)a->exp_avg, *uc = (uint8_t *)a->exp_avg_sq;
    const __m256 gs = _mm256_set1_ps(a->grad_scale), decay = _mm256_set1_ps(a->decay);
    const __m256 l2 = _mm256_set1_ps(a->l2), c = _mm256_set1_ps(a->lerp_coef);
    const __m256 b2 = _mm256_set1_ps(a->beta2), omb2 = _mm256_set1_ps(a->one_minus_beta2);
    const __m256 rbc2 = _mm256_set1_ps(a->inv_bc2_sqrt), eps = _mm256_set1_ps(a->eps);
    const __m256 ns = _mm256_set1_ps(a->neg_step), icap = _mm256_set1_ps(a->inv_ratio_cap);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), sign7 = _mm256_set1_epi32(0x80);
    const int l2_on = a->l2_on, small = a->lerp_small;
    const size_t bs = (size_t)a->qblock;
    const int msh = 23 - HZ_QM_MBITS, ush = 23 - HZ_QU_MBITS;
    for (size_t b0 = lo; b0 < hi; b0 += bs) {
        size_t n = hi - b0 < bs ? hi - b0 : bs, blk = b0 / bs;
        if (n & 15u) {  /* a buffer's last, short block */
            HZ_FN(hz_q8_range)(a, b0, hi);
            return;
        }
        const __m256 ms = _mm256_set1_ps(a->m_scale[blk]), us = _mm256_set1_ps(a->v_scale[blk]);
        __m256i mmax = _mm256_setzero_si256(), umax = _mm256_setzero_si256();
        for (size_t j = 0; j < n; j += 8) {
            size_t i = b0 + j;
            __m256 g;
            if (gk == HZ_F32) g = _mm256_loadu_ps((const float *)a->grad + i);
            else if (gk == HZ_F16)
                g = _mm256_cvtph_ps(
                    _mm_loadu_si128((const __m128i *)((const uint16_t *)a->grad + i)));
            else g = HZ_FN(hz_bf16x8_load)((const uint16_t *)a->grad + i);
            __m256i cm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mc + i)));
            __m256i cu = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(uc + i)));
            __m256 mi = HZ_FN(hz_q8_value8)(_mm256_and_si256(cm, _mm256_set1_epi32(0x7f)), msh,
                                            HZ_QM_BIAS, ms);
            mi = _mm256_castsi256_ps(_mm256_or_si256(
                _mm256_castps_si256(mi), _mm256_slli_epi32(_mm256_and_si256(cm, sign7), 24)));
            __m256 uo = HZ_FN(hz_q8_value8)(cu, ush, HZ_QU_BIAS, us);
            __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
            g = _mm256_mul_ps(g, gs);
            if (l2_on) g = _mm256_fmadd_ps(l2, pi, g);
            mi = _mm256_fmadd_ps(c, _mm256_sub_ps(g, mi), small ? mi : g);
            __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g,
                                        _mm256_mul_ps(b2, _mm256_mul_ps(uo, uo)));
            __m256 si = _mm256_sqrt_ps(vi);
            __m256 cap = _mm256_mul_ps(_mm256_and_ps(mi, _mm256_castsi256_ps(abs_mask)), icap);
            __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_max_ps(cap, si), rbc2), eps);
            __m256 pn = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(ns, mi), d));
            _mm256_storeu_ps(p + i, pn);
            if (ok != HZ_NONE) {
                __m128i h = ok == HZ_F16 ? _mm256_cvtps_ph(pn, _MM_FROUND_TO_NEAREST_INT)
                                         : HZ_FN(hz_bf16x8)(pn);
                _mm_storeu_si128((__m128i *)((uint16_t *)a->out16 + i), h);
            }
            _mm256_store_ps(mt + j, mi);
            _mm256_store_ps(ut + j, si);
            mmax = _mm256_max_epu32(mmax, _mm256_and_si256(_mm256_castps_si256(mi), abs_mask));
            umax = _mm256_max_epu32(umax, _mm256_and_si256(_mm256_castps_si256(si), abs_mask));
        }
        float sm = hz_q_scale(HZ_FN(hz_hmax_epu32)(mmax));
        float su = hz_q_scale(HZ_FN(hz_hmax_epu32)(umax));
        const __m256 im = _mm256_set1_ps(sm == 0.0f ? 0.0f : 1.0f / sm);
        const __m256 iu = _mm256_set1_ps(su == 0.0f ? 0.0f : 1.0f / su);
        for (size_t j = 0; j < n; j += 16) {  /* n: a multiple of 16 here */
            __m256i km[2], ku[2];
            for (int h = 0; h < 2; ++h) {
                __m256i bm = _mm256_castps_si256(_mm256_load_ps(mt + j + 8 * h));
                __m256i k = HZ_FN(hz_q8_code8)(
                    _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(bm, abs_mask)), im),
                    msh, HZ_QM_BIAS, HZ_QM_TOP);
                __m256i sgn = _mm256_and_si256(_mm256_srli_epi32(bm, 24), sign7);
                sgn = _mm256_and_si256(sgn, _mm256_cmpgt_epi32(k, _mm256_setzero_si256()));
                km[h] = _mm256_or_si256(k, sgn);
                ku[h] = HZ_FN(hz_q8_code8)(_mm256_mul_ps(_mm256_load_ps(ut + j + 8 * h), iu),
                                           ush, HZ_QU_BIAS, HZ_QU_TOP);
            }
            HZ_FN(hz_store16_u8)(mc + b0 + j, km[0], km[1]);
            HZ_FN(hz_store16_u8)(uc + b0 + j, ku[0], ku[1]);
        }
        a->m_scale[blk] = sm;
        a->v_scale[blk] = su;
    }
}

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
