/* Undo of one fp32 CPU-Adam step (AdamW, fp32 master and moments) from the gradient it read:
 * the overlapped schedule's correction (hf_zoffload/offload/schedules/inverse.py, the bound in
 * docs/protocols/step.md, "The correction bound").  One pass per element: the grad read, the
 * master and both moments read and written in place, 26 B/param with 16-bit grads (the step's
 * own 28 less the 16-bit output).
 *
 * Arithmetic: op for op the torch float64 reference (hf_zoffload.ops.adam_undo
 * .adam_undo_reference), so the two agree bit for bit: fp32 where the reference computes in
 * fp32 (g = fl(grad gs), d = sqrt(v) rbc2 + eps, q = fl(ns m) / d, fl(w2 g)), double elsewhere
 * (the scalar divisions as multiplications by double reciprocals, in both), each double result
 * rounded to fp32 once.  The build's -ffp-contract=off keeps every multiply and add separately
 * rounded, as torch's are.
 * The loop is auto-vectorized (gcc -O3: the fp32 ops in 8 lanes, the double ones in two halves
 * of 4), and a scalar tail computes the same correctly rounded ops, so the result does not
 * depend on the split or the thread count.
 *
 * Included by adam_kernel_body.h once per variant (HZ_FN names the functions); the argument
 * block is declared once, under its own guard. */

#ifndef HZ_UNDO_ARGS_DECLARED
#define HZ_UNDO_ARGS_DECLARED
/* Scalars as hf_zoffload.ops.adam_undo.undo_coefficients gives them: each an fp32 value (the
 * kernel's own, rounded once from double), widened exactly where the double ops use it. */
typedef struct {
    float *param, *exp_avg, *exp_avg_sq;  /* fp32, written in place */
    const void *grad;                      /* HZ_F32, HZ_F16 or HZ_BF16: the step's gradient */
    int grad_kind;
    int first;  /* the step undone was Adam step 1: the moments were zero */
    float grad_scale, c, w2, rbc2, eps, ns;
    double r_decay, r_omc, r_beta2;  /* 1 / decay, 1 / (1 - c), 1 / beta2, rounded in double */
} hz_undo_args;

typedef void (*hz_undo_fn)(const hz_undo_args *a, size_t lo, size_t hi);
#endif

/* torch's clamp(min=0) of a double: below zero (-inf included) -> +0; NaN and -0 kept.  On the
 * bits, as an int64 s: those are INT64_MIN < s <= -2^52 (-inf); -0 is INT64_MIN, a negative
 * NaN above -2^52.  gcc (12, under the default -ftrapping-math) will not if-convert a select on
 * a double compare, and the loop around it then stays scalar (measured 13x the step); this
 * form costs 2 compares and a mask: 18.5-19.3 ms at 10 M, 1 thread, Zen 3, against 17.5 with
 * no clamp and 20.4-21.7 for a mask from |x| - 1 < inf (7 integer ops). */
static inline uint64_t HZ_FN(hz_bits64)(double x) { uint64_t u; memcpy(&u, &x, 8); return u; }

static inline double HZ_FN(hz_clamp0)(double x) {
    int64_t s = (int64_t)HZ_FN(hz_bits64)(x);
    uint64_t keep = (s == INT64_MIN) | (s > -((int64_t)1 << 52));
    uint64_t u = (uint64_t)s & (0 - keep);
    memcpy(&x, &u, 8);
    return x;
}

/* n elements: p, m, v the state after the step, g the gradient it read (kind gk: HZ_F32 or
 * HZ_BF16, widened in the loop, exactly); first and gk are constants after inlining.  The three
 * divisions of the reference's algebra are multiplications by reciprocals rounded in double
 * (2^-53 each, far below the fp32 result's 2^-24): three 4-lane vdivpd per 8 elements made the
 * pass 27 ms against 20 ms at 10 M, 1 thread, Zen 3 (the step: 13). */
static inline __attribute__((always_inline)) void
HZ_FN(hz_undo_math)(float *restrict p, float *restrict m, float *restrict v,
                    const void *restrict g, size_t n, const hz_undo_args *a, const int first,
                    const int gk) {
    const float gs = a->grad_scale, rbc2 = a->rbc2, eps = a->eps, ns = a->ns, w2 = a->w2;
    const double c = a->c, r_decay = a->r_decay, r_omc = a->r_omc, r_b2 = a->r_beta2;
    for (size_t i = 0; i < n; ++i) {
        float gr = gk == HZ_F32 ? ((const float *)g)[i]
                                : hz_float((uint32_t)((const uint16_t *)g)[i] << 16);
        float gi = gr * gs;                         /* the step's own fl(grad * gs) */
        float mi = m[i], vi = v[i];
        float d = sqrtf(vi) * rbc2 + eps;           /* as the step's denominator */
        float q = (mi * ns) / d;                    /* the update the step added */
        p[i] = (float)(((double)p[i] - (double)q) * r_decay);
        if (first) {                                /* Adam step 1 started from zero moments */
            m[i] = 0.0f;
            v[i] = 0.0f;
        } else {
            double g64 = gi;
            m[i] = (float)(((double)mi - g64 * c) * r_omc);
            double r = ((double)vi - (double)(gi * w2) * g64) * r_b2;  /* fl(w2 g): the fma's */
            v[i] = (float)HZ_FN(hz_clamp0)(r);
        }
    }
}

static inline __attribute__((always_inline)) void
HZ_FN(hz_undo_span)(const hz_undo_args *a, const void *g, size_t i, size_t n, const int gk) {
    float *p = a->param + i, *m = a->exp_avg + i, *v = a->exp_avg_sq + i;
    if (a->first) HZ_FN(hz_undo_math)(p, m, v, g, n, a, 1, gk);
    else HZ_FN(hz_undo_math)(p, m, v, g, n, a, 0, gk);
}

/* Elements [lo, hi). fp32 and bf16 grads are read in the loop (bf16 -> fp32 is a shift; widening
 * a tile first, as the step's hz_tiles does, measured 15% slower: 23.1 against 20.0 ms at 10 M
 * elements, 1 thread, Zen 3); fp16 ones are widened a tile at a time (HZ_TILE, F16C where the
 * variant has it) and read from L1 (the same 22.7 ms either way). */
static void HZ_FN(hz_undo_range)(const hz_undo_args *a, size_t lo, size_t hi) {
    float gbuf[HZ_TILE] __attribute__((aligned(64)));
    if (a->grad_kind == HZ_F32) {
        HZ_FN(hz_undo_span)(a, (const float *)a->grad + lo, lo, hi - lo, HZ_F32);
        return;
    }
    if (a->grad_kind == HZ_BF16) {
        HZ_FN(hz_undo_span)(a, (const uint16_t *)a->grad + lo, lo, hi - lo, HZ_BF16);
        return;
    }
    for (size_t i = lo; i < hi; i += HZ_TILE) {
        size_t n = hi - i < HZ_TILE ? hi - i : HZ_TILE;
        HZ_FN(hz_widen)(gbuf, (const uint16_t *)a->grad + i, HZ_F16, n);
        HZ_FN(hz_undo_span)(a, gbuf, i, n, HZ_F32);
    }
}
