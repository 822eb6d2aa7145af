"""The compiled undo of an fp32 CPU-Adam step against its torch float64 reference: bit for bit
(the same arithmetic, hf_zoffload/ops/adam_undo.py; a NaN as a NaN), for every grad dtype,
size, split, thread count and variant, at Adam step 1 and later, on special values; and the
undo of a step within `inverse.undo_bound` of the state before it (the bound's derivation:
docs/protocols/step.md, "The correction bound")."""

from types import SimpleNamespace

import pytest
import torch

from hf_zoffload.offload.schedules import inverse
from hf_zoffload.offload.update import Run, Work
from hf_zoffload.ops import adam_kernels as ca
from hf_zoffload.ops import adam_undo as au

SIZES = [1, 7, 33, 4097, 1_000_003]
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
VARIANTS = [v for v in ("native", "avx2", "avx512bf16") if ca._ext().variant_available(
    ca._ext().VARIANTS[v])]

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _stepped(n, dtype, step, seed=0, gs=1.0):
    """(state before, state after one adam_update step, grad): fp32 [p, m, v] lists."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.01
    v = m * m * (1 + torch.rand(n, generator=gen))
    if step == 1:
        m.zero_()
        v.zero_()
    # magnitudes from 1e-5 to 1: eps, the bias corrections and the 16-bit grads' ranges
    g = (torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-5, 0, generator=gen))
    g = g.to(dtype)
    before = [p, m, v]
    after = [t.clone() for t in before]
    ca.adam_update(after[0], g, after[1], after[2], step=step, grad_scale=gs, **HP)
    return before, after, g


def _equal(a, b):
    """Bit for bit, except that a NaN is matched as a NaN: torch's subtraction is an FMA,
    p + (-1) q, whose NaN is q's where both are NaN; the pass's p - q keeps p's (x86 takes
    the first operand's)."""
    for x, y in zip(a, b):
        nan = x.isnan()
        assert torch.equal(nan, y.isnan())
        x, y = x.view(torch.int32)[~nan], y.view(torch.int32)[~nan]
        assert torch.equal(x, y), int((x != y).sum())


def _undone(state, g, *, step, fn=au.adam_undo, **kw):
    p, m, v = (t.clone() for t in state)
    fn(p, g, m, v, step=step, **HP, **kw)
    return [p, m, v]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("step", [1, 5])
def test_bitwise_the_reference(n, dtype, step):
    _, after, g = _stepped(n, dtype, step, gs=0.5)
    ref = _undone(after, g, step=step, fn=au.adam_undo_reference, grad_scale=0.5)
    for threads in (1, 2, 3):
        _equal(_undone(after, g, step=step, grad_scale=0.5, num_threads=threads), ref)


@pytest.mark.parametrize("variant", ["generic", *VARIANTS])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
def test_variants_bitwise_the_reference_at_any_offset(variant, dtype):
    """Offset 5: the buffers start off a vector boundary (prologue and tail: scalar code)."""
    n = 300_007
    _, after, g = _stepped(n, dtype, 3)
    if dtype == torch.float16:  # every finite half bit pattern
        h = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
        g[:63488] = h[h.isfinite()]
    ref = _undone([t[5:] for t in after], g[5:], step=3, fn=au.adam_undo_reference)
    got = [t[5:].clone() for t in after]
    au._undo(got[0], g[5:], got[1], got[2], step=3, variant=variant, num_threads=2, **HP)
    _equal(got, ref)


def test_any_split_is_the_whole():
    n = 100_003
    _, after, g = _stepped(n, torch.bfloat16, 4)
    whole = _undone(after, g, step=4)
    parts = [t.clone() for t in after]
    for lo, hi in ((0, 17), (17, 50_001), (50_001, n)):
        au.adam_undo(parts[0][lo:hi], g[lo:hi], parts[1][lo:hi], parts[2][lo:hi], step=4,
                     **HP)
    _equal(parts, whole)


def test_special_values():
    """Zero grads, zero and subnormal v, huge masters and moments, v driven below zero (the
    clamp), -0, inf and NaN in the state (v of either sign: the clamp keeps -0 and NaN, as
    torch's): the same bits as the reference, NaN as NaN."""
    tiny, big = 1e-45, 3e38
    specials = torch.tensor([0.0, -0.0, tiny, -tiny, 1e-38, big, -big, float("inf"),
                             -float("inf"), float("nan"), 1.0, -1.0])
    k = specials.numel()
    p = specials.repeat_interleave(k * k)
    m = specials.repeat(k).repeat_interleave(k)
    v = specials.repeat(k * k)  # -0, negative and NaN too: the clamp's every case
    n = p.numel()
    gen = torch.Generator().manual_seed(3)
    for dtype in GRAD_DTYPES:
        g = torch.randn(n, generator=gen).to(dtype)
        g[::5] = 0  # zero grads (5: coprime to the 12 specials, so every v meets one)
        g[1::7] = 1e4 if dtype != torch.float16 else 6e4  # v1 - fl(w2 g) g < 0: clamped
        for step in (1, 2):
            ref = _undone([p, m, v], g, step=step, fn=au.adam_undo_reference)
            for threads in (1, 2):
                _equal(_undone([p, m, v], g, step=step, num_threads=threads), ref)
    assert (ref[2] == 0).any() and ref[2].isnan().any() and ref[2].signbit().any()


