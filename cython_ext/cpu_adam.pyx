# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled one-pass CPU-Adam (module ``hf_zoffload.ops._cpu_adam``).

Private: takes raw addresses and trusts them.  hf_zoffload.ops.adam_kernels validates every tensor
(device, dtype, contiguity, numel, overlap) before it calls in here.
"""

from cython.parallel cimport prange
from libc.stdlib cimport free, malloc

# The module is hf_zoffload.ops._cpu_adam, so Cython does not pair it with cpu_adam.pxd by name;
# cimport the extern declarations explicitly (setup.py puts cython_ext on the include path).
from cpu_adam cimport *

# Below this many elements per thread the fork/join of a parallel region (a few us with
# libgomp) is a visible share of the work (16 Ki elements x 28 B = 0.46 MB, ~40 us at 12 GB/s).
cdef size_t MIN_PER_THREAD = 16384
# Chunk starts on a 64-byte line so two threads never write the same cache line (and, with
# 8- or 4-bit moments, on a block: a block is encoded by one thread, and a 4-bit block starts
# on a byte).
cdef size_t ALIGN = 16

FLOAT32 = HZ_F32
FLOAT16 = HZ_F16
BFLOAT16 = HZ_BF16
NO_OUTPUT = HZ_NONE
INT8 = HZ_Q8
INT4 = HZ_Q4
QBLOCK_MAX = HZ_QBLOCK_MAX
VARIANTS = {"auto": HZ_AUTO, "generic": HZ_GENERIC, "native": HZ_NATIVE,
            "avx2": HZ_AVX2, "avx512bf16": HZ_AVX512BF16}


cdef int _threads_for(size_t n, int num_threads) noexcept nogil:
    cdef size_t most = n / MIN_PER_THREAD
    if num_threads < 1:
        num_threads = 1
    if <size_t>num_threads > most:
        num_threads = <int>most if most > 1 else 1
    return num_threads


cdef inline size_t _chunk_for(size_t n, int num_threads, size_t align) noexcept nogil:
    # One contiguous static chunk per thread: each thread streams its own range (the hardware
    # prefetchers like long runs), and no element depends on where the split falls.
    cdef size_t chunk = (n + <size_t>num_threads - 1) / <size_t>num_threads
    return (chunk + align - 1) / align * align


# Elements [lo, hi) of whatever ctx describes: the one shape every pass below splits.
ctypedef void (*_part_fn)(const void *ctx, size_t lo, size_t hi) noexcept nogil


cdef void _split(_part_fn part, const void *ctx, size_t n, int num_threads,
                 size_t align) noexcept nogil:
    # Every pass's split: [0, n) in one chunk per thread (_chunk_for, starts on a multiple of
    # align), in one parallel region; in the caller's thread below 2 * MIN_PER_THREAD.
    cdef size_t chunk, lo, hi
    cdef Py_ssize_t c
    num_threads = _threads_for(n, num_threads)
    if num_threads <= 1:
        part(ctx, 0, n)
        return
    chunk = _chunk_for(n, num_threads, align)
    for c in prange(num_threads, schedule="static", num_threads=num_threads):
        lo = <size_t>c * chunk
        hi = lo + chunk if lo + chunk < n else n
        if lo < hi:
            part(ctx, lo, hi)


cdef struct _adam_ctx:
    const hz_adam_args *a
    hz_range_fn fn


cdef void _adam_part(const void *ctx, size_t lo, size_t hi) noexcept nogil:
    cdef const _adam_ctx *x = <const _adam_ctx *>ctx
    x.fn(x.a, lo, hi)


cdef void _adam_parallel(const hz_adam_args *a, hz_range_fn fn, size_t n,
                         int num_threads) noexcept nogil:
    cdef _adam_ctx x
    x.a = a
    x.fn = fn
    _split(_adam_part, &x, n, num_threads,
           <size_t>a.qblock if (a.state_kind == HZ_Q8 or a.state_kind == HZ_Q4)
           and <size_t>a.qblock > ALIGN else ALIGN)


cdef struct _undo_ctx:
    const hz_undo_args *a
    hz_undo_fn fn


cdef void _undo_part(const void *ctx, size_t lo, size_t hi) noexcept nogil:
    cdef const _undo_ctx *x = <const _undo_ctx *>ctx
    x.fn(x.a, lo, hi)


cdef struct _many_ctx:
    const hz_adam_args *args
    const size_t *start
    Py_ssize_t k
    hz_range_fn fn


cdef void _many_part(const void *ctx, size_t lo, size_t hi) noexcept nogil:
    # Elements [lo, hi) of the tensors laid end to end (tensor t holds [start[t], start[t + 1])):
    # one call per tensor the range touches, on that tensor's part of it.  So one parallel
    # region runs a whole list of tensors: many small ones cost one fork/join, not one each
    # (or none run in parallel: each below MIN_PER_THREAD).
    cdef const _many_ctx *x = <const _many_ctx *>ctx
    cdef Py_ssize_t a = 0, b = x.k, t, mid
    cdef size_t end, h
    while b - a > 1:  # the last t with start[t] <= lo
        mid = (a + b) // 2
        if x.start[mid] <= lo:
            a = mid
        else:
            b = mid
    t = a
    while lo < hi and t < x.k:
        end = x.start[t + 1]
        if end > lo:  # an empty tensor ends where it starts
            h = hi if hi < end else end
            x.fn(&x.args[t], lo - x.start[t], h - x.start[t])
            lo = h
        t += 1


cdef struct _traffic_ctx:
    int kind
    void *a
    void *b
    void *c
    void *d


cdef void _traffic_part(const void *ctx, size_t lo, size_t hi) noexcept nogil:
    cdef const _traffic_ctx *x = <const _traffic_ctx *>ctx
    if x.kind == -2:
        hz_traffic16_range(<float *>x.a, <float *>x.b, <float *>x.c, <unsigned short *>x.d,
                           lo, hi)
    elif x.kind < 0:
        hz_traffic8_range(<float *>x.a, <unsigned short *>x.b, <unsigned char *>x.c,
                          <unsigned char *>x.d, lo, hi)
    else:
        hz_traffic_range(x.kind, <float *>x.a, <float *>x.b, <float *>x.c, <const float *>x.d,
                         lo, hi)


cdef void _traffic_parallel(int kind, void *a, void *b, void *c, void *d, size_t n,
                            int num_threads) noexcept nogil:
    cdef _traffic_ctx x
    x.kind = kind
    x.a = a
    x.b = b
    x.c = c
    x.d = d
    _split(_traffic_part, &x, n, num_threads, ALIGN)  # the kernel's split: a comparable ceiling


def adam_step(size_t param, size_t exp_avg, size_t exp_avg_sq, size_t grad, size_t out16,
              size_t n, int grad_kind, int out_kind, bint l2_on, bint lerp_small,
              double grad_scale, double decay, double l2, double lerp_coef, double beta2,
              double one_minus_beta2, double inv_bc2_sqrt, double eps, double neg_step,
              int num_threads, int variant, int state_kind=HZ_F32, size_t m_scale=0,
              size_t v_scale=0, int qblock=0, double inv_ratio_cap=0.0, double beta1=0.0,
              double sqrt_beta2=0.0, size_t master16=0, unsigned int sr_key=0,
              unsigned int sr_first=0):
    """Run the pass over n elements; the GIL is released for the whole pass. master16: a
    bf16 master (param unused), rounded stochastically with sr_key, sr_first."""
    cdef hz_adam_args a
    cdef hz_range_fn fn = hz_select(variant)
    if fn == NULL:
        raise ValueError(f"kernel variant {variant} is not available in this build or CPU")
    a.param = <float *>param
    a.exp_avg = <void *>exp_avg
    a.exp_avg_sq = <void *>exp_avg_sq
    a.m_scale = <float *>m_scale
    a.v_scale = <float *>v_scale
    a.state_kind = state_kind
    a.qblock = qblock
    a.inv_ratio_cap = <float>inv_ratio_cap
    a.beta1 = <float>beta1
    a.one_minus_beta1 = <float>(1.0 - beta1)
    a.sqrt_beta2 = <float>sqrt_beta2
    a.grad = <const void *>grad
    a.out16 = <void *>out16
    a.grad_kind = grad_kind
    a.out_kind = out_kind
    a.l2_on = l2_on
    a.lerp_small = lerp_small
    a.grad_scale = <float>grad_scale
    a.decay = <float>decay
    a.l2 = <float>l2
    a.lerp_coef = <float>lerp_coef
    a.beta2 = <float>beta2
    a.one_minus_beta2 = <float>one_minus_beta2
    a.inv_bc2_sqrt = <float>inv_bc2_sqrt
    a.eps = <float>eps
    a.neg_step = <float>neg_step
    a.master_kind = HZ_BF16 if master16 else HZ_F32
    a.master16 = <unsigned short *>master16
    a.sr_key = sr_key
    a.sr_first = sr_first
    with nogil:
        _adam_parallel(&a, fn, n, num_threads)


def adam_step_many(list ptrs, list ns, list grad_kinds, list which, list scalars,
                   int num_threads, int variant):
    """fp32 params and moments, one update per tensor, in one parallel region over them all.
    Tensor i: ptrs[4 i .. 4 i + 3] = param, exp_avg, exp_avg_sq, grad; ns[i] elements, grad
    kind grad_kinds[i], scalars[which[i]] = (l2_on, lerp_small, grad_scale, decay, l2,
    lerp_coef, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step) as adam_step takes them."""
    cdef hz_range_fn fn = hz_select(variant)
    if fn == NULL:
        raise ValueError(f"kernel variant {variant} is not available in this build or CPU")
    cdef Py_ssize_t k = len(ns), i, nt = len(scalars)
    if len(ptrs) != 4 * k or len(grad_kinds) != k or len(which) != k:
        raise ValueError("adam_step_many: ptrs, ns, grad_kinds and which disagree in length")
    cdef hz_adam_args *tmpl = <hz_adam_args *>malloc((nt + k) * sizeof(hz_adam_args))
    cdef size_t *start = <size_t *>malloc((k + 1) * sizeof(size_t))
    cdef hz_adam_args *args = tmpl + nt
    cdef hz_adam_args *a
    cdef Py_ssize_t w
    cdef _many_ctx many
    if tmpl == NULL or start == NULL:
        free(tmpl)
        free(start)
        raise MemoryError()
    try:
        for i in range(nt):
            a = &tmpl[i]
            (a.l2_on, a.lerp_small, a.grad_scale, a.decay, a.l2, a.lerp_coef, a.beta2,
             a.one_minus_beta2, a.inv_bc2_sqrt, a.eps, a.neg_step) = scalars[i]
            a.state_kind = HZ_F32
            a.out_kind = HZ_NONE
            a.out16 = NULL
            a.master_kind = HZ_F32
            a.master16 = NULL
            a.m_scale = NULL
            a.v_scale = NULL
            a.qblock = 0
            a.inv_ratio_cap = 0.0
            a.beta1 = 0.0
            a.one_minus_beta1 = 0.0
            a.sqrt_beta2 = 0.0
            a.sr_key = 0
            a.sr_first = 0
        start[0] = 0
        for i in range(k):
            w = which[i]
            if w < 0 or w >= nt:
                raise ValueError(f"adam_step_many: which[{i}] = {w} names no scalars")
            args[i] = tmpl[w]
            args[i].param = <float *><size_t>ptrs[4 * i]
            args[i].exp_avg = <void *><size_t>ptrs[4 * i + 1]
            args[i].exp_avg_sq = <void *><size_t>ptrs[4 * i + 2]
            args[i].grad = <const void *><size_t>ptrs[4 * i + 3]
            args[i].grad_kind = grad_kinds[i]
            start[i + 1] = start[i] + <size_t>ns[i]
        many.args = args
        many.start = start
        many.k = k
        many.fn = fn
        with nogil:
            _split(_many_part, &many, start[k], num_threads, ALIGN)
    finally:
        free(tmpl)
        free(start)


def adam_undo(size_t param, size_t exp_avg, size_t exp_avg_sq, size_t grad, size_t n,
              int grad_kind, bint first, double grad_scale, double c, double w2, double rbc2,
              double eps, double ns, double r_decay, double r_omc, double r_beta2,
              int num_threads, int variant):
    """Undo one fp32 step over n elements in place (adam_undo.h), from the grad it read and
    its scalars (hf_zoffload.ops.adam_undo.undo_coefficients: fp32 values, the three r_
    reciprocals double); the GIL is released."""
    cdef hz_undo_args a
    cdef hz_undo_fn fn = hz_select_undo(variant)
    if fn == NULL:
        raise ValueError(f"kernel variant {variant} is not available in this build or CPU")
    a.param = <float *>param
    a.exp_avg = <float *>exp_avg
    a.exp_avg_sq = <float *>exp_avg_sq
    a.grad = <const void *>grad
    a.grad_kind = grad_kind
    a.first = first
    a.grad_scale = <float>grad_scale
    a.c = <float>c
    a.w2 = <float>w2
    a.rbc2 = <float>rbc2
    a.eps = <float>eps
    a.ns = <float>ns
    a.r_decay = r_decay
    a.r_omc = r_omc
    a.r_beta2 = r_beta2
    cdef _undo_ctx x
    x.a = &a
    x.fn = fn
    with nogil:
        _split(_undo_part, &x, n, num_threads, ALIGN)  # the step's split, on a 64-byte line


# The ways of the 28-B ceiling pass (adam_kernel.h's HZ_TRAFFIC_*), by name.
TRAFFIC_KINDS = {"plain": 0, "unroll 4": 1, "prefetch 512": 2, "prefetch 2048": 3,
                 "streaming stores": 4}


def bump_steps(list ptrs):
    """Add 1 to the float32 at each address, then read each back as an int: what
    torch._foreach_add_(steps, 1.0) and torch.stack(steps).tolist() give, an address listed
    twice included (both adds land before any read)."""
    cdef Py_ssize_t i, n = len(ptrs)
    cdef float *f
    for i in range(n):
        f = <float *><size_t>ptrs[i]
        f[0] = f[0] + 1.0
    return [int((<float *><size_t>ptrs[i])[0]) for i in range(n)]


def traffic_pass(size_t a, size_t b, size_t c, size_t d, size_t n, int num_threads,
                 int kind=HZ_TRAFFIC_PLAIN):
    """Memory ceiling: a += d; b += d; c += d over fp32 buffers (reads 4 streams, writes 3),
    moved the way ``kind`` (a value of TRAFFIC_KINDS) says."""
    if kind < 0 or kind >= HZ_TRAFFIC_KINDS:
        raise ValueError(f"traffic kind {kind}: one of {sorted(TRAFFIC_KINDS.values())}")
    with nogil:
        _traffic_parallel(kind, <void *>a, <void *>b, <void *>c, <void *>d, n, num_threads)


def traffic_pass16(size_t param, size_t exp_avg, size_t exp_avg_sq, size_t grad16, size_t n,
                   int num_threads):
    """Memory ceiling of the engine's call over fp32 moments: fp32 params and moments and
    16-bit grads, each read and written in place (28 B/param, 14 of them read)."""
    with nogil:
        _traffic_parallel(-2, <void *>param, <void *>exp_avg, <void *>exp_avg_sq,
                          <void *>grad16, n, num_threads)


def traffic_pass_q8(size_t param, size_t grad16, size_t m_codes, size_t v_codes, size_t n,
                    int num_threads):
    """Memory ceiling over 8-bit moments: fp32 params, 16-bit grads and two code bytes, each
    read and written in place (16 B/param, the engine's int8 call less its block scales)."""
    with nogil:
        _traffic_parallel(-1, <void *>param, <void *>grad16, <void *>m_codes, <void *>v_codes, n,
                          num_threads)


def q8_encode(size_t m, size_t v, size_t mc, size_t uc, size_t ms, size_t us, size_t n,
              size_t qblock):
    """fp32 moments (v: exp_avg_sq) -> 8-bit codes and block scales; n starts on a block."""
    with nogil:
        hz_q8_encode_buf(<const float *>m, <const float *>v, <unsigned char *>mc,
                         <unsigned char *>uc, <float *>ms, <float *>us, n, qblock)


def q8_decode(size_t m, size_t v, size_t mc, size_t uc, size_t ms, size_t us, size_t n,
              size_t qblock):
    """8-bit codes and block scales -> fp32 moments (v: exp_avg_sq)."""
    with nogil:
        hz_q8_decode_buf(<float *>m, <float *>v, <const unsigned char *>mc,
                         <const unsigned char *>uc, <const float *>ms, <const float *>us, n,
                         qblock)


def q4_encode(size_t m, size_t v, size_t mc, size_t uc, size_t ms, size_t us, size_t n,
              size_t qblock):
    """fp32 moments -> 4-bit codes (two per byte) and block scales; n starts on a block."""
    with nogil:
        hz_q4_encode_buf(<const float *>m, <const float *>v, <unsigned char *>mc,
                         <unsigned char *>uc, <float *>ms, <float *>us, n, qblock)


def q4_decode(size_t m, size_t v, size_t mc, size_t uc, size_t ms, size_t us, size_t n,
              size_t qblock):
    """4-bit codes (two per byte) and block scales -> fp32 moments (v: exp_avg_sq)."""
    with nogil:
        hz_q4_decode_buf(<float *>m, <float *>v, <const unsigned char *>mc,
                         <const unsigned char *>uc, <const float *>ms, <const float *>us, n,
                         qblock)


def sr_round(size_t dst, size_t x, size_t n, unsigned int key, unsigned int first):
    """fp32 x -> bf16 dst with the bf16 master's stochastic rounding (element i's bits from
    key and first + i)."""
    with nogil:
        hz_sr_round_buf(<unsigned short *>dst, <const float *>x, n, key, first)


def variant_available(int variant):
    return hz_select(variant) != NULL


def variant_features(int variant):
    """Instruction sets a variant uses, as a dict; variant 0 (auto) is resolved first."""
    cdef int v = variant
    if v == HZ_AUTO:
        for v in (HZ_NATIVE, HZ_AVX512BF16, HZ_AVX2, HZ_GENERIC):
            if hz_select(v) == hz_select(HZ_AUTO):
                break
    cdef int f = hz_variant_features(v)
    return {"avx2": bool(f & HZ_FEAT_AVX2), "avx512f": bool(f & HZ_FEAT_AVX512F),
            "f16c": bool(f & HZ_FEAT_F16C), "avx512_bf16": bool(f & HZ_FEAT_AVX512BF16)}


def auto_variant():
    """Name of the variant that variant 0 (auto) runs."""
    for name, v in VARIANTS.items():
        if v != HZ_AUTO and hz_select(v) != NULL and hz_select(v) == hz_select(HZ_AUTO):
            return name
    raise RuntimeError("no kernel variant can run on this CPU")


def openmp_compiled():
    return bool(hz_openmp_compiled())


def portable_build():
    return bool(hz_portable_build())
