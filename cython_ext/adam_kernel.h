/* One-pass CPU-Adam kernel: argument block, variant dispatch, and the traffic pass that the
 * benchmark uses as its memory ceiling.  The per-ISA body lives in adam_kernel_body.h and is
 * instantiated here several times (generic, native; avx2 and avx512bf16 in portable builds).
 *
 * Numerics: compile with -ffp-contract=off (setup.py does); the body calls fmaf exactly where
 * torch's CPU kernels fuse.  Every element then goes through the same correctly rounded IEEE
 * operations whether it lands in a vector body or a scalar tail, so results are bitwise identical
 * for any thread count, any split of a buffer, and across variants.  Letting the compiler
 * contract freely would make rounding depend on alignment. */
#ifndef HF_ZOFFLOAD_ADAM_KERNEL_H
#define HF_ZOFFLOAD_ADAM_KERNEL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HZ_X86 1
#else
#define HZ_X86 0
#endif

enum { HZ_F32 = 0, HZ_F16 = 1, HZ_BF16 = 2, HZ_NONE = 3, HZ_Q8 = 4, HZ_Q4 = 5 };
enum { HZ_AUTO = 0, HZ_GENERIC = 1, HZ_NATIVE = 2, HZ_AVX2 = 3, HZ_AVX512BF16 = 4, HZ_NVARIANTS = 5 };
enum { HZ_FEAT_AVX2 = 1, HZ_FEAT_AVX512F = 2, HZ_FEAT_F16C = 4, HZ_FEAT_AVX512BF16 = 8 };

/* Scalars arrive as doubles computed in Python the way torch computes them, and are rounded to
 * float once here, as torch's CPU kernels round a Python scalar for a float tensor. */
typedef struct {
    float *param;
    void *exp_avg, *exp_avg_sq;  /* fp32, bf16, 8-bit codes or 4-bit codes two per byte  */
    float *m_scale, *v_scale;    /* HZ_Q8 / HZ_Q4: one fp32 scale per block of each moment */
    const void *grad;
    void *out16;                 /* may be grad itself (same kind): read before written  */
    int grad_kind, out_kind;
    int state_kind;  /* HZ_F32, HZ_BF16, HZ_Q8 or HZ_Q4                       */
    int qblock;      /* HZ_Q8 / HZ_Q4: elements per block; calls start on a block */
    int l2_on;       /* Adam mode with weight decay: g += wd * p          */
    int lerp_small;  /* torch.lerp branch: weight < 0.5                    */
    float grad_scale, decay, l2, lerp_coef, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step;
    float inv_ratio_cap;  /* HZ_Q8 / HZ_Q4: the denominator is at least |m| * this (docs/design.md) */
    /* HZ_Q8 / HZ_Q4: beta1 and sqrt(beta2) multiply the block scales at decode (so the decoded moments
     * come out already decayed), 1 - beta1 weighs the grad in m' = fma(1 - beta1, g, beta1 m) */
    float beta1, one_minus_beta1, sqrt_beta2;
    /* master_kind HZ_BF16: the master is master16 (bf16, param unused), widened, updated in
     * fp32 and rounded back stochastically: element i's 16 random bits are
     * hz_sr_bits(sr_key, sr_first + i) (docs/design.md, "bf16 master"). */
    int master_kind;  /* HZ_F32 or HZ_BF16 */
    uint16_t *master16;
    uint32_t sr_key, sr_first;
} hz_adam_args;

typedef void (*hz_range_fn)(const hz_adam_args *a, size_t lo, size_t hi);

/* Tile: grads are widened into a stack buffer and the 16-bit copy is cut from the tile while it
 * is still in L1.  512 floats = 2 KiB per stream, ~10 KiB in flight: fits any 32 KiB L1. */
#define HZ_TILE 512

static inline uint32_t hz_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float hz_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* IEEE half -> float, exact; NaN is quieted keeping its payload, as vcvtph2ps does. */
static inline float hz_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t a = h & 0x7fffu, e = a >> 10, m = a & 0x3ffu;
    uint32_t normal = (a << 13) + 0x38000000u;                       /* rebias 15 -> 127 */
    uint32_t special = 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u);
    uint32_t sub = hz_bits((float)m * 5.9604644775390625e-08f);      /* m * 2^-24, exact */
    uint32_t r = e == 31u ? special : normal;
    r = e == 0u ? sub : r;
    return hz_float(r | sign);
}

