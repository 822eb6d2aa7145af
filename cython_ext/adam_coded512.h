/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the fused pass over 8- or 4-bit moments (adam_coded_fused.h's) on 16-lane
 * zmm vectors, for an fp32 or a bf16 master (mk, as adam_m16_fused.h), for variants with
 * AVX-512F/BW/VL and AVX512-BF16.  Included only there.  No include guard on purpose.
 *
 * The same operations on every lane as adam_coded_fused.h (so the same bits as it and as the
 * portable hz_q8_range / hz_q4_range), taking the same cases to the portable path (a block
 * whose length is not a multiple of 16, a NaN or negative exp_avg scale, inf or NaN in a
 * block's new moments).  What AVX-512 changes is the count: twice the lanes per op, and masks
 * and narrowing stores where the 256-bit codecs shuffle, pack and blend.  The 8-bit codes widen
 * with one vpmovzxbd and decode with masked adds (a zero code gives 0 by its mask, where AVX2
 * took vpsignd); a 4-bit code is its own index into a 16-entry table (vpermps over 16 lanes:
 * exp_avg's sign in the table's upper half, exp_avg_sq in one table, where 8 lanes took a
 * table, an OR and a blend of two); the bf16 copy is one vcvtneps2bf16 per 16 params.
 *
 * Two loops per block: pass 1 (decode, the moments, sqrt(v), and a bf16 master's random
 * words, which depend on an element's index alone), then the params (pass 2) and the encode
 * (pass 3) of 64 elements at a time, which the block's scales, known once pass 1 has run,
 * allow.  The encode packs 64 codes with two vpackusdw and a vpackuswb (whose unsigned
 * saturation is the clamp at 0) and puts them in order with one vpermd; 4-bit codes are then
 * paired by vpmaddubsw and narrowed by vpmovwb.  Per 16 lanes it had taken a clamp, a vpmovdb
 * (8-bit; 2 uops) or a shift, an OR and a vpmovqb (4-bit), for each moment.
 * What bounds it, on the Xeon of family 6 model 167 (bench_kernel_loop.py --ports; its VM has
 * no performance counters): zmm work issues on two ports alone, FP math and integer adds and
 * logic on either, shifts and vpmaxud on port 0 only, every shuffle, permute, pack, widening
 * and compare into a mask on port 5 only.  Counted from objdump (bf16 grads in, params out),
 * per 16 params on those two ports: fp32 master 38.5 uops (4-bit codes) and 47 (8-bit), bf16
 * master 50.5 and 59; the divider (23.8 cycles per 16 lanes) holds port 0 ~11 cycles of
 * them.  In cache the pass takes ~34-40 cycles per 16: the count of uops, not the divider,
 * sets its time (cut out, the divide saves 2.3 cycles per 16, the sqrt 2.6), and the choices
 * below are weighed in those uops.
 *
 * Why only with AVX512-BF16 (Zen 4, Sapphire Rapids and later, Cooper Lake): on the Xeons
 * before it (Skylake-X to Ice Lake), zmm FP work lowers the core's clock for a while.  The
 * divider gains nothing from the width: the probe (bench_kernel_loop.py --clock and a zmm
 * twin of it) times vsqrtps + vdivps at 11.1 cycles per 8 lanes and 23.7 per 16 on the Xeon
 * of family 6 model 167: the update's floor stays ~1.4-1.5 cycles per param. */

/* 16 bf16 -> 16 floats, exact. */
static inline __m512 HZ_FN(hz5_bf16_load)(const uint16_t *src) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline __attribute__((always_inline)) __m512 HZ_FN(hz5_grad)(const void *grad, size_t i,
                                                                    const int gk) {
    if (gk == HZ_F32) return _mm512_loadu_ps((const float *)grad + i);
    if (gk == HZ_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)grad + i)));
    return HZ_FN(hz5_bf16_load)((const uint16_t *)grad + i);
}

