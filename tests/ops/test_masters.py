"""The bf16 master (``master_dtype`` bf16): its stochastic rounding against the torch
reference, what the rounding promises (unbiased, keyed by element index only), and the kernel
over a bf16 master against the kernel over the same values in fp32 then rounded."""

import pytest
import torch

from hf_zoffload.ops import adam_kernels as ca
from hf_zoffload.ops import masters as ms
from hf_zoffload.ops import moments as mo

HP = dict(beta1=0.9, beta2=0.999, eps=1e-8)
VARIANTS = ["generic"] + [v for v in ("native", "avx2", "avx512bf16")
                          if ca._ext().variant_available(ca._ext().VARIANTS[v])]


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("n", [1, 7, 4097, 100_003])
def test_sr_round_equals_reference(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-30, 30, generator=gen)
    x[::97], x[1::89], x[2::83] = float("nan"), float("inf"), -0.0
    x[3::79] = torch.tensor(1e-40)  # subnormal
    for key, first in [(0, 0), (ms.step_key(7, 3, 11), 12345), (2**32 - 1, 2**32 - 5)]:
        assert torch.equal(_bits(ms.round_sr(x, key, first)),
                           _bits(ms.round_sr_reference(x, key, first)))


def test_sr_is_unbiased_and_within_one_step():
    """Each value lands on one of its two bf16 neighbours, up with probability (dropped
    bits) / 2^16: the mean of many roundings is the value (n = 2^18 draws: the standard
    error of the mean is below 0.1% of a step)."""
    n = 2**18
    for v in (1.0 + 0.3 * 2**-7, -(1.0 + 0.9 * 2**-7), 3e-5 * (1 + 2**-9)):
        x = torch.full((n,), v)
        r = ms.round_sr(x, ms.step_key(1, 2, 3)).float()
        down = torch.tensor(v).view(torch.int32) & ~0xFFFF
        lo = down.view(torch.float32).item()  # truncation: the neighbour toward zero
        hi = (down + 0x10000).view(torch.float32).item()
        assert set(r.unique().tolist()) <= {lo, hi}
        step = abs(hi - lo)
        assert abs(r.double().mean().item() - v) < 0.005 * step


def test_sr_keys_streams_by_seed_step_and_param_only():
    x = torch.full((1000,), 1.0 + 0.5 * 2**-7)
    a = ms.round_sr(x, ms.step_key(5, 10, 2))
    assert not torch.equal(a, ms.round_sr(x, ms.step_key(5, 11, 2)))  # another step
    assert not torch.equal(a, ms.round_sr(x, ms.step_key(5, 10, 3)))  # another param
    assert not torch.equal(a, ms.round_sr(x, ms.step_key(6, 10, 2)))  # another seed
    # element i's bits depend on its index only: a split with the right first is the same
    key = ms.step_key(5, 10, 2)
    parts = torch.cat([ms.round_sr(x[:300], key, 0), ms.round_sr(x[300:], key, 300)])
    assert torch.equal(_bits(parts), _bits(a))
    assert ms.hash32(0) == 0 and ms.hash32(1) != 1  # lowbias32: a bijection with 0 fixed