/* float -> IEEE half, round to nearest even, bit-equal to vcvtps2ph with imm 0 (and so to
 * torch's .to(float16)): overflow -> inf, NaN -> quiet NaN keeping sign and top payload. */
static inline uint16_t hz_float_to_half(float f) {
    uint32_t u = hz_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    uint32_t norm = (a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    /* Below 2^-14 the result is a half subnormal: adding 0.5f (ulp 2^-24 = half's smallest step)
     * lets the FPU do the round-to-nearest-even; the low bits are the half's mantissa. */
    uint32_t sub = hz_bits(hz_float(a) + 0.5f) - 0x3f000000u;
    uint32_t r = a >= 0x38800000u ? norm : sub;
    r = a >= 0x477ff000u ? 0x7c00u : r;                               /* >= 65520 rounds to inf */
    r = a > 0x7f800000u ? nan : r;
    return (uint16_t)(r | sign);
}

/* float -> bfloat16, round to nearest even (subnormals included, as torch does); NaN -> quiet NaN
 * keeping sign and top payload, which is what vcvtneps2bf16 writes.  A plain integer formula
 * with selects, so the loop around it auto-vectorizes. */
static inline uint16_t hz_float_to_bf16(float f) {
    uint32_t u = hz_bits(f);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t q = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? q : r);
}

/* ---- bf16 master: stochastic rounding ------------------------------------------------------
 * Counter-based: the bits of an element come from a hash of its key (seed, Adam step and param
 * index, mixed by the caller with the same hash) plus its index in the param, so they do not
 * depend on threads, buckets, shards or calls.  lowbias32 (C. Wellons' search for 32-bit
 * integer hashes; bias 0.17): two 32-bit multiplies, which vectorize (vpmulld) where a 64-bit
 * SplitMix finalizer would not on AVX2. */
static inline uint32_t hz_hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline uint32_t hz_sr_bits(uint32_t key, uint32_t index) { return hz_hash32(key + index); }

/* float -> bfloat16 rounded up in magnitude with probability (dropped bits) / 2^16: the low 16
 * bits of r added before truncation (sign-magnitude, so the same for both signs: unbiased in
 * value).  inf stays inf; NaN as hz_float_to_bf16 (quiet, sign and top payload kept); a finite
 * value above the largest bf16 may round to inf, as round-to-nearest does past half its ulp. */
static inline uint16_t hz_float_to_bf16_sr(float f, uint32_t r) {
    uint32_t u = hz_bits(f);
    uint32_t q = (u >> 16) | 0x40u;
    uint32_t s = (u + (r & 0xffffu)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? q : s);
}

/* ---- 8-bit moments (HZ_Q8) ---------------------------------------------------------------
 * Each block of qblock elements stores one fp32 scale s, its largest magnitude, and one byte
 * per element: a small float of the element over s.  exp_avg: sign bit and 7 bits, 3 of
 * mantissa and 4 of exponent (values 2^-15 .. 1, half-step 6.25%); exp_avg_sq is stored as
 * its square root u (halving its range in binades), 8 bits, 4 of mantissa and 4 of exponent
 * (u: 2^-15 .. 1, half-step 3.1%).  Code 0 is zero; the top code is exactly 1.0, so the
 * largest element decodes to s itself and encode(decode(codes)) gives back the same scale
 * and codes: a resume from decoded fp32 moments continues bit for bit.  Encoding rounds to
 * nearest, ties away from zero, with one integer add and a shift on the float's bits (ties
 * to even took three more vector ops per 8 lanes and moment, ~6% of the 8-bit pass; a tie
 * needs the 19 or 20 bits below the code to be exactly 100..0), decoding is a shift, an add
 * and one multiply: no table, a few vector instructions. */
#define HZ_QM_MBITS 3
#define HZ_QU_MBITS 4
#define HZ_QM_TOP (((1u << (7 - HZ_QM_MBITS)) - 1u) << HZ_QM_MBITS)  /* 120: 1.0 */
#define HZ_QU_TOP (((1u << (8 - HZ_QU_MBITS)) - 1u) << HZ_QU_MBITS)  /* 240: 1.0 */
#define HZ_QM_BIAS ((127u - (HZ_QM_TOP >> HZ_QM_MBITS)) << HZ_QM_MBITS)
#define HZ_QU_BIAS ((127u - (HZ_QU_TOP >> HZ_QU_MBITS)) << HZ_QU_MBITS)
#define HZ_QBLOCK_MAX 4096