/* 16 lanes -> bf16 by hz_float_to_bf16's integer rounding, for every input. */
static inline __m256i HZ_FN(hz5_bf16_int)(__m512 x) {
    __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                    _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* The 16-bit copy of 16 new params of an fp32 master: fp16 or bf16, round to nearest even.
 * vcvtneps2bf16 flushes subnormal inputs to zero where torch rounds them: a vector with one
 * (rare) takes the integer path. */
static inline __m256i HZ_FN(hz5_out16)(__m512 x, const int ok) {
    if (ok == HZ_F16) return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    __m512i xi = _mm512_castps_si512(x);
    __mmask16 sub = _mm512_mask_testn_epi32_mask(
        _mm512_test_epi32_mask(xi, _mm512_set1_epi32(0x007fffff)), xi,
        _mm512_set1_epi32(0x7f800000));
    if (__builtin_expect(sub != 0, 0)) return HZ_FN(hz5_bf16_int)(x);
    return (__m256i)_mm512_cvtneps_pbh(x);
}

/* 16 params from element e of the master pm (a->param, or a->master16 when mk is HZ_BF16). */
static inline __attribute__((always_inline)) __m512 HZ_FN(hz5_p)(const void *pm, size_t e,
                                                                 const int mk) {
    if (mk == HZ_BF16) return HZ_FN(hz5_bf16_load)((const uint16_t *)pm + e);  /* exact */
    return _mm512_loadu_ps((const float *)pm + e);
}

/* The low 16 bits of hz_hash32 (lowbias32) on 16 lanes: all that the rounding adds.  Its last
 * xor and the mask are one vpternlogd. */
static inline __m512i HZ_FN(hz5_hash16)(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_ternarylogic_epi32(x, _mm512_srli_epi32(x, 16), _mm512_set1_epi32(0xffff),
                                     0x28);  /* (x ^ (x >> 16)) & 0xffff */
}

/* hz_float_to_bf16_sr of 16 lanes x with their random words r (hz5_hash16's), in the upper
 * half of each 32-bit lane (the lower half is not part of it): hz_sr8's operations, the NaN
 * case by a masked OR rather than a branch. */
static inline __m512i HZ_FN(hz5_sr)(__m512 x, __m512i r) {
    __m512i u = _mm512_castps_si512(x);
    __m512i s = _mm512_add_epi32(u, r);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);  /* sign and top payload, quieted */
    return _mm512_mask_or_epi32(s, nan, u, _mm512_set1_epi32(0x00400000));
}

/* Stores 16 new params x (elements e..e+15) into the master pm (as hz5_p): fp32 as they are,
 * and unless ok is HZ_NONE their 16-bit copy (hz5_out16); bf16 rounded stochastically as
 * hz_pstore16 does (element e's random word hz_hash32(sr_key + sr_first + e), its low 16 bits
 * in rt: pass 1 hashes them), into the master and, unless ok is HZ_NONE, out (the same
 * values; it may be the master itself). */
static inline __attribute__((always_inline)) void
HZ_FN(hz5_pstore)(void *pm, uint16_t *out, size_t e, __m512 x, const uint32_t *rt,
                  const int ok, const int mk) {
    if (mk == HZ_F32) {
        _mm512_storeu_ps((float *)pm + e, x);
        if (ok != HZ_NONE)
            _mm256_storeu_si256((__m256i *)(out + e), HZ_FN(hz5_out16)(x, ok));
        return;
    }
    __m256i h = _mm512_cvtepi32_epi16(
        _mm512_srli_epi32(HZ_FN(hz5_sr)(x, _mm512_load_si512((const void *)rt)), 16));
    _mm256_storeu_si256((__m256i *)((uint16_t *)pm + e), h);
    if (ok != HZ_NONE) _mm256_storeu_si256((__m256i *)(out + e), h);
}

/* exp_avg of 16 elements from their 8-bit codes c (one per lane): the value of c & 0x7f,
 * ((k + bias) << 20) as float bits and 0 for k = 0, times the scale, or its negation where
 * c & 0x80 (hz_q8_mdec's products). */
static inline __m512 HZ_FN(hz5_q8_mdec)(__m512i c, __m512 ms, __m512 nms) {
    const int sh = 23 - HZ_QM_MBITS;
    __mmask16 nz = _mm512_test_epi32_mask(c, _mm512_set1_epi32(0x7f));
    __mmask16 neg = _mm512_test_epi32_mask(c, _mm512_set1_epi32(0x80));
    __m512i k = _mm512_and_si512(_mm512_slli_epi32(c, sh), _mm512_set1_epi32(0x7f << sh));
    __m512i y = _mm512_maskz_add_epi32(nz, k, _mm512_set1_epi32((int)(HZ_QM_BIAS << sh)));
    return _mm512_mul_ps(_mm512_castsi512_ps(y), _mm512_mask_blend_ps(neg, ms, nms));
}

