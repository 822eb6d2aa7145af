# Declarations of the C kernel in adam_kernel.h (the SIMD body is in adam_kernel_body.h).

cdef extern from "adam_kernel.h" nogil:
    enum:
        HZ_F32
        HZ_F16
        HZ_BF16
        HZ_NONE
        HZ_Q8
        HZ_Q4
        HZ_QBLOCK_MAX
        HZ_AUTO
        HZ_GENERIC
        HZ_NATIVE
        HZ_AVX2
        HZ_AVX512BF16
        HZ_NVARIANTS
        HZ_FEAT_AVX2
        HZ_FEAT_AVX512F
        HZ_FEAT_F16C
        HZ_FEAT_AVX512BF16
        HZ_TRAFFIC_PLAIN
        HZ_TRAFFIC_KINDS

    ctypedef struct hz_adam_args:
        float *param
        void *exp_avg
        void *exp_avg_sq
        float *m_scale
        float *v_scale
        const void *grad
        void *out16
        int grad_kind
        int out_kind
        int state_kind
        int qblock
        int l2_on
        int lerp_small
        float grad_scale
        float decay
        float l2
        float lerp_coef
        float beta2
        float one_minus_beta2
        float inv_bc2_sqrt
        float eps
        float neg_step
        float inv_ratio_cap
        float beta1
        float one_minus_beta1
        float sqrt_beta2
        int master_kind
        unsigned short *master16
        unsigned int sr_key
        unsigned int sr_first

    ctypedef void (*hz_range_fn)(const hz_adam_args *a, size_t lo, size_t hi) noexcept nogil

    hz_range_fn hz_select(int variant)

    # adam_undo.h: the undo of one fp32 step
    ctypedef struct hz_undo_args:
        float *param
        float *exp_avg
        float *exp_avg_sq
        const void *grad
        int grad_kind
        int first
        float grad_scale
        float c
        float w2
        float rbc2
        float eps
        float ns
        double r_decay
        double r_omc
        double r_beta2

    ctypedef void (*hz_undo_fn)(const hz_undo_args *a, size_t lo, size_t hi) noexcept nogil

    hz_undo_fn hz_select_undo(int variant)
    int hz_variant_features(int variant)
    int hz_openmp_compiled()
    int hz_portable_build()
    void hz_q8_encode_buf(const float *m, const float *v, unsigned char *mc, unsigned char *uc,
                          float *ms, float *us, size_t n, size_t bs)
    void hz_q8_decode_buf(float *m, float *v, const unsigned char *mc, const unsigned char *uc,
                          const float *ms, const float *us, size_t n, size_t bs)
    void hz_q4_encode_buf(const float *m, const float *v, unsigned char *mc, unsigned char *uc,
                          float *ms, float *us, size_t n, size_t bs)
    void hz_q4_decode_buf(float *m, float *v, const unsigned char *mc, const unsigned char *uc,
                          const float *ms, const float *us, size_t n, size_t bs)
    void hz_sr_round_buf(unsigned short *dst, const float *x, size_t n, unsigned int key,
                         unsigned int first)
    void hz_traffic_range(int kind, float *a, float *b, float *c, const float *d, size_t lo,
                          size_t hi)
    void hz_traffic16_range(float *p, float *m, float *v, unsigned short *g, size_t lo,
                            size_t hi)
    void hz_traffic8_range(float *p, unsigned short *g, unsigned char *mc, unsigned char *uc,
                           size_t lo, size_t hi)