/* y in [0, 1 + 2 ulp] (finite) -> code 0..top, round to nearest (ties away) on mantissa bits. */
static inline uint32_t hz_q_code(float y, int mbits, uint32_t bias, uint32_t top) {
    uint32_t u = hz_bits(y), sh = 23u - (uint32_t)mbits;
    int32_t k = (int32_t)((u + (1u << (sh - 1))) >> sh) - (int32_t)bias;
    k = k < 0 ? 0 : k;
    return (uint32_t)k > top ? top : (uint32_t)k;
}

static inline float hz_q_value(uint32_t k, int mbits, uint32_t bias) {
    float f = hz_float((k + bias) << (23 - mbits));
    return k ? f : 0.0f;
}

/* Largest |x| as float bits (an integer max: NaN beats everything, as it must). */
static inline uint32_t hz_absmax_bits(const float *x, size_t n) {
    uint32_t mx = 0;
    for (size_t i = 0; i < n; ++i) {
        uint32_t b = hz_bits(x[i]) & 0x7fffffffu;
        mx = b > mx ? b : mx;
    }
    return mx;
}

/* A block's scale from its largest magnitude; blocks below FLT_MIN are stored as zero. */
static inline float hz_q_scale(uint32_t absmax_bits) {
    return absmax_bits < 0x00800000u ? 0.0f : hz_float(absmax_bits);
}

/* ---- 4-bit moments (HZ_Q4) ---------------------------------------------------------------
 * The 8-bit scheme with 4-bit codes, two per byte (element 2j in the low nibble of byte j,
 * 2j + 1 in the high one; an odd count's last high nibble is written as 0), blocks of qblock
 * elements with one fp32 scale each (the block's largest magnitude).  exp_avg: sign bit and 3
 * bits of exponent, no mantissa (values 2^-6 .. 1 of the scale, a factor of 2 apart); exp_avg_sq
 * as its square root u, 4 bits, 3 of exponent and 1 of mantissa (u: 1.5 * 2^-7 .. 1, half-step
 * <= 25%).  The same round-to-nearest on the float's bits (hz_q_code), code 0 is zero and the top
 * code exactly 1.0, so encode(decode(codes)) gives back the codes; the same ratio cap in the
 * update (docs/design.md, "Compact moments"), which binds far more often here: u's 7 binades
 * flush much of a block's small sqrt(v).  Why this code and block: docs/measurements.md, "4-bit
 * moments". */
#define HZ_Q4M_MBITS 0
#define HZ_Q4U_MBITS 1
#define HZ_Q4M_TOP (((1u << (3 - HZ_Q4M_MBITS)) - 1u) << HZ_Q4M_MBITS)  /* 7: 1.0 */
#define HZ_Q4U_TOP (((1u << (4 - HZ_Q4U_MBITS)) - 1u) << HZ_Q4U_MBITS)  /* 14: 1.0 */
#define HZ_Q4M_BIAS ((127u - (HZ_Q4M_TOP >> HZ_Q4M_MBITS)) << HZ_Q4M_MBITS)
#define HZ_Q4U_BIAS ((127u - (HZ_Q4U_TOP >> HZ_Q4U_MBITS)) << HZ_Q4U_MBITS)

/* ---- variants ---------------------------------------------------------------------------- */
#define HZ_SUFFIX generic
#define HZ_NO_INTRINSICS 1
#include "adam_kernel_body.h"
#undef HZ_SUFFIX
#undef HZ_NO_INTRINSICS

#if !defined(HZ_PORTABLE)
/* Native build: the module is compiled with -march=native, so __F16C__ / __AVX512BF16__ say
 * what this CPU has. */
#define HZ_SUFFIX native
#define HZ_NO_INTRINSICS 0
#include "adam_kernel_body.h"
#undef HZ_SUFFIX
#undef HZ_NO_INTRINSICS
#define HZ_HAVE_NATIVE 1
#else
#define HZ_HAVE_NATIVE 0
#endif

#if defined(HZ_PORTABLE) && HZ_X86 && defined(__GNUC__) && !defined(__clang__)
/* Portable build: baseline code plus two clones picked at run time by __builtin_cpu_supports;
 * #pragma GCC target also defines __F16C__ etc. inside the region, so the body is unchanged. */