/* sqrt(exp_avg_sq) of 16 elements from their codes (hz_q8_udec's products). */
static inline __m512 HZ_FN(hz5_q8_udec)(__m512i c, __m512 us) {
    const int sh = 23 - HZ_QU_MBITS;
    __mmask16 nz = _mm512_test_epi32_mask(c, c);
    __m512i y = _mm512_maskz_add_epi32(nz, _mm512_slli_epi32(c, sh),
                                       _mm512_set1_epi32((int)(HZ_QU_BIAS << sh)));
    return _mm512_mul_ps(_mm512_castsi512_ps(y), us);
}

/* hz_q8_code8 on 16 lanes of y >= 0, finite, with the clamp at 0 that vpackus gave (none at
 * the top: hz_q8_pack32's argument). */
static inline __m512i HZ_FN(hz5_code)(__m512 y, const int sh, const int bias,
                                      const int clamp) {
    __m512i t = _mm512_add_epi32(_mm512_castps_si512(y),
                                 _mm512_set1_epi32((1 << (sh - 1)) - (bias << sh)));
    t = _mm512_srai_epi32(t, sh);
    return clamp ? _mm512_max_epi32(t, _mm512_setzero_si512()) : t;
}

/* exp_avg's codes of 16 lanes m with the inverse scale im: the magnitude's code, with sign
 * bit sbit where m is negative and the code not zero (hz_q8_enc32's and hz_q4_enc32's). */
static inline __m512i HZ_FN(hz5_mcode)(__m512 m, __m512 im, const int sh, const int bias,
                                       const int sbit, const int clamp) {
    __m512i mi = _mm512_castps_si512(m);
    __m512i k = HZ_FN(hz5_code)(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(
                                                  mi, _mm512_set1_epi32(0x7fffffff))), im),
                                sh, bias, clamp);
    __mmask16 neg = _mm512_mask_cmpgt_epi32_mask(
        _mm512_test_epi32_mask(mi, _mm512_set1_epi32((int)0x80000000u)), k,
        _mm512_setzero_si512());
    return _mm512_mask_or_epi32(k, neg, k, _mm512_set1_epi32(sbit));
}

/* A 4-bit block's tables: lane k of tm is exp_avg's value of code k (sign bit 3: lanes 8-15
 * are lanes 0-7 with the sign bit OR-ed in, as hz_q4_dec16 ORs it), of tv exp_avg_sq's value
 * of code k, (value(k) * us)^2: hz_q4_tables' products, one table each. */
static inline void HZ_FN(hz5_q4_tables)(float ms, float us, __m512 *tm, __m512 *tv) {
#define HZ_Q4V(k, mb, bias) ((k) ? (int)(((k) + (bias)) << (23 - (mb))) : 0)
#define HZ_Q4M(k) HZ_Q4V(k, HZ_Q4M_MBITS, HZ_Q4M_BIAS)
#define HZ_Q4U(k) HZ_Q4V(k, HZ_Q4U_MBITS, HZ_Q4U_BIAS)
    const __m512i vm = _mm512_setr_epi32(HZ_Q4M(0), HZ_Q4M(1), HZ_Q4M(2), HZ_Q4M(3), HZ_Q4M(4),
                                         HZ_Q4M(5), HZ_Q4M(6), HZ_Q4M(7), HZ_Q4M(0), HZ_Q4M(1),
                                         HZ_Q4M(2), HZ_Q4M(3), HZ_Q4M(4), HZ_Q4M(5), HZ_Q4M(6),
                                         HZ_Q4M(7));
    const __m512i vu = _mm512_setr_epi32(HZ_Q4U(0), HZ_Q4U(1), HZ_Q4U(2), HZ_Q4U(3), HZ_Q4U(4),
                                         HZ_Q4U(5), HZ_Q4U(6), HZ_Q4U(7), HZ_Q4U(8), HZ_Q4U(9),
                                         HZ_Q4U(10), HZ_Q4U(11), HZ_Q4U(12), HZ_Q4U(13),
                                         HZ_Q4U(14), HZ_Q4U(15));
#undef HZ_Q4U
#undef HZ_Q4M
#undef HZ_Q4V
    __m512 m = _mm512_mul_ps(_mm512_castsi512_ps(vm), _mm512_set1_ps(ms));
    __m512i mi = _mm512_castps_si512(m);
    *tm = _mm512_castsi512_ps(
        _mm512_mask_or_epi32(mi, 0xff00, mi, _mm512_set1_epi32((int)0x80000000u)));
    __m512 u = _mm512_mul_ps(_mm512_castsi512_ps(vu), _mm512_set1_ps(us));
    *tv = _mm512_mul_ps(u, u);
}

