"""Compact Adam moments (``state_dtype`` bf16 / int8 / int4): the 8- and 4-bit block codes
against their torch references, the kernel over compact moments against its reference and
against fp64 Adam.

Bounds, derived from the code (hf_zoffload/ops/moments.py), for an element x of a block whose
scale (largest magnitude) is s:
- exp_avg, 3 mantissa bits, values 2^-15 .. 1 of s: above the flush level, round to nearest
  costs at most half a step, 2^-4 of |x|; below 1.0625 * 2^-15 * s (the midpoint between
  zero's code and the smallest nonzero one, 1.125 * 2^-15), x becomes 0: error <= |x| there.
  So |x - dec| <= max(2^-4 |x|, 1.0625 * 2^-15 s) plus the decode's one fp32 rounding.
- sqrt(exp_avg_sq) = u, 4 mantissa bits: |u - dec| <= max(2^-5 |u|, 1.03125 * 2^-15 s_u).
- bf16: round to nearest even, 8 bits of mantissa: relative error <= 2^-9.
- int4, exp_avg: sign + 3 exponent bits, values 2^-6 .. 1 of s, a factor 2 apart; rounding
  on the float's bits puts the cut at 1.5 x a power of two: error <= |x| / 3 there; below
  1.5 * 2^-7 * s, x becomes 0. So |x - dec| <= max(|x| / 3, 1.5 * 2^-7 s).
- int4, u: 3 exponent bits and 1 mantissa bit (1, 1.5 x 2^e): half a step is 2^(e-2), at most
  |u| / 4; below 1.25 * 2^-7 * s_u (halfway from 2^-7, code 0, to the smallest code 1.5 * 2^-7)
  u becomes 0. So |u - dec| <= max(|u| / 4, 1.25 * 2^-7 s_u).
"""

import math

import pytest
import torch

from hf_zoffload.ops import adam_kernels as ca
from hf_zoffload.ops import moments as mo

ODD_SIZES = [1, 7, 255, 257, 4097, 1_000_003]
HP = dict(beta1=0.9, beta2=0.999, eps=1e-8)
VARIANTS = ["generic"] + [v for v in ("native", "avx2", "avx512bf16")
                          if ca._ext().variant_available(ca._ext().VARIANTS[v])]
ULP = 2.0**-23


def _moments(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # magnitudes over 12 decades, so every block mixes flushed, small and large elements
    m = torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-10, 2, generator=gen)
    v = (torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-10, 1, generator=gen))**2
    return m, v


def _encode(m, v):
    n = m.numel()
    out = (torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8),
           torch.empty(mo.n_blocks(n)), torch.empty(mo.n_blocks(n)))
    mo.encode_moments(m, v, *out)
    return out


def _per_element(scales, n, block=mo.QBLOCK):
    return scales.repeat_interleave(block)[:n]


def _encode4(m, v):
    n = m.numel()
    out = (torch.empty(mo.n_codes4(n), dtype=torch.uint8),
           torch.empty(mo.n_codes4(n), dtype=torch.uint8),
           torch.empty(mo.n_blocks(n, mo.Q4BLOCK)), torch.empty(mo.n_blocks(n, mo.Q4BLOCK)))
    mo.encode_moments4(m, v, *out)
    return out