#define HZ_HAVE_CLONES 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define HZ_SUFFIX avx2
#define HZ_NO_INTRINSICS 0
#include "adam_kernel_body.h"
#undef HZ_SUFFIX
#undef HZ_NO_INTRINSICS
#pragma GCC pop_options
#pragma GCC push_options
/* 256-bit auto-vectorization, as gcc's own tuning for AVX-512 Xeons picks under -march=native:
 * with the generic tuning of this build the portable loops (hz_tiles, hz_math, the 8-bit codec;
 * run for the head and tail of every fused call) came out in zmm (818 instructions), and on
 * Xeons up to Ice Lake a 512-bit FP op lowers the core's clock for a while, the 256-bit fused
 * loop after it included.  Same bits at any width (element-wise, no contraction). */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,prefer-vector-width=256")
#define HZ_SUFFIX avx512bf16
#define HZ_NO_INTRINSICS 0
#include "adam_kernel_body.h"
#undef HZ_SUFFIX
#undef HZ_NO_INTRINSICS
#pragma GCC pop_options
#else
#define HZ_HAVE_CLONES 0
#endif

/* Whole buffers of 8-bit moments <-> fp32 (checkpoints): the generic variant's block codec,
 * bitwise the one the update uses.  v is exp_avg_sq itself; its square root is stored, and
 * sqrtf(u * u) == u for every float u, so encode(decode(codes)) gives back the codes. */
static void hz_q8_encode_buf(const float *m, const float *v, uint8_t *mc, uint8_t *uc,
                             float *ms, float *us, size_t n, size_t bs) {
    float ut[HZ_QBLOCK_MAX];
    for (size_t i = 0; i < n; i += bs) {
        size_t k = n - i < bs ? n - i : bs;
        for (size_t j = 0; j < k; ++j) ut[j] = sqrtf(v[i + j]);
        hz_q8_encode_generic(mc + i, uc + i, ms + i / bs, us + i / bs, m + i, ut, k);
    }
}

static void hz_q8_decode_buf(float *m, float *v, const uint8_t *mc, const uint8_t *uc,
                             const float *ms, const float *us, size_t n, size_t bs) {
    for (size_t i = 0; i < n; i += bs) {
        size_t k = n - i < bs ? n - i : bs;
        hz_q8_decode_generic(m + i, v + i, mc + i, uc + i, ms[i / bs], us[i / bs], k);
    }
}

/* The same for 4-bit moments; mc, uc: the codes of element 0 of the buffer (two per byte). */
static void hz_q4_encode_buf(const float *m, const float *v, uint8_t *mc, uint8_t *uc,
                             float *ms, float *us, size_t n, size_t bs) {
    float ut[HZ_QBLOCK_MAX];
    for (size_t i = 0; i < n; i += bs) {
        size_t k = n - i < bs ? n - i : bs;
        for (size_t j = 0; j < k; ++j) ut[j] = sqrtf(v[i + j]);
        hz_q4_encode_generic(mc + i / 2, uc + i / 2, ms + i / bs, us + i / bs, m + i, ut, k);
    }
}

static void hz_q4_decode_buf(float *m, float *v, const uint8_t *mc, const uint8_t *uc,
                             const float *ms, const float *us, size_t n, size_t bs) {
    for (size_t i = 0; i < n; i += bs) {
        size_t k = n - i < bs ? n - i : bs;
        hz_q4_decode_generic(m + i, v + i, mc + i / 2, uc + i / 2, ms[i / bs], us[i / bs], k);
    }
}

/* x -> bf16 with the stochastic rounding of the bf16 master (tests compare it with the torch
 * reference; the portable update, hz_m16_tiles, runs the same loop, the fused passes its
 * vector form, hz_pstore16 in adam_m16_fused.h). */
static void hz_sr_round_buf(uint16_t *dst, const float *x, size_t n, uint32_t key,
                            uint32_t first) {
    for (size_t i = 0; i < n; ++i)
        dst[i] = hz_float_to_bf16_sr(x[i], hz_sr_bits(key, first + (uint32_t)i));
}

