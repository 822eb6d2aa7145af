/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the 4-bit moments' codec (HZ_Q4, adam_kernel.h) on 8- and 32-lane vectors
 * with AVX2 intrinsics, for the fused pass over coded moments (adam_coded_fused.h).  Each
 * helper does the operations of adam_q4_portable.h's hz_q4_decode / hz_q4_encode, so the same
 * bits; the pass sends what they do not cover (a NaN or negative exp_avg scale, inf or NaN in a
 * block's new moments) to the portable code.  Included only where the fused path exists.  No
 * include guard on purpose. */

/* In-lane byte shuffles that move code byte b0 + e / 2 (of 8 broadcast to every 64-bit lane)
 * to byte `at` of 32-bit lane e, zeroing the others: each lane gets the byte that holds its
 * element's nibble (2j low, 2j + 1 high), shifted left by 8 * at. */
#define HZ_Q4SEL(at, b0)                                                                      \
    _mm256_setr_epi8(HZ_Q4B(at, b0 + 0), HZ_Q4B(at, b0 + 0), HZ_Q4B(at, b0 + 1),             \
                     HZ_Q4B(at, b0 + 1), HZ_Q4B(at, b0 + 2), HZ_Q4B(at, b0 + 2),             \
                     HZ_Q4B(at, b0 + 3), HZ_Q4B(at, b0 + 3))
#define HZ_Q4B(at, b) (at) == 0 ? (b) : -1, (at) == 1 ? (b) : -1, (at) == 2 ? (b) : -1,      \
                      (at) == 3 ? (b) : -1

/* exp_avg of 8 lanes whose codes sit in bits 28-31 (bits 24-27 may hold the other nibble):
 * value(c & 7) * scale, negative when c & 8.  value: ((k + bias) << 23) as float bits, 0 for
 * k = 0 (vpsignd by k).  The product with -scale equals the portable decode's product with its
 * sign OR-ed in for every scale >= +0 and +inf, not for a NaN or negative one: the caller sends
 * those blocks to the portable path (as hz_q8_mdec's). */
static inline __m256 HZ_FN(hz_q4_mdec)(__m256i x, __m256 ms, __m256 nms) {
    __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x70000000));
    __m256i y = _mm256_add_epi32(_mm256_srli_epi32(mag, 28 - 23),
                                 _mm256_set1_epi32((int)(HZ_Q4M_BIAS << 23)));
    y = _mm256_sign_epi32(y, mag);
    return _mm256_mul_ps(_mm256_castsi256_ps(y),
                         _mm256_blendv_ps(ms, nms, _mm256_castsi256_ps(x)));
}

/* sqrt(exp_avg_sq) of 8 lanes from their codes c << 22 (nothing else set). */
static inline __m256 HZ_FN(hz_q4_udec)(__m256i x, __m256 us) {
    const int sh = 23 - HZ_Q4U_MBITS;
    __m256i y = _mm256_add_epi32(x, _mm256_set1_epi32((int)(HZ_Q4U_BIAS << sh)));
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_sign_epi32(y, x)), us);
}

/* Both moments of 16 elements from their 8 code bytes each (mc, uc: element 0's byte; the
 * element is even).  One broadcast load per moment, then per 8 lanes a byte shuffle and a
 * per-lane shift (even lanes by 4 more: their nibble is the low one) put each nibble where
 * the decode wants it. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_q4_dec16)(const uint8_t *mc, const uint8_t *uc, __m256 ms, __m256 nms, __m256 us,
                   __m256 *m, __m256 *u) {
    uint64_t cm, cu;
    memcpy(&cm, mc, 8);
    memcpy(&cu, uc, 8);
    const __m256i bm = _mm256_set1_epi64x((long long)cm), bu = _mm256_set1_epi64x((long long)cu);
    const __m256i shm = _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0);  /* to bits 28-31 */
    const __m256i shu = _mm256_setr_epi32(6, 2, 6, 2, 6, 2, 6, 2);  /* to bits 22-25 */
    const __m256i selm[2] = {HZ_Q4SEL(3, 0), HZ_Q4SEL(3, 4)};
    const __m256i selu[2] = {HZ_Q4SEL(2, 0), HZ_Q4SEL(2, 4)};
    for (int h = 0; h < 2; ++h) {
        m[h] = HZ_FN(hz_q4_mdec)(_mm256_sllv_epi32(_mm256_shuffle_epi8(bm, selm[h]), shm), ms,
                                 nms);
        __m256i xu = _mm256_sllv_epi32(_mm256_shuffle_epi8(bu, selu[h]), shu);
        u[h] = HZ_FN(hz_q4_udec)(_mm256_and_si256(xu, _mm256_set1_epi32(0x0f << 22)), us);
    }
}

