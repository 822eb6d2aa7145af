/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the 8-bit moments (HZ_Q8) in portable C, the reference the
 * fused path below must match bit for bit, and its fallback for a buffer's last, short block. No include guard on purpose. */

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

/* The update over decoded moments, writing sqrt(v) (what is stored) instead of v.  m and v
 * arrive decayed (decoded with beta1 and sqrt(beta2) folded into the block scales), so
 * m' = fma(1 - b1, g, m) and v' = fma((1 - b2) g, g, v): two vector ops per 8 lanes fewer
 * than torch's lerp and mul-then-addcmul (whose rounding the 8-bit codes do not keep anyway).
 * The ratio cap: exact Adam keeps |m| <= R sqrt(v) with R = (1 - b1) / sqrt((1 - b2)(1 -
 * b1^2 / b2)) (Cauchy-Schwarz over the two moving averages, any gradients, any step): the cap
 * never binds on exact moments, and on quantized ones (a sqrt(v) rounded to zero in a block
 * with a much larger element) it keeps every update within exact Adam's own worst case. */
static inline __attribute__((always_inline)) void
HZ_FN(hz_math_q8)(float *restrict p, float *restrict m, float *restrict v,
                  const float *restrict g, size_t n, const hz_adam_args *a, const int l2_on) {
    const float gs = a->grad_scale, decay = a->decay, l2 = a->l2, c = a->one_minus_beta1;
    const float omb2 = a->one_minus_beta2, rbc2 = a->inv_bc2_sqrt, eps = a->eps;
    const float ns = a->neg_step, icap = a->inv_ratio_cap;
    for (size_t i = 0; i < n; ++i) {
        float pi = p[i] * decay;
        float gi = g[i] * gs;
        if (l2_on) gi = fmaf(l2, pi, gi);
        float mi = fmaf(c, gi, m[i]);
        float vi = fmaf(omb2 * gi, gi, v[i]);
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
        HZ_FN(hz_q8_decode)(mt, vt, mc + i, uc + i, a->m_scale[blk] * a->beta1,
                            a->v_scale[blk] * a->sqrt_beta2, n);
        if (a->l2_on) HZ_FN(hz_math_q8)(a->param + i, mt, vt, g, n, a, 1);
        else HZ_FN(hz_math_q8)(a->param + i, mt, vt, g, n, a, 0);
        if (a->out_kind != HZ_NONE)
            HZ_FN(hz_narrow)((uint16_t *)a->out16 + i, a->param + i, a->out_kind, n);
        HZ_FN(hz_q8_encode)(mc + i, uc + i, a->m_scale + blk, a->v_scale + blk, mt, vt, n);
    }
}