def _coded(n, seed, state_dtype):
    """[p, m codes, u codes, m scales, u scales] of a state Adam could reach."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-3
    v = m * m * (1 + torch.rand(n, generator=gen)) * 4
    return [p, *(_encode(m, v) if state_dtype == "int8" else _encode4(m, v))]


@pytest.mark.parametrize("n", ODD_SIZES)
def test_codec_equals_reference_and_round_trips(n):
    m, v = _moments(n, seed=n)
    m[::5] = 0.0
    v[::3] = 0.0
    m[1::97] = torch.tensor(1e-40)  # fp32 subnormals
    v[2::89] = torch.tensor(1e-41)
    codes = _encode(m, v)
    ref = mo.encode_reference(m, v)
    for a, b in zip(codes, ref):
        assert torch.equal(a, b)
    dm, dv = mo.decode_moments(*codes)
    rm, rv = mo.decode_reference(*ref)
    assert torch.equal(dm, rm) and torch.equal(dv, rv)
    again = _encode(dm, dv)  # encode(decode(codes)) == codes: an exact resume
    for a, b in zip(again, codes):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", ODD_SIZES)
def test_codec_error_within_the_derived_bound(n):
    m, v = _moments(n, seed=n + 1)
    mc, uc, sm, su = _encode(m, v)
    dm, dv = mo.decode_moments(mc, uc, sm, su)
    s = _per_element(sm, n)
    bound = torch.maximum(2.0**-4 * m.abs(), 1.0625 * 2.0**-15 * s) * (1 + 2 * ULP)
    assert ((dm - m).abs() <= bound).all()
    u, du, su_ = v.double().sqrt(), dv.double().sqrt(), _per_element(su, n).double()
    bound_u = torch.maximum(2.0**-5 * u, 1.03125 * 2.0**-15 * su_) * (1 + 4 * ULP)
    assert ((du - u).abs() <= bound_u).all()
    if n > mo.QBLOCK:  # the bound is tight: some elements use most of it
        assert ((dm - m).abs() > 0.5 * bound).any()
    # each block's largest element is exact, and its scale is that element
    blocks = m.abs().new_zeros(mo.n_blocks(n) * mo.QBLOCK)
    blocks[:n] = m.abs()
    assert torch.equal(sm, blocks.view(-1, mo.QBLOCK).amax(1))


def test_one_huge_value_per_block_flushes_only_what_is_below_the_range():
    n = 4 * mo.QBLOCK
    m = torch.full((n,), 1e-3)
    m[::mo.QBLOCK] = 1e3  # one huge value per block: the rest is 2^-19.9 of it: flushed
    m[5] = 1e3 * 2.0**-14  # inside the 15 binades: kept within 2^-4
    mc, uc, sm, su = _encode(m, m * m)
    dm, dv = mo.decode_moments(mc, uc, sm, su)
    assert torch.equal(dm[::mo.QBLOCK], m[::mo.QBLOCK])
    assert (dm[6:mo.QBLOCK] == 0).all()
    assert abs(dm[5] - m[5]) <= 2.0**-4 * m[5]


def test_nan_poisons_its_block_only():
    m, v = _moments(3 * mo.QBLOCK)
    m[mo.QBLOCK + 3] = float("nan")
    dm, _ = mo.decode_moments(*_encode(m, v))
    assert dm[mo.QBLOCK:2 * mo.QBLOCK].isnan().all()
    assert not dm[:mo.QBLOCK].isnan().any() and not dm[2 * mo.QBLOCK:].isnan().any()


@pytest.mark.parametrize("n", ODD_SIZES)
def test_codec4_equals_reference_and_round_trips(n):
    m, v = _moments(n, seed=n)
    m[::5] = 0.0
    v[::3] = 0.0
    m[1::97] = torch.tensor(1e-40)  # fp32 subnormals
    v[2::89] = torch.tensor(1e-41)
    codes = _encode4(m, v)
    ref = mo.encode_reference4(m, v)
    for a, b in zip(codes, ref):
        assert torch.equal(a, b)
    if n % 2:  # an odd count's last high nibble is 0
        assert codes[0][-1] >> 4 == 0 and codes[1][-1] >> 4 == 0
    dm, dv = mo.decode_moments4(*codes, n)
    rm, rv = mo.decode_reference4(*ref, n)
    assert torch.equal(dm, rm) and torch.equal(dv, rv)
    again = _encode4(dm, dv)  # encode(decode(codes)) == codes: an exact resume
    for a, b in zip(again, codes):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", ODD_SIZES)
def test_codec4_error_within_the_derived_bound(n):
    m, v = _moments(n, seed=n + 1)
    mc, uc, sm, su = _encode4(m, v)
    dm, dv = mo.decode_moments4(mc, uc, sm, su, n)
    s = _per_element(sm, n, mo.Q4BLOCK)
    bound = torch.maximum(m.abs() / 3, 1.5 * 2.0**-7 * s) * (1 + 2 * ULP)
    assert ((dm - m).abs() <= bound).all()
    u, du = v.double().sqrt(), dv.double().sqrt()
    su_ = _per_element(su, n, mo.Q4BLOCK).double()
    bound_u = torch.maximum(u / 4, 1.25 * 2.0**-7 * su_) * (1 + 4 * ULP)
    assert ((du - u).abs() <= bound_u).all()
    if n > mo.Q4BLOCK:  # the bound is tight: some elements use most of it
        assert ((dm - m).abs() > 0.9 * bound).any()
        assert ((du - u).abs() > 0.7 * bound_u).any()
    blocks = m.abs().new_zeros(mo.n_blocks(n, mo.Q4BLOCK) * mo.Q4BLOCK)
    blocks[:n] = m.abs()
    assert torch.equal(sm, blocks.view(-1, mo.Q4BLOCK).amax(1))


def test_codec4_signs_and_nibble_order():
    """Element 2j in the low nibble of byte j; the sign bit 8 of an exp_avg code; a block's
    largest element exact; 0.5 and -0.25 of it exact (powers of two)."""
    n = mo.Q4BLOCK
    m = torch.zeros(n)
    m[0], m[1], m[2] = 1.0, -0.5, 0.25
    v = torch.zeros(n)
    v[0], v[3] = 4.0, 2.25  # u: 2 (the scale), 1.5 = 0.75 of it: 1.5 x 2^-1, exact
    mc, uc, sm, su = _encode4(m, v)
    assert (mc[0].item(), mc[1].item()) == (7 | (8 | 6) << 4, 5)
    assert (uc[0].item() & 15, uc[1].item() >> 4) == (14, 13)
    dm, dv = mo.decode_moments4(mc, uc, sm, su, n)
    assert torch.equal(dm, m) and torch.equal(dv, v)


def _int8_state(n, seed):
    return _coded(n, seed, "int8")


def _grad(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-4, 0, generator=gen)
            ).to(dtype)


def _step(fn, state, grad, out, *, step=3, **kw):
    p, mc, uc, sm, su = state
    fn(p, grad, mc, uc, step=step, lr=1e-3, weight_decay=0.01, out16=out, scales=(sm, su),
       **HP, **kw)


@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
def test_coded_kernel_bitwise_equals_reference(n, grad_dtype, adamw_mode, state_dtype):
    state = _coded(n, n, state_dtype)
    grad = _grad(n, grad_dtype, seed=n + 7)
    ref = [t.clone() for t in state]
    out, out_ref = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    _step(ca.adam_update, state, grad, out, adamw_mode=adamw_mode, state_dtype=state_dtype)
    _step(ca.adam_update_reference, ref, grad, out_ref, adamw_mode=adamw_mode,
          state_dtype=state_dtype)
    for a, b in zip([*state, out], [*ref, out_ref]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "int4"])
def test_variants_threads_and_block_splits_are_bitwise_equal(variant, state_dtype):
    """Every variant (on an AVX-512 machine avx512bf16 and native too: int4 has no fused
    path and runs the portable body each one compiles) equals generic for any thread count
    and split on blocks."""
    n = 100_003
    grad = _grad(n, torch.bfloat16, seed=1)
    fmt = mo.FORMATS[state_dtype]

    def run(threads, splits, variant):
        if state_dtype == "bf16":
            p, m, v = _int8_state(n, seed=2)[0], *_moments(n, seed=3)
            state = [p, m.to(torch.bfloat16), v.to(torch.bfloat16)]
        else:
            state = _coded(n, 2, state_dtype)
        g = grad.clone()
        for lo, hi in zip(splits, splits[1:]):
            sl = [state[0][lo:hi], fmt.part(state[1], lo, hi), fmt.part(state[2], lo, hi)]
            scales = None if state_dtype == "bf16" else \
                (state[3][lo // fmt.block:], state[4][lo // fmt.block:])
            if scales is not None:  # the kernel's contract: a split starts on a block
                scales = tuple(s[:fmt.n_scales(hi - lo)] for s in scales)
            ca._update(*sl[:1], g[lo:hi], *sl[1:], step=5, lr=1e-3, weight_decay=0.01,
                       out16=g[lo:hi], num_threads=threads, variant=variant, scales=scales,
                       state_dtype=state_dtype, **HP)  # the output over the grads, as the engine
        return [*state, g]

    base = run(1, [0, n], "generic")
    for threads, splits in [(2, [0, n]), (3, [0, n]), (2, [0, 40 * mo.QBLOCK, n]),
                            (1, [0, mo.QBLOCK, 7 * mo.QBLOCK, n]),
                            (2, [0, 3 * mo.Q4BLOCK, n])]:
        if state_dtype == "int8" and splits[1] % mo.QBLOCK:
            continue
        for a, b in zip(run(threads, splits, variant), base):
            assert torch.equal(a, b), (threads, splits)


def _specials(n, gen):
    """fp32 values with NaN (both signs; payloads whose low half would carry in an integer
    bf16 rounding), inf, subnormals, zeros and exact bf16 ties among random ones: the fast
    paths' fallbacks and rounding corners."""
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
    x = torch.randn(n, generator=gen)
    hard = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, 0x7FC0FFFF, -0x3F0001, 0x7F800000,
                         -0x800000, 1, -0x7FFFFFFF, 0, -0x80000000, 0x3F808000, 0x3F818000,
                         -0x40000000 | 0x8000], dtype=torch.int32).view(torch.float32)
    pick = torch.randint(0, 40, (n,), generator=gen)
    x = torch.where(pick < hard.numel(), hard[pick.clamp(max=hard.numel() - 1)], x)
    return torch.where(pick == 39, bits.view(torch.float32), x)


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "int4"])
def test_special_values_bitwise_equal_to_generic(variant, state_dtype):
    """The fused paths' fallbacks (a NaN among 16 bf16 lanes; an int8 block with a NaN,
    negative or infinite scale, or inf / NaN in its new moments; any code byte) give the
    portable C's bits, with the output over the grads and apart from them.  At most one input
    of an element is special: where two different NaNs meet, which one an FMA or a product
    passes on depends on the operand order the compiler picked, in any variant.  So the codes
    of a block whose new scale is NaN are not compared: its encode multiplies NaN sqrt(v) by
    1/NaN (portable build, avx2 against generic: 0 or the top code); every code there decodes
    to NaN anyway."""
    n = 40 * mo.QBLOCK + 48  # the last block: 48 elements, a multiple of 16, not of 32
    gen = torch.Generator().manual_seed(21)
    fmt = mo.FORMATS[state_dtype]
    blk = torch.arange(n) // fmt.block
    streams = 4 if state_dtype == "bf16" else 2  # p, g (, m, v) get special values
    which = torch.where(blk % 4 == 2, torch.randint(0, streams, (n,), generator=gen), -1)

    def value(k, normal):
        return torch.where(which == k, _specials(n, gen), normal)

    p = value(0, torch.randn(n, generator=gen))
    g = value(1, torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
    if state_dtype == "bf16":
        m = value(2, torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
        v = value(3, torch.rand(n, generator=gen) * 1e-6).to(torch.bfloat16)
        state, scales = [p, m, v], False
    else:  # odd blocks: special scales (their p and g are plain), any code bytes everywhere
        mc = torch.randint(0, 256, (fmt.storage(n),), generator=gen, dtype=torch.uint8)
        uc = torch.randint(0, 256, (fmt.storage(n),), generator=gen, dtype=torch.uint8)
        nb = fmt.n_scales(n)
        sm, su = torch.rand(nb, generator=gen) * 1e-2, torch.rand(nb, generator=gen) * 1e-3
        for sc in (sm, su):
            sc[1::8], sc[3::8], sc[5::8] = float("nan"), float("inf"), 0.0
            sc[7::16], sc[15::16] = -1e-2, 2.0**-126
        state, scales = [p, mc, uc, sm, su], True
    for separate in (False, True):
        runs = []
        for var in ("generic", variant):
            st = [t.clone() for t in state]
            grad = g.clone()
            out = torch.empty(n, dtype=torch.bfloat16) if separate else grad
            kw = dict(scales=(st[3], st[4])) if scales else {}
            ca._update(st[0], grad, st[1], st[2], step=4, lr=1e-3, weight_decay=0.01,
                       out16=out, variant=var, state_dtype=state_dtype, **HP, **kw)
            if scales:  # the codes of a NaN block: see the docstring
                for codes, sc in ((st[1], st[3]), (st[2], st[4])):
                    for b in sc.isnan().nonzero().flatten().tolist():
                        fmt.part(codes, b * fmt.block, (b + 1) * fmt.block).zero_()
            runs.append([t.view(torch.uint8) for t in (*st, out)])
        for a, b in zip(*runs):
            assert torch.equal(a, b), (state_dtype, separate)


def test_bf16_state_matches_reference_within_one_rounding():
    n = 4097
    p = torch.randn(n)
    m, _ = _moments(n, seed=4)
    m = m.clamp(-1, 1)
    # a state Adam could reach (|m| <= sqrt(v)): the update stays <= 3.2 lr, as in
    # test_adam_kernels.py, whose tolerance this is
    v = (m * m * (1 + torch.rand(n))).to(torch.bfloat16)
    m = m.to(torch.bfloat16)
    grad = _grad(n, torch.bfloat16, seed=5)
    ours, ref = [p.clone(), m.clone(), v.clone()], [p.clone(), m.clone(), v.clone()]
    ca.adam_update(ours[0], grad, ours[1], ours[2], step=3, lr=1e-3, weight_decay=0.01, **HP)
    ca.adam_update_reference(ref[0], grad, ref[1], ref[2], step=3, lr=1e-3, weight_decay=0.01,
                             **HP)
    torch.testing.assert_close(ours[0], ref[0], atol=2e-6 * 1e-3, rtol=1e-6)
    for a, b in zip(ours[1:], ref[1:]):  # the fp32 values differ by ulps: one bf16 step at most
        assert ((a.float() - b.float()).abs() <= 2.0**-8 * b.float().abs()).all()


@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
def test_ratio_cap_bounds_an_update_whose_sqrt_v_was_flushed(state_dtype):
    """A block holding one element with a huge second moment: the others' sqrt(v) are far
    below its 15 binades and decode to 0, while their first moments (in their own block
    ranges) survive. Uncapped, their update would be lr * m / eps ~ 1e5 lr; capped, it is at
    most exact Adam's worst case lr * R * sqrt(bc2) / bc1."""
    fmt = mo.FORMATS[state_dtype]
    n, lr, step = fmt.block, 1e-3, 10
    m = torch.full((n,), 1e-3)
    v = torch.full((n,), 1e-14)  # sqrt: 1e-7, 2^-33 of the huge element's 1e3: flushed
    v[0] = 1e6
    p, mc, uc, sm, su = torch.zeros(n), *(_encode if state_dtype == "int8" else _encode4)(m, v)
    assert (fmt.decode(mc, uc, (sm, su), 0, n)[1][1:] == 0).all()
    ca.adam_update(p, torch.zeros(n), mc, uc, step=step, lr=lr, weight_decay=0.0,
                   scales=(sm, su), state_dtype=state_dtype, **HP)
    r = mo.ratio_cap(HP["beta1"], HP["beta2"])
    bound = lr * r * math.sqrt(1 - HP["beta2"]**step) / (1 - HP["beta1"]**step)
    assert (p.abs() <= bound * (1 + 1e-5)).all()
    assert (p[1:].abs() >= 0.99 * bound).all()  # the cap is what bound them


def test_ratio_cap_is_exact_adams_bound():
    """No gradient sequence lets exact (fp64) Adam exceed R: the adversarial one, which
    makes Cauchy-Schwarz tight (g_{t-k} proportional to (b1/b2)^k), approaches it."""
    b1, b2 = HP["beta1"], HP["beta2"]
    r = mo.ratio_cap(b1, b2)
    t = 3000
    g = torch.tensor([(b1 / b2) ** (t - 1 - i) for i in range(t)], dtype=torch.float64)
    m = v = 0.0
    worst = 0.0
    for x in g.tolist():
        m, v = b1 * m + (1 - b1) * x, b2 * v + (1 - b2) * x * x
        worst = max(worst, abs(m) / math.sqrt(v))
    assert 0.95 * r < worst <= r * (1 + 1e-12)  # reached, to fp64 rounding
    for seq in (torch.randn(500, dtype=torch.float64), torch.ones(500, dtype=torch.float64)):
        m = v = 0.0
        for x in seq.tolist():
            m, v = b1 * m + (1 - b1) * x, b2 * v + (1 - b2) * x * x
            assert abs(m) <= r * math.sqrt(v) * (1 + 1e-12)


@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
def test_coded_moments_refuse_betas_without_the_bound(state_dtype):
    state = _coded(mo.QBLOCK, 0, state_dtype)
    with pytest.raises(ValueError, match=rf"state_dtype='{state_dtype}' needs beta1\*\*2 < beta2"):
        ca.adam_update(state[0], torch.zeros(mo.QBLOCK), state[1], state[2], step=1, lr=1e-3,
                       beta1=0.99, beta2=0.95, eps=1e-8, weight_decay=0.0,
                       scales=(state[3], state[4]), state_dtype=state_dtype)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "int4"])