/* Encode 32 lanes (16 when half: lanes 16-31 repeat 0-15) of the tiles at mt, ut into 16 code
 * bytes per moment (8 when half); finite scales only (inverses im, iu).  The codes as the
 * 8-bit encode cuts them (hz_q8_code8, hz_q8_pack32: the same no-clamp argument holds, y <=
 * 1 + 2^-21 is below both 4-bit codes' next step), then paired into bytes: vpmaddubsw with
 * weights 1 and 16 makes c(2j) + 16 c(2j + 1) of each pair, which vpackus's lane order keeps
 * adjacent; one pack and two 16-bit unpacks of its halves put both moments' bytes in order. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_q4_enc32)(uint8_t *mc, uint8_t *uc, const float *mt, const float *ut, __m256 im,
                   __m256 iu, const int half) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m[4], u[4];
    __m256i km[4], ku[4];
    for (int h = 0; h < 4; ++h) {
        int o = 8 * (half ? h & 1 : h);
        m[h] = _mm256_load_ps(mt + o);
        u[h] = _mm256_load_ps(ut + o);
        km[h] = HZ_FN(hz_q8_code8)(_mm256_mul_ps(_mm256_and_ps(m[h], abs_mask), im),
                                   23 - HZ_Q4M_MBITS, HZ_Q4M_BIAS);
        ku[h] = HZ_FN(hz_q8_code8)(_mm256_mul_ps(u[h], iu), 23 - HZ_Q4U_MBITS, HZ_Q4U_BIAS);
    }
    __m256i kb = HZ_FN(hz_q8_pack32)(km[0], km[1], km[2], km[3]);
    /* sign bytes: signed saturation keeps each float's sign bit (0x80), moved to bit 3 of its
     * byte (a 16-bit shift: the other byte's bit 7 lands on its own bit 3); zero codes none */
    __m256i sb = _mm256_packs_epi16(
        _mm256_packs_epi32(_mm256_castps_si256(m[0]), _mm256_castps_si256(m[1])),
        _mm256_packs_epi32(_mm256_castps_si256(m[2]), _mm256_castps_si256(m[3])));
    sb = _mm256_srli_epi16(_mm256_and_si256(sb, _mm256_set1_epi8((char)0x80)), 4);
    sb = _mm256_sign_epi8(sb, kb);
    const __m256i w = _mm256_set1_epi16(0x1001);  /* bytes 1, 16 */
    __m256i pm = _mm256_maddubs_epi16(_mm256_or_si256(kb, sb), w);
    __m256i pu = _mm256_maddubs_epi16(HZ_FN(hz_q8_pack32)(ku[0], ku[1], ku[2], ku[3]), w);
    /* pairs per 128-bit lane: lane 0 holds pairs 0 1 4 5 8 9 12 13, lane 1 2 3 6 7 10 11 14 15 */
    __m256i b = _mm256_packus_epi16(pm, pu);
    __m128i l0 = _mm256_castsi256_si128(b), l1 = _mm256_extracti128_si256(b, 1);
    __m128i om = _mm_unpacklo_epi16(l0, l1), ou = _mm_unpackhi_epi16(l0, l1);
    if (half) {
        _mm_storel_epi64((__m128i *)mc, om);
        _mm_storel_epi64((__m128i *)uc, ou);
    } else {
        _mm_storeu_si128((__m128i *)mc, om);
        _mm_storeu_si128((__m128i *)uc, ou);
    }
}

#undef HZ_Q4B
#undef HZ_Q4SEL