static int hz_cpu_has(int variant) {
#if HZ_HAVE_CLONES
    __builtin_cpu_init();
    if (variant == HZ_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    if (variant == HZ_AVX512BF16)
        return hz_cpu_has(HZ_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bf16");
#endif
    return variant == HZ_GENERIC || (variant == HZ_NATIVE && HZ_HAVE_NATIVE);
}

/* NULL when the variant is not compiled in, or (for clones) this CPU cannot run it. */
static hz_range_fn hz_select(int variant) {
    if (variant == HZ_AUTO) {
        if (HZ_HAVE_NATIVE) return hz_select(HZ_NATIVE);
        if (hz_cpu_has(HZ_AVX512BF16)) return hz_select(HZ_AVX512BF16);
        if (hz_cpu_has(HZ_AVX2)) return hz_select(HZ_AVX2);
        return hz_select(HZ_GENERIC);
    }
    if (!hz_cpu_has(variant)) return NULL;
    switch (variant) {
    case HZ_GENERIC: return hz_adam_range_generic;
#if HZ_HAVE_NATIVE
    case HZ_NATIVE: return hz_adam_range_native;
#endif
#if HZ_HAVE_CLONES
    case HZ_AVX2: return hz_adam_range_avx2;
    case HZ_AVX512BF16: return hz_adam_range_avx512bf16;
#endif
    default: return NULL;
    }
}

/* The undo pass (adam_undo.h) of a variant, as hz_select picks the step's. */
static hz_undo_fn hz_select_undo(int variant) {
    if (variant == HZ_AUTO) {
        if (HZ_HAVE_NATIVE) return hz_select_undo(HZ_NATIVE);
        if (hz_cpu_has(HZ_AVX512BF16)) return hz_select_undo(HZ_AVX512BF16);
        if (hz_cpu_has(HZ_AVX2)) return hz_select_undo(HZ_AVX2);
        return hz_select_undo(HZ_GENERIC);
    }
    if (!hz_cpu_has(variant)) return NULL;
    switch (variant) {
    case HZ_GENERIC: return hz_undo_range_generic;
#if HZ_HAVE_NATIVE
    case HZ_NATIVE: return hz_undo_range_native;
#endif
#if HZ_HAVE_CLONES
    case HZ_AVX2: return hz_undo_range_avx2;
    case HZ_AVX512BF16: return hz_undo_range_avx512bf16;
#endif
    default: return NULL;
    }
}

/* Instruction sets each variant uses (auto-vectorized code and conversion intrinsics). */
static int hz_variant_features(int variant) {
    switch (variant) {
    case HZ_GENERIC: return hz_features_generic();
#if HZ_HAVE_NATIVE
    case HZ_NATIVE: return hz_features_native();
#endif
#if HZ_HAVE_CLONES
    case HZ_AVX2: return hz_features_avx2();
    case HZ_AVX512BF16: return hz_features_avx512bf16();
#endif
    default: return 0;
    }
}

static int hz_openmp_compiled(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static int hz_portable_build(void) {
#ifdef HZ_PORTABLE
    return 1;
#else
    return 0;
#endif
}

/* Memory ceiling for Adam's traffic: read 4 fp32 streams, write 3 in place, one add each and no
 * other arithmetic, compiled with the same flags and run with the same chunking as the kernel.
 * Several ways to move the same bytes (HZ_TRAFFIC_*), since no one of them is the fastest on
 * every CPU: torch's fused AdamW beat the plain loop by 2-4% on a Zen 4 (issue 38), so the
 * benchmark's ceiling is the fastest of them in each round. */
enum { HZ_TRAFFIC_PLAIN = 0, HZ_TRAFFIC_UNROLL = 1, HZ_TRAFFIC_PREFETCH = 2,
       HZ_TRAFFIC_PREFETCH_FAR = 3, HZ_TRAFFIC_STREAM = 4, HZ_TRAFFIC_KINDS = 5 };

static void hz_traffic_plain(float *restrict a, float *restrict b, float *restrict c,
                             const float *restrict d, size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
        float x = d[i];
        a[i] += x;
        b[i] += x;
        c[i] += x;
    }
}

static void hz_traffic_unroll(float *restrict a, float *restrict b, float *restrict c,
                              const float *restrict d, size_t lo, size_t hi) {
#pragma GCC unroll 4
    for (size_t i = lo; i < hi; ++i) {
        float x = d[i];
        a[i] += x;
        b[i] += x;
        c[i] += x;
    }
}

/* Software prefetch of each stream dist elements ahead, one per 64-byte line (16 floats). */
static inline __attribute__((always_inline)) void
hz_traffic_pf(float *restrict a, float *restrict b, float *restrict c, const float *restrict d,
              size_t lo, size_t hi, size_t dist) {
    size_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        if (i + dist < hi) {
            __builtin_prefetch(a + i + dist, 1);
            __builtin_prefetch(b + i + dist, 1);
            __builtin_prefetch(c + i + dist, 1);
            __builtin_prefetch(d + i + dist, 0);
        }
        for (size_t j = i; j < i + 16; ++j) {
            float x = d[j];
            a[j] += x;
            b[j] += x;
            c[j] += x;
        }
    }
    hz_traffic_plain(a, b, c, d, i, hi);
}

/* Streaming (non-temporal) stores: the written lines go to memory without staying in cache.
 * A whole 64-byte line of each stream is read before any of it is stored: a streaming store
 * to a cached line evicts it, so storing half a line and then reading the other half made
 * every read a miss (0.4 GB/s measured, Zen 3). */
static void hz_traffic_stream(float *restrict a, float *restrict b, float *restrict c,
                              const float *restrict d, size_t lo, size_t hi) {
#if HZ_X86 && defined(__AVX__)
    size_t i = lo;
    if ((((uintptr_t)a - (uintptr_t)b) | ((uintptr_t)a - (uintptr_t)c)) & 63u) {
        hz_traffic_plain(a, b, c, d, lo, hi);  /* the three never start a line together */
        return;
    }
    while (i < hi && ((uintptr_t)(a + i) & 63u)) ++i;
    hz_traffic_plain(a, b, c, d, lo, i);
    for (; i + 16 <= hi; i += 16) {
        __m256 x0 = _mm256_loadu_ps(d + i), x1 = _mm256_loadu_ps(d + i + 8);
        __m256 a0 = _mm256_load_ps(a + i), a1 = _mm256_load_ps(a + i + 8);
        __m256 b0 = _mm256_load_ps(b + i), b1 = _mm256_load_ps(b + i + 8);
        __m256 c0 = _mm256_load_ps(c + i), c1 = _mm256_load_ps(c + i + 8);
        _mm256_stream_ps(a + i, _mm256_add_ps(a0, x0));
        _mm256_stream_ps(a + i + 8, _mm256_add_ps(a1, x1));
        _mm256_stream_ps(b + i, _mm256_add_ps(b0, x0));
        _mm256_stream_ps(b + i + 8, _mm256_add_ps(b1, x1));
        _mm256_stream_ps(c + i, _mm256_add_ps(c0, x0));
        _mm256_stream_ps(c + i + 8, _mm256_add_ps(c1, x1));
    }
    _mm_sfence();
    hz_traffic_plain(a, b, c, d, i, hi);
#else
    hz_traffic_plain(a, b, c, d, lo, hi);  /* no 256-bit streaming store in this build */
#endif
}

static void hz_traffic_range(int kind, float *restrict a, float *restrict b, float *restrict c,
                             const float *restrict d, size_t lo, size_t hi) {
    switch (kind) {
    case HZ_TRAFFIC_UNROLL: hz_traffic_unroll(a, b, c, d, lo, hi); return;
    case HZ_TRAFFIC_PREFETCH: hz_traffic_pf(a, b, c, d, lo, hi, 512); return;
    case HZ_TRAFFIC_PREFETCH_FAR: hz_traffic_pf(a, b, c, d, lo, hi, 2048); return;
    case HZ_TRAFFIC_STREAM: hz_traffic_stream(a, b, c, d, lo, hi); return;
    default: hz_traffic_plain(a, b, c, d, lo, hi);
    }
}

/* The engine's call over fp32 moments (28 B/param, the bytes of the 4-read, 3-write passes
 * above in another shape): the fp32 params and both moments and the 16-bit grads (the new
 * params written over them), each read and written in place.  It reads 14 B where those read
 * 16, and a core that is short of reads in flight moves it faster: 1 thread, 100M params, the
 * Xeon of family 6 model 167, 106.8 ms against 118.6 for the plain pass (medians of 7). */
static void hz_traffic16_range(float *restrict p, float *restrict m, float *restrict v,
                               uint16_t *restrict g, size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
        p[i] += 1.0f;
        m[i] += 1.0f;
        v[i] += 1.0f;
        g[i] += 1u;
    }
}

/* The same for the engine's call over 8-bit moments (16 B/param): the fp32 params, the 16-bit
 * grads (new params written over them) and the two code bytes, each read and written in place
 * (the per-block scales, 1/16 B/param, left out). */
static void hz_traffic8_range(float *restrict p, uint16_t *restrict g, uint8_t *restrict mc,
                              uint8_t *restrict uc, size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
        p[i] += 1.0f;
        g[i] += 1u;
        mc[i] += 1u;
        uc[i] += 1u;
    }
}

#endif /* HF_ZOFFLOAD_ADAM_KERNEL_H */