/* Block blk's decode constants from its scales (times beta1 and sqrt(beta2)): for 8-bit codes
 * ms, -ms and us; for 4-bit ones the two tables (hz5_q4_tables; t2 a copy of t1). */
static inline __attribute__((always_inline)) void
HZ_FN(hz5_decode_consts)(const hz_adam_args *a, size_t blk, const int qk, __m512 *t0,
                         __m512 *t1, __m512 *t2) {
    const float msf = a->m_scale[blk] * a->beta1, usf = a->v_scale[blk] * a->sqrt_beta2;
    if (qk == HZ_Q8) {
        *t0 = _mm512_set1_ps(msf);
        *t1 = _mm512_set1_ps(-msf);
        *t2 = _mm512_set1_ps(usf);
    } else {
        HZ_FN(hz5_q4_tables)(msf, usf, t0, t1);
        *t2 = *t1;
    }
}

/* 16 lanes of 4-bit codes from 8 bytes (element 0's byte; element 2j in byte j's low nibble):
 * bits 0-3 of lane e hold element e's code (above them other codes, which vpermps ignores).
 * With AVX512-VBMI one vpmultishiftqb takes bits 4e.. of the 8 bytes to lane e (port 5 only,
 * where the vpshufb and vpsrlvd it replaces take ports 5 and 0: on the Xeon of family 6
 * model 167 zmm shifts issue on port 0 alone). */
static inline __m512i HZ_FN(hz5_q4_codes)(const uint8_t *src) {
    uint64_t b;
    memcpy(&b, src, 8);
#ifdef __AVX512VBMI__
    const __m512i at = _mm512_setr_epi64(  /* byte 0 of lane e: bit 4e */
        0x0000000400000000ll, 0x0000000c00000008ll, 0x0000001400000010ll, 0x0000001c00000018ll,
        0x0000002400000020ll, 0x0000002c00000028ll, 0x0000003400000030ll, 0x0000003c00000038ll);
    return _mm512_multishift_epi64_epi8(at, _mm512_set1_epi64((long long)b));
#else
    const __m512i sel = _mm512_setr_epi32(  /* byte e / 2 of each 128-bit lane's 8 to lane e */
        (int)0x80808000u, (int)0x80808000u, (int)0x80808001u, (int)0x80808001u,
        (int)0x80808002u, (int)0x80808002u, (int)0x80808003u, (int)0x80808003u,
        (int)0x80808004u, (int)0x80808004u, (int)0x80808005u, (int)0x80808005u,
        (int)0x80808006u, (int)0x80808006u, (int)0x80808007u, (int)0x80808007u);
    const __m512i sh = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    return _mm512_srlv_epi32(_mm512_shuffle_epi8(_mm512_set1_epi64((long long)b), sel), sh);
#endif
}

/* 16 nibble codes (one per lane, 0..15) -> 8 bytes, element 2j in byte j's low nibble. */
static inline void HZ_FN(hz5_q4_store)(uint8_t *dst, __m512i k) {
    const __m512i sh = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    __m512i x = _mm512_sllv_epi32(k, sh);
    x = _mm512_or_si512(x, _mm512_srli_epi64(x, 32));  /* byte 0 of each qword: the pair */
    _mm_storel_epi64((__m128i *)dst, _mm512_cvtepi64_epi8(x));
}

