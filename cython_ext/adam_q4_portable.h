/* Part of the per-ISA body (adam_kernel_body.h includes it once per variant, with HZ_FN,
 * HZ_USE_* set): the 4-bit moments (HZ_Q4, adam_kernel.h) in portable C: one block per
 * iteration, decoded into L1 tiles, updated with the 8-bit path's math (hz_math_q8: the
 * decayed decode, the ratio cap), encoded.  The generic variant's path, the reference the
 * fused pass (adam_q4_fused.h in adam_coded_fused.h) must match bit for bit, and its fallback
 * for the blocks it does not take; no intrinsics, auto-vectorized (no contraction,
 * element-wise: the same bits at any width).  No include guard on purpose. */

/* n elements from codes starting at element 0 of mc / uc (a block start: even).  A loop over
 * bytes, two elements each, so that gcc vectorizes it (interleaved stores): per element with
 * the nibble picked by i & 1 it stayed scalar. */
static inline float HZ_FN(hz_q4_mval)(uint32_t c, float ms) {
    float f = hz_q_value(c & 7u, HZ_Q4M_MBITS, HZ_Q4M_BIAS) * ms;
    return hz_float(hz_bits(f) | ((c & 8u) << 28));
}

static inline float HZ_FN(hz_q4_vval)(uint32_t c, float us) {
    float u = hz_q_value(c, HZ_Q4U_MBITS, HZ_Q4U_BIAS) * us;
    return u * u;
}

static void HZ_FN(hz_q4_decode)(float *restrict m, float *restrict v, const uint8_t *restrict mc,
                                const uint8_t *restrict uc, float ms, float us, size_t n) {
    size_t j = 0;
    for (; 2 * j + 1 < n; ++j) {
        uint32_t a = mc[j], b = uc[j];
        m[2 * j] = HZ_FN(hz_q4_mval)(a & 15u, ms);
        m[2 * j + 1] = HZ_FN(hz_q4_mval)(a >> 4, ms);
        v[2 * j] = HZ_FN(hz_q4_vval)(b & 15u, us);
        v[2 * j + 1] = HZ_FN(hz_q4_vval)(b >> 4, us);
    }
    if (2 * j < n) {
        m[2 * j] = HZ_FN(hz_q4_mval)(mc[j] & 15u, ms);
        v[2 * j] = HZ_FN(hz_q4_vval)(uc[j] & 15u, us);
    }
}

static inline uint32_t HZ_FN(hz_q4_mcode)(float x, float im) {
    uint32_t b = hz_bits(x);
    uint32_t k = hz_q_code(hz_float(b & 0x7fffffffu) * im, HZ_Q4M_MBITS, HZ_Q4M_BIAS, HZ_Q4M_TOP);
    return k | (k ? (b >> 28) & 8u : 0u);  /* zero has one code */
}

static void HZ_FN(hz_q4_encode)(uint8_t *restrict mc, uint8_t *restrict uc, float *ms, float *us,
                                const float *restrict m, const float *restrict u, size_t n) {
    float sm = hz_q_scale(hz_absmax_bits(m, n)), su = hz_q_scale(hz_absmax_bits(u, n));
    float im = sm == 0.0f ? 0.0f : 1.0f / sm, iu = su == 0.0f ? 0.0f : 1.0f / su;
    size_t j = 0;
    for (; 2 * j + 1 < n; ++j) {
        mc[j] = (uint8_t)(HZ_FN(hz_q4_mcode)(m[2 * j], im) |
                          HZ_FN(hz_q4_mcode)(m[2 * j + 1], im) << 4);
        uc[j] = (uint8_t)(hz_q_code(u[2 * j] * iu, HZ_Q4U_MBITS, HZ_Q4U_BIAS, HZ_Q4U_TOP) |
                          hz_q_code(u[2 * j + 1] * iu, HZ_Q4U_MBITS, HZ_Q4U_BIAS, HZ_Q4U_TOP)
                              << 4);
    }
    if (2 * j < n) {  /* an odd count: the last byte's high nibble is 0 */
        mc[j] = (uint8_t)HZ_FN(hz_q4_mcode)(m[2 * j], im);
        uc[j] = (uint8_t)hz_q_code(u[2 * j] * iu, HZ_Q4U_MBITS, HZ_Q4U_BIAS, HZ_Q4U_TOP);
    }
    *ms = sm;
    *us = su;
}

static void HZ_FN(hz_q4_range)(const hz_adam_args *a, size_t lo, size_t hi) {
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
        HZ_FN(hz_q4_decode)(mt, vt, mc + i / 2, uc + i / 2, a->m_scale[blk] * a->beta1,
                            a->v_scale[blk] * a->sqrt_beta2, n);
        if (a->l2_on) HZ_FN(hz_math_q8)(a->param + i, mt, vt, g, n, a, 1);
        else HZ_FN(hz_math_q8)(a->param + i, mt, vt, g, n, a, 0);
        if (a->out_kind != HZ_NONE)
            HZ_FN(hz_narrow)((uint16_t *)a->out16 + i, a->param + i, a->out_kind, n);
        HZ_FN(hz_q4_encode)(mc + i / 2, uc + i / 2, a->m_scale + blk, a->v_scale + blk, mt, vt, n);
    }
}