def _state(n, state_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(torch.bfloat16)
    m = torch.randn(n, generator=gen) * 1e-3
    v = m * m * (1 + torch.rand(n, generator=gen)) * 4
    fmt = mo.FORMATS[state_dtype]
    if not fmt.scaled:
        return [p, m.to(fmt.dtype), v.to(fmt.dtype)], None
    st = [p, torch.empty(fmt.storage(n), dtype=torch.uint8),
          torch.empty(fmt.storage(n), dtype=torch.uint8)]
    scales = (torch.empty(fmt.n_scales(n)), torch.empty(fmt.n_scales(n)))
    fmt.encode(m, v, st[1], st[2], scales, 0)
    return st, scales


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("n", [1, 129, 5000, 100_003])
def test_bf16_master_is_the_fp32_update_rounded_stochastically(state_dtype, n):
    """The kernel over a bf16 master equals the kernel over the same values as an fp32
    master, rounded with `round_sr` (bit for bit: same moments, same master), its 16-bit
    output is the new master; the torch reference agrees too (bitwise here)."""
    key, first = ms.step_key(ms.SR_SEED, 4, 9), 77
    g = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-2).to(torch.bfloat16)
    kw = dict(step=4, lr=1e-3, weight_decay=0.01, state_dtype=state_dtype, **HP)
    (p, m, v), sc = _state(n, state_dtype, n)
    (p2, m2, v2), sc2 = _state(n, state_dtype, n)
    (p3, m3, v3), sc3 = _state(n, state_dtype, n)
    out = g.clone()
    ca.adam_update(p, out, m, v, out16=out, scales=sc, sr=(key, first), **kw)
    p32 = p2.float()
    ca.adam_update(p32, g, m2, v2, scales=sc2, **kw)
    assert torch.equal(_bits(p), _bits(ms.round_sr(p32, key, first)))
    assert torch.equal(m, m2) and torch.equal(v, v2) and torch.equal(_bits(out), _bits(p))
    if sc is not None:
        assert all(torch.equal(a, b) for a, b in zip(sc, sc2))
    ca.adam_update_reference(p3, g, m3, v3, scales=sc3, sr=(key, first), **kw)
    assert torch.equal(_bits(p3), _bits(p)) and torch.equal(m3, m) and torch.equal(v3, v)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_master_variants_threads_and_splits_bitwise_equal(variant):
    n, key = 100_003, ms.step_key(3, 2, 1)
    g = (torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-2).to(torch.bfloat16)

    def run(threads, splits, var):
        (p, m, v), sc = _state(n, "int4", 5)
        fmt = mo.FORMATS["int4"]
        for lo, hi in zip(splits, splits[1:]):
            scales = tuple(s[lo // fmt.block:][:fmt.n_scales(hi - lo)] for s in sc)
            ca._update(p[lo:hi], g[lo:hi], fmt.part(m, lo, hi), fmt.part(v, lo, hi), step=3,
                       lr=1e-3, weight_decay=0.01, scales=scales, state_dtype="int4",
                       sr=(key, lo), num_threads=threads, variant=var, **HP)
        return [p, m, v, *sc]

    base = run(1, [0, n], "generic")
    for threads, splits in [(2, [0, n]), (3, [0, n]), (2, [0, 33 * mo.Q4BLOCK, n])]:
        for a, b in zip(run(threads, splits, variant), base):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (threads, splits)


def test_small_updates_move_a_bf16_master_on_average():
    """An update a quarter of a bf16 step, 40 times: rounded to nearest the weights would never
    move; rounded stochastically they move by the sum on average (10 steps), each element a
    whole number of steps."""
    n = 2**16
    p = torch.ones(n, dtype=torch.bfloat16)  # step 2^-7 just below 1.0 is 2^-8
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 41):
        # Adam's first update is lr * sign(g): lr = 2^-10 is a quarter of the step below 1
        ca.adam_update(p, torch.ones(n), m, v, step=step, lr=2.0**-10, weight_decay=0.0,
                       sr=(ms.step_key(0, step, 0), 0), beta1=0.0, beta2=0.0, eps=0.0)
    moved = 1.0 - p.double()
    assert abs(moved.mean().item() - 40 * 2.0**-10) < 0.02 * 40 * 2.0**-10
    assert ((moved / 2.0**-8).round() == moved / 2.0**-8).all()


def test_bad_bf16_master_arguments():
    p = torch.zeros(4, dtype=torch.bfloat16)
    z = torch.zeros(4)
    kw = dict(step=1, lr=1e-3, weight_decay=0.0, **HP)
    with pytest.raises(ValueError, match=r"bf16 master .* needs sr=\(key, index of element 0\)"):
        ca.adam_update(p, z, z.clone(), z.clone(), **kw)
    with pytest.raises(ValueError, match="two ints in"):
        ca.adam_update(p, z, z.clone(), z.clone(), sr=(2**32, 0), **kw)
    with pytest.raises(TypeError, match="out16 of a bf16 master must be bf16"):
        ca.adam_update(p, z, z.clone(), z.clone(), sr=(1, 0),
                       out16=torch.zeros(4, dtype=torch.float16), **kw)
    with pytest.raises(ValueError, match="sr is for a bf16 master"):
        ca.adam_update(z.clone(), z, z.clone(), z.clone(), sr=(1, 0), **kw)


def test_each_master_dtype_is_one_format_object():
    from hf_zoffload.config import MASTER_DTYPES

    assert tuple(ms.MASTERS) == MASTER_DTYPES
    fp32, bf16 = (ms.master_format(n) for n in MASTER_DTYPES)
    assert (fp32.dtype, bf16.dtype) == (torch.float32, torch.bfloat16)
    assert (fp32.bytes_per_element(), bf16.bytes_per_element()) == (4, 2)
    assert (fp32.stochastic, bf16.stochastic) == (False, True)
    with pytest.raises(ValueError, match="master_dtype must be one of fp32, bf16"):
        ms.master_format("fp16")


M16_SIZES = [1, 15, 16, 17, 127, 128, 129, 4097, 49_153]  # 49_153: three threads' chunks
SHARD = 40 * mo.QBLOCK  # the largest param is also updated as two shards, split here


def _spans(sizes, block=mo.QBLOCK):
    """(offset, length, param index, index of its first element in the param) of params laid
    out as the engine lays them (each on a block: 256 elements, a multiple of every format's),
    the last one twice as big shards; and the buffer's length."""
    spans, end = [], 0
    for k, n in enumerate(sizes):
        spans.append((end, n, k, 0))
        end += -(-n // block) * block
    o, n, k, _ = spans[-1]
    return spans, [*spans[:-1], (o, SHARD, k, 0), (o + SHARD, n - SHARD, k, SHARD)], end


def _m16_runner(state_dtype, grads, out, adamw_mode, start):
    """run(fn, spans, **kw): the bytes of master, moments, scales and outputs after one call per
    span per step from a copy of start ([master, m, v], scales)."""
    fmt = mo.FORMATS[state_dtype]

    def run(fn, spans, **kw):
        (p, m, v), sc = [t.clone() for t in start[0]], start[1]
        sc = None if sc is None else [t.clone() for t in sc]
        outs = []
        for step, g0 in enumerate(grads, 3):
            g = g0.clone()
            o16 = g if out == "grad" else None if out is None else torch.zeros_like(p)
            for o, n, k, first in spans:
                scales = None if sc is None else \
                    tuple(s[o // fmt.block:][:fmt.n_scales(n)] for s in sc)
                fn(p[o:o + n], g[o:o + n], fmt.part(m, o, o + n), fmt.part(v, o, o + n),
                   step=step, lr=1e-3, weight_decay=0.01, adamw_mode=adamw_mode,
                   out16=None if o16 is None else o16[o:o + n], scales=scales,
                   state_dtype=state_dtype, sr=(ms.step_key(ms.SR_SEED, step, k), first),
                   **HP, **kw)
            outs += [] if o16 is None else [o16]
        return [t.view(torch.uint8) for t in (p, m, v, *(sc or []), *outs)]

    return run


def _check(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (what, i)


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("grad_dtype,out,adamw_mode", [
    (torch.bfloat16, "grad", True), (torch.float16, torch.bfloat16, False),
    (torch.float32, torch.bfloat16, True), (torch.float32, None, False)])
def test_bf16_master_fused_equals_portable_and_reference(variant, state_dtype, grad_dtype, out,
                                                         adamw_mode):
    """The fused bf16-master passes (adam_m16_fused.h: the master widened as it is loaded and
    rounded stochastically as it is stored, in every variant but generic) against the portable
    hz_m16_tiles (generic: a tile widened, the fp32-master pass, the rounding, a copy) and the
    torch reference, bit for bit: params of odd sizes each on a block, one call per param with
    its key (1 and 3 threads), the largest also as two shards, the second passing its first
    element's index (2 threads); two steps.  The reference runs on the params under 16K elements."""
    spans, shards, total = _spans(M16_SIZES)
    grads = [_grad_like(total, grad_dtype, step) for step in range(2)]
    (p, m, v), sc = _state(total, state_dtype, 7)
    run = _m16_runner(state_dtype, grads, out, adamw_mode, ([p, m, v], sc))
    small = [s for s in spans if s[1] < 16384]
    _check(run(ca.adam_update_reference, small), run(ca._update, small, variant=variant,
                                                     num_threads=1), "reference")
    base = run(ca._update, spans, variant="generic", num_threads=1)
    for threads, parts in ((1, spans), (3, spans), (2, shards)):
        _check(run(ca._update, parts, variant=variant, num_threads=threads), base, threads)


def _grad_like(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 1e-2).to(dtype)


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8", "int4"])
def test_bf16_master_special_values_bitwise_equal_to_generic(variant, state_dtype):
    """Any bf16 master bits (NaN of either sign and any payload, signalling ones included, inf,
    subnormals, zeros of both signs, the largest finite values) through the fused store's NaN
    path and the carry of its rounding give the portable path's bits, out over the grads and
    apart.  AdamW's decoupled decay only: with L2 a NaN param reaches the moments, and the
    codes of a NaN block are not comparable (test_moments.py, special values)."""
    n = 16 * mo.QBLOCK + 40  # a tail of 40: 16-lane vectors and the last 8 portable
    gen = torch.Generator().manual_seed(4)
    (p, m, v), sc = _state(n, state_dtype, 8)
    hard = torch.tensor([0x7FC0, -0x3F, 0x7F81, 0x7FFF, -0x7F, 0x7F80, -0x80, 1, -0x7FFF, 0,
                         -0x8000, 0x7F7F, -0x81, 0x0080], dtype=torch.int16)
    pick = torch.randint(0, 24, (n,), generator=gen)
    bits = p.view(torch.int16).clone()
    bits = torch.where(pick < hard.numel(), hard[pick.clamp(max=hard.numel() - 1)], bits)
    bits = torch.where(pick == 23, torch.randint(-2**15, 2**15, (n,), generator=gen,
                                                 dtype=torch.int16), bits)
    start = ([bits.view(torch.bfloat16), m, v], sc)
    for out in ("grad", torch.bfloat16):
        run = _m16_runner(state_dtype, [_grad_like(n, torch.bfloat16, 1)], out, True, start)
        spans = [(0, n, 0, 0)]
        _check(run(ca._update, spans, variant=variant), run(ca._update, spans,
                                                           variant="generic"), out)
