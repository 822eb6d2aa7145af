/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the bf16 master inside the fused passes (adam_fused.h, adam_coded_fused.h),
 * with AVX2 intrinsics.  Their mk argument (HZ_F32 or HZ_BF16, a constant after inlining)
 * says where the params live: an fp32 master at a->param, or a bf16 one at a->master16,
 * widened as the pass loads it and rounded stochastically as it stores the new values, into
 * the master and its 16-bit copy (out16) at once.  The same bits as hz_m16_tiles (the
 * portable path: a tile widened, the fp32-master pass, hz_float_to_bf16_sr, a copy), without
 * its second and third sweeps over each tile, and with the prefetch of the whole call (each
 * 4096-element tile was a call of its own, below HZ_PREFETCH_MIN).  Single thread, bf16
 * grads in / params out over them, int8 moments, Zen 3 shared: 64K elements (in cache) 1.25
 * -> 0.95 ns/param (the fp32 master: 0.87); 10M params 3.13 -> 1.45 (the fp32 master: 1.72).
 * docs/measurements.md, "The fused int4 pass and the fused bf16 master".  Included only where
 * the fused path exists.  No include guard on purpose. */

/* 8 params from element e of the master pm (a->param, or a->master16 when mk is HZ_BF16).
 * The passes take their buffers as locals, not through a: a store through a float or byte
 * pointer may alias *a, so gcc reloaded a->param after each one (3 loads and an address per
 * 16 elements of pass 2). */
static inline __attribute__((always_inline)) __m256 HZ_FN(hz_p8)(const void *pm, size_t e,
                                                                  const int mk) {
    if (mk == HZ_BF16) return HZ_FN(hz_bf16x8_load)((const uint16_t *)pm + e);  /* exact */
    return _mm256_loadu_ps((const float *)pm + e);
}

/* hz_hash32 (lowbias32) on 8 lanes: vpmulld is the 32-bit multiply it was chosen for. */
static inline __m256i HZ_FN(hz_hash32x8)(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* hz_float_to_bf16_sr of 8 lanes with random words r, as 32-bit lanes: (u + (r & 0xffff)) >>
 * 16, no wrap for any non-NaN u (|u| <= inf's bits); nan: the lanes may hold a NaN, which
 * then keeps its sign and top payload, quieted (hz_float_to_bf16_sr's select). */
static inline __m256i HZ_FN(hz_sr8)(__m256 x, __m256i r, int nan) {
    __m256i u = _mm256_castps_si256(x);
    __m256i low = _mm256_and_si256(r, _mm256_set1_epi32(0xffff));
    __m256i s = _mm256_srli_epi32(_mm256_add_epi32(u, low), 16);
    if (__builtin_expect(nan, 0)) {
        __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        s = _mm256_blendv_epi8(s, q, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    }
    return s;
}

/* Stores the 16 new params x0 (elements e..e+7), x1 (e+8..e+15) into the master pm (as
 * hz_p8): fp32 as they are; bf16 rounded stochastically, into the master and, unless ok is
 * HZ_NONE, out (a->out16: the same values; it may be the master itself).  With an fp32
 * master, out gets the round to nearest (ok) of hz_out16.  ctr: the bf16 master's counters of elements e..e+7 (hz_sr_ctr), moved on by 16:
 * element e's bits are hz_hash32(sr_key + sr_first + e); a running counter saves the
 * broadcast of e, 2 of the ~30 vector ops that the rounding adds per 16 elements. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_pstore16)(void *pm, uint16_t *out, size_t e, __m256 x0, __m256 x1, __m256i *ctr,
                   const int ok, const int mk, const int stream) {
    if (mk == HZ_F32) {
        _mm256_storeu_ps((float *)pm + e, x0);
        _mm256_storeu_ps((float *)pm + e + 8, x1);
        if (ok == HZ_NONE) return;
        __m256i hv = HZ_FN(hz_out16)(x0, x1, ok);
        if (stream) _mm256_stream_si256((__m256i *)(out + e), hv);
        else _mm256_storeu_si256((__m256i *)(out + e), hv);
        return;
    }
    __m256i r0 = HZ_FN(hz_hash32x8)(*ctr);
    __m256i r1 = HZ_FN(hz_hash32x8)(_mm256_add_epi32(*ctr, _mm256_set1_epi32(8)));
    *ctr = _mm256_add_epi32(*ctr, _mm256_set1_epi32(16));
    int nan = _mm256_movemask_ps(_mm256_cmp_ps(x0, x1, _CMP_UNORD_Q));
    __m256i hv = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(HZ_FN(hz_sr8)(x0, r0, nan), HZ_FN(hz_sr8)(x1, r1, nan)), 0xd8);
    _mm256_storeu_si256((__m256i *)((uint16_t *)pm + e), hv);
    if (ok != HZ_NONE) _mm256_storeu_si256((__m256i *)(out + e), hv);
}

/* The counters hz_pstore16 takes for elements e..e+7 (unused with an fp32 master). */
static inline __m256i HZ_FN(hz_sr_ctr)(const hz_adam_args *a, size_t e) {
    return _mm256_add_epi32(_mm256_set1_epi32((int)(a->sr_key + a->sr_first + (uint32_t)e)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