@pytest.mark.parametrize("step", [1, 4])
def test_undo_of_a_step_within_the_undo_bound(step):
    before, after, g = _stepped(200_003, torch.bfloat16, step, gs=0.25)
    got = _undone(after, g, step=step, grad_scale=0.25)
    k = au.undo_coefficients(step, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"],
                             HP["weight_decay"], 0.25)
    prev = dict(zip("pmv", (t.double() for t in before)))
    spec = dict(zip("pmv", (t.double() for t in after)))
    lim = inverse.undo_bound(prev, spec, g.double() * 0.25, k)
    for key, t in zip("pmv", got):
        err = (t.double() - prev[key]).abs()
        assert (err <= lim[key] + 1e-45).all(), (key, float((err - lim[key]).max()))
    if step == 1:
        assert not got[1].any() and not got[2].any()


def test_inverse_undo_is_its_reference_over_runs():
    """The schedule's entry point: one call per run, each with its own step and grad_scale."""
    n = 50_000
    state = SimpleNamespace(master=torch.randn(n), exp_avg=torch.randn(n) * 1e-2,
                            exp_avg_sq=torch.rand(n) * 1e-4)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    runs = [Run(0, 20_000, 1, hyper, 0.5), Run(20_000, 20_001, 3, hyper, 1.0),
            Run(30_000, n, 7, dict(hyper, lr=3e-4), 2.0)]
    grad = torch.randn(n).to(torch.bfloat16)
    copies = []
    for fn in (inverse.undo, inverse.undo_reference):
        s = SimpleNamespace(**{k: v.clone() for k, v in vars(state).items()})
        fn(Work(SimpleNamespace(state=s), grad, runs, None, [], ()))
        copies.append([s.master, s.exp_avg, s.exp_avg_sq])
    _equal(*copies)
    assert torch.equal(copies[0][0][20_001:30_000], state.master[20_001:30_000])  # no run


BAD = [
    ("master", torch.zeros(8, dtype=torch.bfloat16), TypeError, "master"),
    ("master", torch.zeros(16)[::2], ValueError, "master"),
    ("grad", torch.zeros(8, dtype=torch.int32), TypeError, "grad"),
    ("grad", torch.zeros(9), ValueError, "grad"),
    ("exp_avg", torch.zeros(8, dtype=torch.bfloat16), TypeError, "exp_avg"),
    ("exp_avg_sq", torch.zeros(7), ValueError, "exp_avg_sq"),
    ("exp_avg_sq", torch.zeros(2, 4), ValueError, "exp_avg_sq"),
    ("step", 0, ValueError, "step"),
    ("step", True, ValueError, "step"),
    ("lr", float("nan"), ValueError, "lr"),
    ("beta1", 1.0, ValueError, "beta1"),
    ("beta2", -0.1, ValueError, "beta2"),
    ("eps", -1e-8, ValueError, "eps"),
    ("weight_decay", -0.01, ValueError, "weight_decay"),
    ("grad_scale", float("inf"), ValueError, "grad_scale"),
    ("num_threads", 0, ValueError, "num_threads"),
]


@pytest.mark.parametrize("fn", [au.adam_undo, au.adam_undo_reference])
@pytest.mark.parametrize("field, value, exc, text", BAD, ids=lambda x: str(x)[:20])
def test_bad_input_raises_before_any_work(fn, field, value, exc, text):
    bufs = {k: torch.full((8,), 0.5) for k in ("master", "grad", "exp_avg", "exp_avg_sq")}
    kw = dict(step=2, **HP)
    if field in bufs:
        bufs[field] = value
    else:
        kw[field] = value
    before = [t.clone() for t in bufs.values()]
    with pytest.raises(exc, match=text):
        fn(bufs["master"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"], **kw)
    for b, t in zip(before, bufs.values()):
        if t.dtype == b.dtype and t.shape == b.shape:
            assert torch.equal(b, t)


def test_overlapping_buffers_rejected():
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="overlap"):
        au.adam_undo(buf[:8], buf[4:12], torch.zeros(8), torch.zeros(8), step=2, **HP)


def test_unknown_variant_rejected():
    z = [torch.zeros(8) for _ in range(4)]
    with pytest.raises(ValueError, match="variant"):
        au._undo(*z, step=2, variant="sse9", **HP)