def test_100_steps_each_within_its_bound_of_fp64_adam(state_dtype):
    """Each step from the stored (decoded) moments: the new param equals fp64 Adam on the
    same inputs to fp32 rounding, and the stored moments are fp64's within the code's bound."""
    n, lr, wd = 3 * mo.QBLOCK + 5, 1e-3, 0.01
    b1, b2, eps = HP["beta1"], HP["beta2"], HP["eps"]
    gen = torch.Generator().manual_seed(9)
    p = torch.randn(n, generator=gen)
    if state_dtype == "int8":
        st = list(_encode(torch.zeros(n), torch.zeros(n)))
        decode = lambda: mo.decode_moments(*st)  # noqa: E731
        kw = lambda: dict(scales=(st[2], st[3]))  # noqa: E731
    elif state_dtype == "int4":
        st = list(_encode4(torch.zeros(n), torch.zeros(n)))
        decode = lambda: mo.decode_moments4(*st, n)  # noqa: E731
        kw = lambda: dict(scales=(st[2], st[3]), state_dtype="int4")  # noqa: E731
    else:
        st = [torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
        decode = lambda: (st[0].float(), st[1].float())  # noqa: E731
        kw = lambda: {}  # noqa: E731
    for step in range(1, 101):
        g = torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-3, 0, generator=gen)
        m0, v0 = (t.double() for t in decode())
        p0 = p.double()
        ca.adam_update(p, g, st[0], st[1], step=step, lr=lr, weight_decay=wd, **HP, **kw())
        gd = g.double()
        m1 = b1 * m0 + (1 - b1) * gd
        v1 = b2 * v0 + (1 - b2) * gd * gd
        # the ratio cap (it binds on 4-bit moments: a flushed sqrt(v) beside a kept m)
        r = mo.ratio_cap(b1, b2)
        u1 = (m1 / (1 - b1**step)) / (torch.maximum(v1.sqrt(), m1.abs() / r)
                                      / math.sqrt(1 - b2**step) + eps)
        p1 = p0 * (1 - lr * wd) - lr * u1
        # fp32 arithmetic: a few ulps of the update (|u| <= R) and of p
        assert ((p.double() - p1).abs() <= 8 * ULP * (lr * u1.abs() + p1.abs()) + 1e-12).all()
        dm, dv = (t.double() for t in decode())
        if state_dtype == "bf16":
            assert ((dm - m1).abs() <= 2.0**-8 * m1.abs()).all()
            assert ((dv - v1).abs() <= 2.0**-8 * v1.abs()).all()
        elif state_dtype == "int4":
            sm = _per_element(st[2], n, mo.Q4BLOCK).double()
            su = _per_element(st[3], n, mo.Q4BLOCK).double()
            assert ((dm - m1).abs() <= torch.maximum(m1.abs() / 3, 1.5 * 2.0**-7 * sm)
                    * (1 + 1e-5)).all()
            u, du = v1.sqrt(), dv.sqrt()
            assert ((du - u).abs() <= torch.maximum(u / 4, 1.25 * 2.0**-7 * su)
                    * (1 + 1e-5)).all()
        else:
            sm = _per_element(st[2], n).double()
            su = _per_element(st[3], n).double()
            assert ((dm - m1).abs() <= torch.maximum(2.0**-4 * m1.abs(), 1.0625 * 2.0**-15 * sm)
                    * (1 + 1e-5)).all()
            u, du = v1.sqrt(), dv.sqrt()
            assert ((du - u).abs() <= torch.maximum(2.0**-5 * u, 1.03125 * 2.0**-15 * su)
                    * (1 + 1e-5)).all()


