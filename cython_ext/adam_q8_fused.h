/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the 8-bit moments' codec with AVX2/FMA/F16C intrinsics, for the fused pass
 * over coded moments (adam_coded_fused.h; adam_q4_fused.h uses its code8 and pack32 too).
 * Included only where the fused path exists. No include guard on purpose. */

/* How the fused 8-bit pass (adam_coded_fused.h: decode and update, params, encode) came to be.
 * Single thread, 64K elements (in cache), bf16 grads in / bf16 params out over them, Zen 3:
 * 1.54 -> 1.02 -> 0.89 ns/param (quietest of many runs).  Where from: codes widened and
 * decoded with in-lane byte shuffles and vpsignd (no vpmovzxbd, compare and mask); the
 * encode's bias folded into its rounding constant, its clamps and signs applied on packed 16-
 * and 8-bit lanes; the bf16 copy rounded 16 lanes at a time (hz_bf16x16); ~14% from splitting
 * the update at sqrt(v) into passes 1 and 2 (as hz_fused); ~6% from rounding ties away (the
 * encode: 2 ops per 8 lanes, not 5) and ~3% from beta1 and sqrt(beta2) in the decode scales
 * (no lerp subtract, no multiply by beta2).  The pass is then ~140 instructions per 16
 * elements, about 3.5 per cycle: pass 1 ~45%, pass 2 ~35%, the encode ~20% of the time.
 * Tried and slower: the encode inside pass 2 (-6%; its sqrt(v) half alone -5%), the encode of
 * the previous block interleaved with this one's update (-14%), a separate decode pass (no
 * change), one burst of prefetches per block instead of one per line in pass 1 (100M params,
 * 1 thread: -10%).  Measured and left: no sqrt at all would save 8%, no encode pass 21%
 * (0.89 -> 0.70 ns/param); power-of-two block scales with the encode on 16-bit halves (no
 * multiply, 16 lanes per add and shift) changed nothing measurable, most likely because the
 * encode's shifts and packs share two of Zen 3's four vector pipes.  Prefetch hints T1 / NTA
 * and distances 1024-4096 made no difference at 100M params. */

/* In-lane byte shuffles that move code byte e (of 16 broadcast to both lanes) to byte `at` of
 * 32-bit lane e - 8h (h: which 8 of the 16), zeroing the others: the code shifted left by
 * 8 * at in one shuffle. */
#define HZ_Q8SEL(at, e0)                                                                      \
    _mm256_setr_epi8(HZ_Q8B(at, e0 + 0), HZ_Q8B(at, e0 + 1), HZ_Q8B(at, e0 + 2),             \
                     HZ_Q8B(at, e0 + 3), HZ_Q8B(at, e0 + 4), HZ_Q8B(at, e0 + 5),             \
                     HZ_Q8B(at, e0 + 6), HZ_Q8B(at, e0 + 7))
#define HZ_Q8B(at, e) (at) == 0 ? (e) : -1, (at) == 1 ? (e) : -1, (at) == 2 ? (e) : -1,      \
                      (at) == 3 ? (e) : -1

/* exp_avg from its code c (code << 24 in each lane): (value of c & 0x7f) * scale, negative
 * when c & 0x80.  value: ((k + bias) << 20) as float bits, 0 for k = 0 (vpsignd by k: no
 * compare and mask).  The product with -scale equals the portable decode's product with its
 * sign OR-ed in for every scale >= +0 and +inf, not for a NaN or negative one: the caller
 * sends those blocks (never written by an encode but NaN) to the portable path. */
static inline __m256 HZ_FN(hz_q8_mdec)(__m256i full, __m256 ms, __m256 nms) {
    const int sh = 23 - HZ_QM_MBITS;
    __m256i mag = _mm256_and_si256(full, _mm256_set1_epi32(0x7f000000));
    __m256i y = _mm256_add_epi32(_mm256_srli_epi32(mag, 24 - sh),
                                 _mm256_set1_epi32((int)(HZ_QM_BIAS << sh)));
    y = _mm256_sign_epi32(y, mag);
    return _mm256_mul_ps(_mm256_castsi256_ps(y),
                         _mm256_blendv_ps(ms, nms, _mm256_castsi256_ps(full)));
}

/* sqrt(exp_avg_sq) from its code (code << 16 in each lane). */
static inline __m256 HZ_FN(hz_q8_udec)(__m256i x, __m256 us) {
    const int sh = 23 - HZ_QU_MBITS;
    __m256i y = _mm256_add_epi32(_mm256_slli_epi32(x, sh - 16),
                                 _mm256_set1_epi32((int)(HZ_QU_BIAS << sh)));
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_sign_epi32(y, x)), us);
}

/* hz_q_code on 8 lanes of y >= 0, finite, less the clamps: the bias is folded into the
 * rounding constant and the shift is arithmetic, so a code below 0 comes out negative (and
 * vpackusdw makes it 0).  With a clamp at the top, checked against hz_q_code for every finite
 * y >= 0; see hz_q8_pack32 for why the top needs none here. */
static inline __m256i HZ_FN(hz_q8_code8)(__m256 y, const int sh, const int bias) {
    __m256i t = _mm256_add_epi32(_mm256_castps_si256(y), _mm256_set1_epi32((1 << (sh - 1)) -
                                                                            (bias << sh)));
    return _mm256_srai_epi32(t, sh);
}