/* 64 codes, one per lane of k[0..3] (elements 0-15, .., 48-63), each below 256 or negative
 * (then 0: the packs' unsigned saturation is hz5_code's clamp) -> 64 bytes in element order.
 * The packs work within 128-bit lanes: dword d of lane l then holds elements 16d + 4l ..
 * 16d + 4l + 3, which one vpermd moves to dword 4d + l. */
static inline __m512i HZ_FN(hz5_bytes64)(const __m512i *k) {
    const __m512i t = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(k[0], k[1]),
                                    _mm512_packus_epi32(k[2], k[3]));
    return _mm512_permutexvar_epi32(t, b);
}

/* 64 nibble codes as bytes (hz5_bytes64's) -> 32 bytes, element 2j in byte j's low nibble. */
static inline __m256i HZ_FN(hz5_nibbles64)(__m512i b) {
    return _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(b, _mm512_set1_epi16(0x1001)));
}

/* The constants of the params' update (pass 2), broadcast once per call. */
typedef struct {
    __m512 decay, icap, rbc2, eps, ns;
} HZ_FN(hz5_pconsts);

/* Pass 2's new values of 16 params (e..e+15; mt, ut: their new m and sqrt(v) in the tiles). */
static inline __attribute__((always_inline)) __m512
HZ_FN(hz5_pnew)(const void *pm, size_t e, const float *mt, const float *ut,
                const HZ_FN(hz5_pconsts) k, const int mk) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __m512 mi = _mm512_load_ps(mt), si = _mm512_load_ps(ut);
    __m512 pi = _mm512_mul_ps(HZ_FN(hz5_p)(pm, e, mk), k.decay);
    __m512 cap = _mm512_mul_ps(
        _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(mi), abs_mask)), k.icap);
    __m512 d = _mm512_add_ps(_mm512_mul_ps(_mm512_max_ps(cap, si), k.rbc2), k.eps);
    return _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(k.ns, mi), d));
}

/* Pass 2 on 16 elements: the new params and their 16-bit copy (hz5_pstore). */
static inline __attribute__((always_inline)) void
HZ_FN(hz5_param16)(void *pm, uint16_t *out, size_t e, const float *mt, const float *ut,
                   const uint32_t *rt, const HZ_FN(hz5_pconsts) k, const int ok, const int mk) {
    HZ_FN(hz5_pstore)(pm, out, e, HZ_FN(hz5_pnew)(pm, e, mt, ut, k, mk), rt, ok, mk);
}

/* Pass 2 on 32 elements.  A bf16 master's 32 rounded values (the upper halves of hz5_sr's
 * lanes) take one vpermt2w into element order (2 uops, port 5), where shifting them down and
 * a vpackusdw and a vpermq took 4 (two of them shifts, port 0 only), and hz5_pstore's
 * vpmovdw takes 2 per 16. */