def _params(sizes, block):
    """Offsets of params of these sizes laid out as the engine lays them: each on a block, the
    gap to the next block after it; and the buffer's length."""
    offs, end = [], 0
    for n in sizes:
        offs.append(end)
        end += -(-n // block) * block
    return offs, end


Q4_SIZES = [1, 127, 128, 129, 4097, 49_153, 33]  # 49_153: three threads' chunks (16K each)
# (grad dtype, out16, adamw_mode): out over the grads as the engine writes it, apart, none
GRAD_OUT = [(torch.bfloat16, "grad", True), (torch.float16, "grad", True),
            (torch.float32, torch.float16, True), (torch.float32, None, True),
            (torch.bfloat16, torch.bfloat16, False), (torch.float16, "grad", False)]


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("grad_dtype,out,adamw_mode", GRAD_OUT)
def test_int4_fused_equals_portable_and_reference(variant, grad_dtype, out, adamw_mode):
    """The fused 4-bit pass (adam_q4_fused.h, adam_coded_fused.h: every variant but generic)
    against the portable C body (generic) and the torch reference, bit for bit: params of odd
    sizes, each on a block with the gap after it, updated one call per param (1 and 3
    threads) and in one call over them all (gaps included; 2 threads), two steps (the second
    decodes the codes the first encoded).  The reference (0.9 s a call on the 49K-element
    param) runs on the others."""
    fmt = mo.FORMATS["int4"]
    offs, total = _params(Q4_SIZES, fmt.block)
    grads = []
    for step in range(2):
        g = torch.zeros(total, dtype=grad_dtype)
        for o, n in zip(offs, Q4_SIZES):
            g[o:o + n] = _grad(n, grad_dtype, seed=o + step)
        grads.append(g)

    per_param = list(zip(offs, Q4_SIZES))
    start = _coded(total, 5, "int4")

    def run(fn, spans, **kw):
        state = [t.clone() for t in start]
        outs = []
        for step, g0 in enumerate(grads, 3):
            g = g0.clone()
            o16 = g if out == "grad" else None if out is None else torch.zeros(total, dtype=out)
            for o, n in spans:
                fn(state[0][o:o + n], g[o:o + n], fmt.part(state[1], o, o + n),
                   fmt.part(state[2], o, o + n), step=step, lr=1e-3, weight_decay=0.01,
                   adamw_mode=adamw_mode, out16=None if o16 is None else o16[o:o + n],
                   scales=tuple(s[o // fmt.block:][:fmt.n_scales(n)] for s in state[3:]),
                   state_dtype="int4", **HP, **kw)
            outs += [] if o16 is None else [o16]
        return [t.view(torch.uint8) for t in (*state, *outs)]

    def check(got, want, what):
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (what, i)

    small = [span for span in per_param if span[1] < 16384]
    check(run(ca.adam_update_reference, small),
          run(ca._update, small, variant=variant, num_threads=1), "reference")
    base = run(ca._update, per_param, variant="generic", num_threads=1)
    whole = run(ca._update, [(0, total)], variant="generic", num_threads=1)
    for threads, spans, want in ((1, per_param, base), (3, per_param, base),
                                 (2, [(0, total)], whole)):
        check(run(ca._update, spans, variant=variant, num_threads=threads), want, threads)
