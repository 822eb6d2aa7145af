/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the 4-bit moments' codec (HZ_Q4, adam_kernel.h) on 8- and 32-lane vectors
 * with AVX2 intrinsics, for the fused pass over coded moments (adam_coded_fused.h).  Each
 * helper does the operations of adam_q4_portable.h's hz_q4_decode / hz_q4_encode, so the same
 * bits; the pass sends what they do not cover (a NaN or negative exp_avg scale, inf or NaN in a
 * block's new moments) to the portable code.  Included only where the fused path exists.  No
 * include guard on purpose. */

/* In-lane byte shuffles that move code byte b0 + e / 2 (of 8 broadcast to every 64-bit lane)
 * to byte 0 of 32-bit lane e, zeroing the others: each lane gets the byte that holds its
 * element's nibble (2j low, 2j + 1 high). */
#define HZ_Q4SEL(b0)                                                                          \
    _mm256_setr_epi8(HZ_Q4B(b0 + 0), HZ_Q4B(b0 + 0), HZ_Q4B(b0 + 1), HZ_Q4B(b0 + 1),         \
                     HZ_Q4B(b0 + 2), HZ_Q4B(b0 + 2), HZ_Q4B(b0 + 3), HZ_Q4B(b0 + 3))
#define HZ_Q4B(b) (b), -1, -1, -1

/* A block's decode tables (t: 3 vectors, what hz_q4_dec16 takes): lane k of t[0] is exp_avg's
 * value of magnitude code k (0..7) times the scale ms, of t[1] and t[2] exp_avg_sq's of code k
 * and k + 8: (value(k) * us)^2.  The same products as adam_q4_portable.h's hz_q4_mval and
 * hz_q4_vval (value(0) is 0), computed once per block instead of once per element. */
static inline void HZ_FN(hz_q4_tables)(float ms, float us, __m256 *t) {
#define HZ_Q4V(k, mb, bias) ((k) ? (int)(((k) + (bias)) << (23 - (mb))) : 0)
#define HZ_Q4M(k) HZ_Q4V(k, HZ_Q4M_MBITS, HZ_Q4M_BIAS)
#define HZ_Q4U(k) HZ_Q4V(k, HZ_Q4U_MBITS, HZ_Q4U_BIAS)
    const __m256i vm = _mm256_setr_epi32(HZ_Q4M(0), HZ_Q4M(1), HZ_Q4M(2), HZ_Q4M(3), HZ_Q4M(4),
                                         HZ_Q4M(5), HZ_Q4M(6), HZ_Q4M(7));
    const __m256i vlo = _mm256_setr_epi32(HZ_Q4U(0), HZ_Q4U(1), HZ_Q4U(2), HZ_Q4U(3), HZ_Q4U(4),
                                          HZ_Q4U(5), HZ_Q4U(6), HZ_Q4U(7));
    const __m256i vhi = _mm256_setr_epi32(HZ_Q4U(8), HZ_Q4U(9), HZ_Q4U(10), HZ_Q4U(11),
                                          HZ_Q4U(12), HZ_Q4U(13), HZ_Q4U(14), HZ_Q4U(15));
#undef HZ_Q4U
#undef HZ_Q4M
#undef HZ_Q4V
    const __m256 s = _mm256_set1_ps(us);
    __m256 lo = _mm256_mul_ps(_mm256_castsi256_ps(vlo), s);
    __m256 hi = _mm256_mul_ps(_mm256_castsi256_ps(vhi), s);
    t[0] = _mm256_mul_ps(_mm256_castsi256_ps(vm), _mm256_set1_ps(ms));
    t[1] = _mm256_mul_ps(lo, lo);
    t[2] = _mm256_mul_ps(hi, hi);
}

/* Both moments of 16 elements from their 8 code bytes each (mc, uc: element 0's byte; the
 * element is even), exp_avg_sq as v (sqrt(v) decoded, squared), from the block's tables t
 * (hz_q4_tables).  One broadcast load per moment; per 8 lanes a byte shuffle and a per-lane
 * shift put each nibble in bits 0-3 (even lanes: the other nibble above it, which vpermps
 * ignores), one table lookup for exp_avg with its sign (bit 3) OR-ed in as hz_q4_mval does,
 * two for exp_avg_sq with bit 3 choosing between them.  12 ops per 8 lanes where decoding
 * each value on its bits (value, vpsignd for code 0, the scale's product, the square) took 15.
 * bench_kernel_loop.py, 1 thread, Zen 3 (family 25 model 1): instructions per param (64K
 * params, callgrind) 10.62 -> 10.10 with an fp32 master, 11.67 -> 11.17 with a bf16 one; time
 * in cache within 1% (the vector pipes, not the instruction count, bind there), 20M params
 * 0.99 and 0.97 of before (best of 6 interleaved rounds). */
static inline __attribute__((always_inline)) void
HZ_FN(hz_q4_dec16)(const uint8_t *mc, const uint8_t *uc, const __m256 *t, __m256 *m,
                   __m256 *v) {
    uint64_t cm, cu;
    memcpy(&cm, mc, 8);
    memcpy(&cu, uc, 8);
    const __m256i bm = _mm256_set1_epi64x((long long)cm), bu = _mm256_set1_epi64x((long long)cu);
    const __m256i sh = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);  /* odd lanes: the high one */
    const __m256i sel[2] = {HZ_Q4SEL(0), HZ_Q4SEL(4)};
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    for (int h = 0; h < 2; ++h) {
        __m256i km = _mm256_srlv_epi32(_mm256_shuffle_epi8(bm, sel[h]), sh);
        __m256i ku = _mm256_srlv_epi32(_mm256_shuffle_epi8(bu, sel[h]), sh);
        __m256 mv = _mm256_permutevar8x32_ps(t[0], km);
        m[h] = _mm256_or_ps(mv, _mm256_castsi256_ps(
                                    _mm256_and_si256(_mm256_slli_epi32(km, 28), sign)));
        v[h] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[1], ku),
                                _mm256_permutevar8x32_ps(t[2], ku),
                                _mm256_castsi256_ps(_mm256_slli_epi32(ku, 28)));
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