static inline __attribute__((always_inline)) void
HZ_FN(hz5_param32)(void *pm, uint16_t *out, size_t e, const float *mt, const float *ut,
                   const uint32_t *rt, const HZ_FN(hz5_pconsts) k, const int ok, const int mk) {
    if (mk == HZ_F32) {
        HZ_FN(hz5_param16)(pm, out, e, mt, ut, rt, k, ok, mk);
        HZ_FN(hz5_param16)(pm, out, e + 16, mt + 16, ut + 16, rt + 16, k, ok, mk);
        return;
    }
    __m512i s[2];
    for (int h = 0; h < 2; ++h) {
        __m512 x = HZ_FN(hz5_pnew)(pm, e + 16 * h, mt + 16 * h, ut + 16 * h, k, mk);
        s[h] = HZ_FN(hz5_sr)(x, _mm512_load_si512((const void *)(rt + 16 * h)));
    }
    const __m512i hi = _mm512_set_epi16(  /* word i: word 2i + 1 of s[0] then s[1] */
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21,
        19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512i w = _mm512_permutex2var_epi16(s[0], hi, s[1]);
    _mm512_storeu_si512((void *)((uint16_t *)pm + e), w);
    if (ok != HZ_NONE) _mm512_storeu_si512((void *)(out + e), w);
}

/* The codes of 16 lanes m (new exp_avg) and u (new sqrt(exp_avg_sq) times its inverse scale)
 * as 32-bit lanes, not clamped at 0 (clamp 0: the caller's packs do it) or clamped. */
static inline __attribute__((always_inline)) void
HZ_FN(hz5_codes)(__m512 m, __m512 u, __m512 im, const int qk, const int clamp, __m512i *km,
                 __m512i *ku) {
    if (qk == HZ_Q8) {
        *km = HZ_FN(hz5_mcode)(m, im, 23 - HZ_QM_MBITS, HZ_QM_BIAS, 0x80, clamp);
        *ku = HZ_FN(hz5_code)(u, 23 - HZ_QU_MBITS, HZ_QU_BIAS, clamp);
    } else {
        *km = HZ_FN(hz5_mcode)(m, im, 23 - HZ_Q4M_MBITS, HZ_Q4M_BIAS, 0x08, clamp);
        *ku = HZ_FN(hz5_code)(u, 23 - HZ_Q4U_MBITS, HZ_Q4U_BIAS, clamp);
    }
}

/* Pass 3 on 64 elements from element e (mt, ut: their tiles; im, iu: the inverse scales):
 * both moments' codes, packed to bytes (hz5_bytes64) and, for 4-bit codes, to nibbles. */
static inline __attribute__((always_inline)) void
HZ_FN(hz5_enc64)(uint8_t *mc, uint8_t *uc, size_t e, const float *mt, const float *ut,
                 __m512 im, __m512 iu, const int qk) {
    __m512i km[4], ku[4];
    for (int h = 0; h < 4; ++h)
        HZ_FN(hz5_codes)(_mm512_load_ps(mt + 16 * h),
                         _mm512_mul_ps(_mm512_load_ps(ut + 16 * h), iu), im, qk, 0, km + h,
                         ku + h);
    __m512i bm = HZ_FN(hz5_bytes64)(km), bu = HZ_FN(hz5_bytes64)(ku);
    if (qk == HZ_Q8) {
        _mm512_storeu_si512((void *)(mc + e), bm);
        _mm512_storeu_si512((void *)(uc + e), bu);
    } else {
        _mm256_storeu_si256((__m256i *)(mc + e / 2), HZ_FN(hz5_nibbles64)(bm));
        _mm256_storeu_si256((__m256i *)(uc + e / 2), HZ_FN(hz5_nibbles64)(bu));
    }
}

/* Pass 3 on 16 elements (a block's last, where fewer than 64 are left). */
static inline __attribute__((always_inline)) void
HZ_FN(hz5_enc16)(uint8_t *mc, uint8_t *uc, size_t e, const float *mt, const float *ut,
                 __m512 im, __m512 iu, const int qk) {
    __m512i km, ku;
    HZ_FN(hz5_codes)(_mm512_load_ps(mt), _mm512_mul_ps(_mm512_load_ps(ut), iu), im, qk, 1, &km,
                     &ku);
    if (qk == HZ_Q8) {
        _mm_storeu_si128((__m128i *)(mc + e), _mm512_cvtepi32_epi8(km));
        _mm_storeu_si128((__m128i *)(uc + e), _mm512_cvtepi32_epi8(ku));
    } else {
        HZ_FN(hz5_q4_store)(mc + e / 2, km);
        HZ_FN(hz5_q4_store)(uc + e / 2, ku);
    }
}

static inline __attribute__((always_inline)) void
HZ_FN(hz_coded512_body)(const hz_adam_args *a, size_t lo, size_t hi, const int gk,
                        const int ok, const int qk, const int mk, const int l2_on) {
    float mt[HZ_QBLOCK_MAX] __attribute__((aligned(64)));
    float ut[HZ_QBLOCK_MAX] __attribute__((aligned(64)));
    uint32_t rt[HZ_QBLOCK_MAX] __attribute__((aligned(64)));  /* a bf16 master's random words */
    uint8_t *mc = (uint8_t *)a->exp_avg, *uc = (uint8_t *)a->exp_avg_sq;
    const void *grad = a->grad;
    void *pm = mk == HZ_BF16 ? (void *)a->master16 : (void *)a->param;  /* hz5_p */
    uint16_t *out = (uint16_t *)a->out16;
    const __m512 gs = _mm512_set1_ps(a->grad_scale), decay = _mm512_set1_ps(a->decay);
    const __m512 l2 = _mm512_set1_ps(a->l2), c = _mm512_set1_ps(a->one_minus_beta1);
    const __m512 omb2 = _mm512_set1_ps(a->one_minus_beta2);
    const __m512 rbc2 = _mm512_set1_ps(a->inv_bc2_sqrt), eps = _mm512_set1_ps(a->eps);
    const __m512 ns = _mm512_set1_ps(a->neg_step), icap = _mm512_set1_ps(a->inv_ratio_cap);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    const HZ_FN(hz5_pconsts) k = {decay, icap, rbc2, eps, ns};
    const size_t bs = (size_t)a->qblock;
    const size_t pf_end = HZ_FN(hz_prefetch_end)(lo, hi);
    __m512 t0, t1, t2;  /* the block's decode constants (hz5_decode_consts) */
    HZ_FN(hz5_decode_consts)(a, lo / bs, qk, &t0, &t1, &t2);
    for (size_t b0 = lo; b0 < hi; b0 += bs) {
        size_t n = hi - b0 < bs ? hi - b0 : bs, blk = b0 / bs;
        const float msf = a->m_scale[blk] * a->beta1;
        if ((n & 15u) || hz_bits(msf) > 0x7f800000u) {  /* adam_coded_fused.h's cases */
            HZ_FN(hz_rest)(a, b0, b0 + n, mk);
            if (b0 + bs < hi) HZ_FN(hz5_decode_consts)(a, blk + 1, qk, &t0, &t1, &t2);
            continue;
        }
        __m512i mmax = _mm512_setzero_si512(), umax = _mm512_setzero_si512();
        /* a bf16 master's counters (hz5_pstore) of elements b0..b0+15 */
        __m512i ctr = _mm512_add_epi32(
            _mm512_set1_epi32((int)(a->sr_key + a->sr_first + (uint32_t)b0)),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        for (size_t j = 0; j < n; j += 16) {  /* pass 1: decode, the moments, sqrt(v) */
            size_t i = b0 + j;
            if (i < pf_end) {
                HZ_FN(hz_prefetch)(pm, i + HZ_PREFETCH, mk == HZ_BF16 ? 2 : 4, j);
                HZ_FN(hz_prefetch)(grad, i + HZ_PREFETCH, gk == HZ_F32 ? 4 : 2, j);
                HZ_FN(hz_prefetch_codes)(mc, i + HZ_PREFETCH, j, qk);
                HZ_FN(hz_prefetch_codes)(uc, i + HZ_PREFETCH, j, qk);
            }
            __m512 md, vd;
            if (qk == HZ_Q8) {
                md = HZ_FN(hz5_q8_mdec)(
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mc + i))), t0, t1);
                __m512 u = HZ_FN(hz5_q8_udec)(
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(uc + i))), t2);
                vd = _mm512_mul_ps(u, u);
            } else {
                md = _mm512_permutexvar_ps(HZ_FN(hz5_q4_codes)(mc + i / 2), t0);
                vd = _mm512_permutexvar_ps(HZ_FN(hz5_q4_codes)(uc + i / 2), t1);
            }
            __m512 g = _mm512_mul_ps(HZ_FN(hz5_grad)(grad, i, gk), gs);
            if (l2_on) g = _mm512_fmadd_ps(l2, _mm512_mul_ps(HZ_FN(hz5_p)(pm, i, mk), decay), g);
            __m512 mi = _mm512_fmadd_ps(c, g, md);
            __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, vd);
            __m512 si = _mm512_sqrt_ps(vi);
            _mm512_store_ps(mt + j, mi);
            _mm512_store_ps(ut + j, si);
            mmax = _mm512_max_epu32(mmax, _mm512_and_si512(_mm512_castps_si512(mi), abs_mask));
            umax = _mm512_max_epu32(umax, _mm512_castps_si512(si));  /* as adam_coded_fused.h */
            if (mk == HZ_BF16) {  /* the rounding's random words: see the top of this file */
                _mm512_store_si512((void *)(rt + j), HZ_FN(hz5_hash16)(ctr));
                ctr = _mm512_add_epi32(ctr, _mm512_set1_epi32(16));
            }
        }
        /* the next block's decode constants now, from its old scales (a block writes only its
         * own): their latency (a broadcast, two multiplies, an OR: the 4-bit tables) beside
         * this block's passes 2 and 3, where the next block's first decode waited on them.
         * In cache, fp32 master + int4 0.524 -> 0.506 ns/param; 100M params, one thread
         * (bench_kernel_loop's driver, medians of 6 alternating rounds) 0.591 -> 0.573. */
        if (b0 + bs < hi) HZ_FN(hz5_decode_consts)(a, blk + 1, qk, &t0, &t1, &t2);
        float sm, su;
        if (!HZ_FN(hz_coded_scales)(a, b0, n, qk, mt, ut,
                                    (uint32_t)_mm512_reduce_max_epu32(mmax),
                                    (uint32_t)_mm512_reduce_max_epu32(umax), &sm, &su)) {
            for (size_t j = 0; j < n; j += 16)  /* the portable encode has run: pass 2 */
                HZ_FN(hz5_param16)(pm, out, b0 + j, mt + j, ut + j, rt + j, k, ok, mk);
            continue;
        }
        const __m512 im = _mm512_set1_ps(sm == 0.0f ? 0.0f : 1.0f / sm);
        const __m512 iu = _mm512_set1_ps(su == 0.0f ? 0.0f : 1.0f / su);
        size_t j = 0;
        for (; j + 64 <= n; j += 64) {  /* passes 2 and 3: the params, then their encode */
            for (size_t h = 0; h < 64; h += 32)
                HZ_FN(hz5_param32)(pm, out, b0 + j + h, mt + j + h, ut + j + h, rt + j + h, k,
                                   ok, mk);
            HZ_FN(hz5_enc64)(mc, uc, b0 + j, mt + j, ut + j, im, iu, qk);
        }
        for (; j < n; j += 16) {  /* the block's last 16, 32 or 48 */
            HZ_FN(hz5_param16)(pm, out, b0 + j, mt + j, ut + j, rt + j, k, ok, mk);
            HZ_FN(hz5_enc16)(mc, uc, b0 + j, mt + j, ut + j, im, iu, qk);
        }
        a->m_scale[blk] = sm;
        a->v_scale[blk] = su;
    }
}

