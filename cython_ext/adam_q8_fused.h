/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the 8-bit moments with AVX2/FMA/F16C intrinsics (included
 * only where the fused path exists). No include guard on purpose. */

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

