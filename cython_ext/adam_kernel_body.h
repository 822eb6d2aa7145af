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
#include "adam_q4_portable.h"

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
    if (a->state_kind == HZ_Q4) {
        HZ_FN(hz_q4_range)(a, lo, hi);
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

/* bf16 master, portable: tiles of HZ_MTILE elements (a multiple of every block size, so each
 * tile's moments start on a block and a byte) widened into an fp32 tile, updated there by the
 * portable fp32-master path (the same bits as an fp32 master holding the same values), then
 * rounded stochastically into the master and its copy for the device.  The reference of the
 * fused bf16-master passes (adam_m16_fused.h) and what they leave to it (a range's last < 16
 * elements, a coded block they do not take); the generic variant's whole path. */
#define HZ_MTILE HZ_QBLOCK_MAX
static void HZ_FN(hz_m16_tiles)(const hz_adam_args *a, size_t lo, size_t hi) {
    float pbuf[HZ_MTILE] __attribute__((aligned(64)));
    hz_adam_args t = *a;
    const size_t gsz = a->grad_kind == HZ_F32 ? 4 : 2;
    t.param = pbuf;
    t.out_kind = HZ_NONE;
    t.out16 = NULL;
    for (size_t i = lo; i < hi; i += HZ_MTILE) {
        size_t n = hi - i < HZ_MTILE ? hi - i : HZ_MTILE;
        HZ_FN(hz_widen)(pbuf, a->master16 + i, HZ_BF16, n);
        t.grad = (const char *)a->grad + i * gsz;
        switch (a->state_kind) {
        case HZ_F32:
            t.exp_avg = (float *)a->exp_avg + i;
            t.exp_avg_sq = (float *)a->exp_avg_sq + i;
            break;
        case HZ_BF16:
            t.exp_avg = (uint16_t *)a->exp_avg + i;
            t.exp_avg_sq = (uint16_t *)a->exp_avg_sq + i;
            break;
        default: /* codes: one byte per element (HZ_Q8) or two per byte (HZ_Q4) */
            t.exp_avg = (uint8_t *)a->exp_avg + (a->state_kind == HZ_Q4 ? i / 2 : i);
            t.exp_avg_sq = (uint8_t *)a->exp_avg_sq + (a->state_kind == HZ_Q4 ? i / 2 : i);
            t.m_scale = a->m_scale + i / (size_t)a->qblock;
            t.v_scale = a->v_scale + i / (size_t)a->qblock;
        }
        HZ_FN(hz_tiles)(&t, 0, n);
        uint16_t *m16 = a->master16 + i;
        const uint32_t key = a->sr_key, first = a->sr_first + (uint32_t)i;
        for (size_t k = 0; k < n; ++k)
            m16[k] = hz_float_to_bf16_sr(pbuf[k], hz_sr_bits(key, first + (uint32_t)k));
        if (a->out_kind != HZ_NONE && a->out16 != (void *)m16)
            memcpy((uint16_t *)a->out16 + i, m16, n * 2);
    }
}

/* The portable path over [lo, hi) for a master of kind mk (HZ_F32 or HZ_BF16). */
static inline void HZ_FN(hz_rest)(const hz_adam_args *a, size_t lo, size_t hi, const int mk) {
    if (mk == HZ_BF16) HZ_FN(hz_m16_tiles)(a, lo, hi);
    else HZ_FN(hz_tiles)(a, lo, hi);
}

#if HZ_USE_F16C && defined(__AVX2__) && defined(__FMA__)
#define HZ_FUSED 1
#include "adam_fused.h"
#include "adam_q8_fused.h"
#include "adam_q4_fused.h"
#include "adam_coded_fused.h"
#if HZ_USE_BF16HW && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HZ_CODED512 1
#include "adam_coded512.h"
#define HZ_CODED_PASS hz_coded512
#else
#define HZ_CODED512 0
#define HZ_CODED_PASS hz_coded_fused
#endif

/* The fused pass for this call's kinds; a constant mk makes one set of instances per master.
 * Outputs: fp16 or bf16 for an fp32 master, bf16 for a bf16 one (cpu_adam.py refuses fp16 there;
 * hz_rest takes what has no case). */
static inline __attribute__((always_inline)) void
HZ_FN(hz_fused_for)(const hz_adam_args *a, size_t lo, size_t hi, const int mk) {
    const int sk = a->state_kind, gk = a->grad_kind, ok = a->out_kind;
    if (sk == HZ_Q8 || sk == HZ_Q4) {
        switch ((sk == HZ_Q4) * 16 + gk * 4 + ok) {
#define HZ_QCASE(qk, gk, ok) \
    case (qk == HZ_Q4) * 16 + gk * 4 + ok: HZ_FN(HZ_CODED_PASS)(a, lo, hi, gk, ok, qk, mk); return;
#define HZ_QCASES(qk, gk) \
    HZ_QCASE(qk, gk, HZ_BF16) HZ_QCASE(qk, gk, HZ_NONE) \
    case (qk == HZ_Q4) * 16 + gk * 4 + HZ_F16: \
        if (mk == HZ_F32) HZ_FN(HZ_CODED_PASS)(a, lo, hi, gk, HZ_F16, qk, HZ_F32); \
        else HZ_FN(hz_rest)(a, lo, hi, mk); \
        return;
        HZ_QCASES(HZ_Q8, HZ_F32) HZ_QCASES(HZ_Q8, HZ_F16) HZ_QCASES(HZ_Q8, HZ_BF16)
        HZ_QCASES(HZ_Q4, HZ_F32) HZ_QCASES(HZ_Q4, HZ_F16) HZ_QCASES(HZ_Q4, HZ_BF16)
#undef HZ_QCASES
#undef HZ_QCASE
        default: HZ_FN(hz_rest)(a, lo, hi, mk); return;
        }
    }
    switch ((sk == HZ_BF16) * 16 + gk * 4 + ok) {
#define HZ_CASE(sk, gk, ok) \
    case (sk == HZ_BF16) * 16 + gk * 4 + ok: HZ_FN(hz_fused)(a, lo, hi, gk, ok, sk, mk); return;
#define HZ_CASE16(sk, gk) \
    case (sk == HZ_BF16) * 16 + gk * 4 + HZ_F16: \
        if (mk == HZ_F32) HZ_FN(hz_fused)(a, lo, hi, gk, HZ_F16, sk, HZ_F32); \
        else HZ_FN(hz_rest)(a, lo, hi, mk); \
        return;
#define HZ_CASES(sk) \
    HZ_CASE16(sk, HZ_F32) HZ_CASE(sk, HZ_F32, HZ_BF16) \
    HZ_CASE(sk, HZ_F16, HZ_NONE) HZ_CASE16(sk, HZ_F16) HZ_CASE(sk, HZ_F16, HZ_BF16) \
    HZ_CASE(sk, HZ_BF16, HZ_NONE) HZ_CASE16(sk, HZ_BF16) HZ_CASE(sk, HZ_BF16, HZ_BF16)
    HZ_CASES(HZ_F32)
    HZ_CASES(HZ_BF16)
    HZ_CASE(HZ_BF16, HZ_F32, HZ_NONE)
    case HZ_F32 * 4 + HZ_NONE:  /* fp32 in and state, no output */
        if (mk == HZ_BF16) HZ_FN(hz_fused)(a, lo, hi, HZ_F32, HZ_NONE, HZ_F32, HZ_BF16);
        else HZ_FN(hz_tiles)(a, lo, hi);  /* nothing to widen or cut: auto-vectorized */
        return;
#undef HZ_CASES
#undef HZ_CASE16
#undef HZ_CASE
    default: HZ_FN(hz_rest)(a, lo, hi, mk);
    }
}

static void HZ_FN(hz_adam_range32)(const hz_adam_args *a, size_t lo, size_t hi) {
    HZ_FN(hz_fused_for)(a, lo, hi, HZ_F32);
}

static void HZ_FN(hz_m16_range)(const hz_adam_args *a, size_t lo, size_t hi) {
    HZ_FN(hz_fused_for)(a, lo, hi, HZ_BF16);
}
#else
#define HZ_FUSED 0
static void HZ_FN(hz_adam_range32)(const hz_adam_args *a, size_t lo, size_t hi) {
    HZ_FN(hz_tiles)(a, lo, hi);  /* also the 8- and 4-bit moments */
}

static void HZ_FN(hz_m16_range)(const hz_adam_args *a, size_t lo, size_t hi) {
    HZ_FN(hz_m16_tiles)(a, lo, hi);
}
#endif

static void HZ_FN(hz_adam_range)(const hz_adam_args *a, size_t lo, size_t hi) {
    if (a->master_kind == HZ_BF16) HZ_FN(hz_m16_range)(a, lo, hi);
    else HZ_FN(hz_adam_range32)(a, lo, hi);
}

#include "adam_undo.h"  /* the overlapped schedule's undo of an fp32 step, per variant */

#undef HZ_CODED_PASS
#undef HZ_CODED512
#undef HZ_USE_F16C
#undef HZ_USE_BF16HW
#undef HZ_FUSED