/* 4 x 8 codes -> 32 bytes, negative ones 0, in vpackus's lane order (hz_q8_store32 puts them in
 * element order).  No clamp at the top code: with a finite scale s >= FLT_MIN (the caller's
 * condition: no inf or NaN in the block), every y = |x| * RN(1/s) <= s * RN(1/s) = RN(1 + d),
 * |d| <= 2^-21 even where 1/s is subnormal, which rounds to a code <= top. */
static inline __m256i HZ_FN(hz_q8_pack32)(__m256i k0, __m256i k1, __m256i k2, __m256i k3) {
    return _mm256_packus_epi16(_mm256_packus_epi32(k0, k1), _mm256_packus_epi32(k2, k3));
}

/* Stores hz_q8_pack32's 32 bytes (its first 16 when half) in element order: its lanes hold the
 * 4-byte groups of elements 0-3, 8-11, 16-19, 24-27 and 4-7, 12-15, ...  A lane swap and two
 * unpacks interleave them (~1% faster than one vpermd, which takes two uops on Zen 3). */
static inline void HZ_FN(hz_q8_store32)(uint8_t *dst, __m256i x, const int half) {
    __m256i y = _mm256_permute2x128_si256(x, x, 0x01);
    _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(_mm256_unpacklo_epi32(x, y)));
    if (!half)
        _mm_storeu_si128((__m128i *)(dst + 16),
                         _mm256_castsi256_si128(_mm256_unpackhi_epi32(x, y)));
}

/* Encode 32 lanes (16 when half: lanes 16-31 repeat 0-15) of the tiles at mt, ut; finite
 * scales only (inverses im, iu). */
static inline __attribute__((always_inline)) void
HZ_FN(hz_q8_enc32)(uint8_t *mc, uint8_t *uc, const float *mt, const float *ut, __m256 im,
                   __m256 iu, const int half) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m[4], u[4];
    __m256i km[4], ku[4];
    for (int h = 0; h < 4; ++h) {
        int o = 8 * (half ? h & 1 : h);
        m[h] = _mm256_load_ps(mt + o);
        u[h] = _mm256_load_ps(ut + o);
        km[h] = HZ_FN(hz_q8_code8)(_mm256_mul_ps(_mm256_and_ps(m[h], abs_mask), im),
                                   23 - HZ_QM_MBITS, HZ_QM_BIAS);
        ku[h] = HZ_FN(hz_q8_code8)(_mm256_mul_ps(u[h], iu), 23 - HZ_QU_MBITS, HZ_QU_BIAS);
    }
    __m256i kb = HZ_FN(hz_q8_pack32)(km[0], km[1], km[2], km[3]);
    /* sign bytes: signed saturation keeps each float's sign bit */
    __m256i sb = _mm256_packs_epi16(
        _mm256_packs_epi32(_mm256_castps_si256(m[0]), _mm256_castps_si256(m[1])),
        _mm256_packs_epi32(_mm256_castps_si256(m[2]), _mm256_castps_si256(m[3])));
    sb = _mm256_sign_epi8(_mm256_and_si256(sb, _mm256_set1_epi8((char)0x80)), kb);  /* k > 0 */
    HZ_FN(hz_q8_store32)(mc, _mm256_or_si256(kb, sb), half);
    HZ_FN(hz_q8_store32)(uc, HZ_FN(hz_q8_pack32)(ku[0], ku[1], ku[2], ku[3]), half);
}

/* A block's decode constants (t: 3 vectors, what hz_q8_dec16 takes): exp_avg's scale ms, its
 * negation, and exp_avg_sq's scale us (of sqrt(v)), each broadcast. */
static inline void HZ_FN(hz_q8_tables)(float ms, float us, __m256 *t) {
    t[0] = _mm256_set1_ps(ms);
    t[1] = _mm256_set1_ps(-ms);
    t[2] = _mm256_set1_ps(us);
}

/* Both moments of 16 elements from their 16 code bytes each (mc, uc: element 0's), exp_avg_sq
 * as v (sqrt(v) decoded, squared), with the block's constants t (hz_q8_tables). */
static inline __attribute__((always_inline)) void
HZ_FN(hz_q8_dec16)(const uint8_t *mc, const uint8_t *uc, const __m256 *t, __m256 *m,
                   __m256 *v) {
    const __m256i selm[2] = {HZ_Q8SEL(3, 0), HZ_Q8SEL(3, 8)};  /* code << 24 */
    const __m256i selu[2] = {HZ_Q8SEL(2, 0), HZ_Q8SEL(2, 8)};  /* code << 16 */
    __m256i bm = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mc));
    __m256i bu = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)uc));
    for (int h = 0; h < 2; ++h) {
        m[h] = HZ_FN(hz_q8_mdec)(_mm256_shuffle_epi8(bm, selm[h]), t[0], t[1]);
        __m256 u = HZ_FN(hz_q8_udec)(_mm256_shuffle_epi8(bu, selu[h]), t[2]);
        v[h] = _mm256_mul_ps(u, u);
    }
}

#undef HZ_Q8B
#undef HZ_Q8SEL