/* The coded pass of a variant with this file: hz_coded512_body with the L2 flag a constant,
 * as hz_coded_fused.  bench_kernel_loop.py, 64K params in cache, fastest of 3 (the first two
 * figures) or 5 alternating runs of each build, the Xeon of family 6 model 167, ns/param
 * 8-lane -> zmm: fp32 master, int8 0.675 -> 0.585, int4 0.667 -> 0.622 (three passes, the
 * per-16 encode; then with the encode on 64 at a time 0.549 / 0.539, and inside the params'
 * loop 0.531 / 0.531; the 8-lane encode in the zmm pass instead: 0.666 with 4-bit codes).  A
 * bf16 master (the stochastic rounding on 16 lanes too) gained nothing from zmm with the
 * per-16 encode (int8 0.700 -> 0.684, int4 0.689 -> 0.728; 0.79 / 0.91 with pass 2 on 8
 * lanes after zmm passes 1 and 3) and kept the 8-lane pass then; with the encode inside the
 * params' loop it gains: 0.686 -> 0.637, 0.690 -> 0.625, and 0.614 / 0.604 with a pack of
 * 32 rounded values; then 0.604 / 0.564 with the random words hashed in pass 1, the vpermt2w
 * and the multishift.  Tried and not kept (docs/benchmarks.md): vrangeps for the cap's max,
 * the sqrt in the params' loop, each block's pass 1 ahead of the previous block's passes 2
 * and 3 (two sets of tiles), one reduction of both scales' maxima: level or slower. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_coded512)(const hz_adam_args *a, size_t lo, size_t hi, const int gk, const int ok,
                   const int qk, const int mk) {
    if (!a->l2_on) HZ_FN(hz_coded512_body)(a, lo, hi, gk, ok, qk, mk, 0);
    else HZ_FN(hz_coded512_body)(a, lo, hi, gk, ok, qk, mk, 1);
}
