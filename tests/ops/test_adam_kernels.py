"""The compiled one-pass CPU-Adam against its torch reference and torch.optim.Adam/AdamW.

Tolerance (master params), stated once and used everywhere:
    |ours - torch| <= 2e-6 * lr_max * steps + 1e-6 * steps * |torch|
Why: the kernel evaluates torch's own op sequence with the same fp32 roundings and FMAs (m and v
come out bit-equal in AdamW mode) except in the denominator sqrt(v) / sqrt(bc2) + eps: torch's
vectorized sqrt is not correctly rounded (measured on torch 2.13/AVX2: ~20% of results 1 ulp
off), and the kernel multiplies by 1/sqrt(bc2) instead of dividing.  The two denominators differ
by <= 3.5 ulp, so the update u differs by <= ~4.5 ulp of |u| <= lr * (1-b1)/sqrt(1-b2) = 3.2 lr:
<= 1.7e-6 lr per step, and p + u may round the other way (1 ulp of p = 1.2e-7 relative); both
may add up over the steps.  Measured worst case over 200k elements: 2.3e-7 * lr beyond the rtol
term after one step, 4e-9 * lr * steps after 100 steps -- 9x and more inside.  The grad dtype
adds nothing (fp16/bf16 -> fp32 widening is exact), hence the equal (dtype, atol, rtol) rows.
exp_avg/exp_avg_sq differ only through the L2 term (Adam mode); b1, b2 < 1 damp that
difference, so they get a steps-free bound relative to the largest gradient.
"""

import threading
import time

import pytest
import torch

from hf_zoffload.ops import adam_kernels as ca

SIZES = [1, 7, 22, 4097, 1_000_003]
GRAD_DTYPES = [  # (grad dtype, atol per unit of lr per step, rtol per step): see module doc
    (torch.float32, 2e-6, 1e-6),
    (torch.float16, 2e-6, 1e-6),
    (torch.bfloat16, 2e-6, 1e-6),
]
HP = dict(beta1=0.9, beta2=0.999, eps=1e-8)
VARIANTS = [v for v in ("native", "avx2", "avx512bf16") if ca._ext().variant_available(
    ca._ext().VARIANTS[v])]


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _state(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    # a state Adam could have reached: |m| <= sqrt(v), so |update| <= 3.2 lr as the bound assumes
    v = m * m * (1 + torch.rand(n, generator=gen))
    return [p, m, v]


def _grad(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # magnitudes from 1e-4 to 10: exercises eps, the bias corrections and the 16-bit grads
    g = torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-4, 1, generator=gen)
    return g.to(dtype)


def _assert_close(ours, ref, *, lr_max, steps, atol, rtol, gmax):
    p, m, v = ours
    torch.testing.assert_close(p, ref[0], atol=atol * lr_max * steps, rtol=rtol * steps)
    torch.testing.assert_close(m, ref[1], atol=1e-5 * gmax, rtol=1e-5)
    torch.testing.assert_close(v, ref[2], atol=1e-5 * gmax**2, rtol=1e-5)


def _bits(t):
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype, atol, rtol", GRAD_DTYPES)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_one_step_matches_reference(n, dtype, atol, rtol, adamw_mode, weight_decay,
                                    bias_correction):
    ours, ref = _state(n), _state(n)
    g = _grad(n, dtype, seed=1)
    kw = dict(step=3, lr=2e-3, weight_decay=weight_decay, grad_scale=0.5, adamw_mode=adamw_mode,
              bias_correction=bias_correction, **HP)
    ca.adam_update(*ours[:1], g, *ours[1:], **kw)
    ca.adam_update_reference(*ref[:1], g, *ref[1:], **kw)
    gmax = g.float().abs().max().item() * 0.5
    _assert_close(ours, ref, lr_max=2e-3, steps=1, atol=atol, rtol=rtol, gmax=gmax)


@pytest.mark.parametrize("n", [7, 4097])
@pytest.mark.parametrize("dtype, atol, rtol", GRAD_DTYPES)
@pytest.mark.parametrize("adamw_mode, weight_decay", [(True, 0.01), (False, 0.05), (True, 0.0)])
def test_100_steps_changing_lr_match_torch_optim(n, dtype, atol, rtol, adamw_mode, weight_decay):
    p0 = _state(n)[0]
    ours = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    param = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls([param], lr=1e-3, betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
              weight_decay=weight_decay)
    lrs = [1e-3 * (1 + (s % 7)) for s in range(1, 101)]  # a schedule with jumps both ways
    gmax = 0.0
    for s, lr in enumerate(lrs, start=1):
        g = _grad(n, dtype, seed=s)
        gmax = max(gmax, g.float().abs().max().item())
        ca.adam_update(ours[0], g, ours[1], ours[2], step=s, lr=lr, weight_decay=weight_decay,
                       adamw_mode=adamw_mode, **HP)
        opt.param_groups[0]["lr"] = lr
        param.grad = g.float()
        opt.step()
    st = opt.state[param]
    ref = [param.detach(), st["exp_avg"], st["exp_avg_sq"]]
    _assert_close(ours, ref, lr_max=max(lrs), steps=100, atol=atol, rtol=rtol, gmax=gmax)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 4097, 1_000_003])
def test_out16_equals_master_to_dtype(out_dtype, grad_dtype, n):
    p, m, v = _state(n)
    out = torch.empty(n, dtype=out_dtype)
    ca.adam_update(p, _grad(n, grad_dtype, 5), m, v, step=1, lr=1e-3, weight_decay=0.01,
                   out16=out, **HP)
    assert torch.equal(_bits(out), _bits(p.to(out_dtype)))


def _special_values():
    """fp32 masters at every hard spot of the fp16/bf16 rounding."""
    f32 = torch.float32
    halves = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)
    h = halves.to(f32)
    ties16 = ((h[:-1].double() + h[1:].double()) / 2).to(f32)  # exact midpoints, both parities
    bf = torch.arange(0, 0x7F80, 7, dtype=torch.int32)
    ties_bf = ((bf << 16) | 0x8000).view(f32)
    near_bf = torch.cat([((bf << 16) | 0x7FFF).view(f32), ((bf << 16) | 0x8001).view(f32)])
    sub32 = torch.tensor([1, 2, 0x7FFF, 0x8000, 0x18000, 0x7FFFFF], dtype=torch.int32).view(f32)
    specials = torch.tensor([0.0, float("inf"), float("nan"), 65504.0, 65519.99, 65520.0,
                             3.4028234663852886e38, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25], dtype=f32)
    payload_nans = torch.tensor([0x7FA12345, 0x7F800001, 0x7FFFFFFF], dtype=torch.int32).view(f32)
    gen = torch.Generator().manual_seed(3)
    rnd = torch.randint(-(2**31), 2**31 - 1, (200_003,), generator=gen, dtype=torch.int32)
    x = torch.cat([h, ties16, ties_bf, near_bf, sub32, specials, payload_nans, rnd.view(f32)])
    return torch.cat([x, -x])


@pytest.mark.parametrize("variant", ["auto", "generic"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_out16_rounding_ties_subnormals_inf_nan(variant, out_dtype):
    master = _special_values()
    n = master.numel()
    expect = master.clone()
    out = torch.empty(n, dtype=out_dtype)
    # lr = 0, wd = 0, zero grads: master comes back bit for bit (NaN quieted, as torch's mul_)
    ca._update(master, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0,
               weight_decay=0.0, out16=out, variant=variant, **HP)
    nan = expect.isnan()
    assert torch.equal(_bits(out)[~nan], _bits(expect.to(out_dtype))[~nan])
    assert out.isnan().equal(nan)
    # NaN keeps its sign and top payload bits and is quiet (F16C / vcvtneps2bf16 behaviour).
    u = expect.view(torch.int32)[nan]
    if out_dtype == torch.bfloat16:
        want = ((u >> 16) | 0x40) & 0xFFFF
    else:
        want = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)
    assert torch.equal(_bits(out)[nan], want)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_simd_variant_bit_equal_to_generic(variant, out_dtype, grad_dtype):
    n = 300_007
    a, b = _state(n), _state(n)
    g = _grad(n, grad_dtype, 9)
    if grad_dtype == torch.float16:  # every half bit pattern, NaN and inf included
        g[:65536] = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    outs = [torch.zeros(n, dtype=out_dtype) for _ in range(2)]
    for st, out, var in ((a, outs[0], variant), (b, outs[1], "generic")):
        # offset 5: the output is not 16-byte aligned, so the fast path starts with a prologue
        ca._update(st[0][5:], g[5:], st[1][5:], st[2][5:], step=2, lr=1e-3, weight_decay=0.01,
                   out16=out[5:], variant=var, **HP)
    for x, y in zip(a + outs[:1], b + outs[1:]):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_fp16_grads_widen_exactly():
    # beta1 = 0 makes exp_avg = grad bit for bit: every finite half must widen exactly.
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    h = h[h.isfinite()]
    n = h.numel()
    for variant in ["auto", "generic"]:
        m = torch.zeros(n)
        ca._update(torch.zeros(n), h, m, torch.zeros(n), step=1, lr=1e-3, beta1=0.0,
                   beta2=0.999, eps=1e-8, weight_decay=0.0, variant=variant)
        assert torch.equal(m.view(torch.int32), h.float().view(torch.int32))


def _run(n, threads, splits, out_dtype=torch.bfloat16):
    p, m, v = _state(n)
    g = _grad(n, torch.float16, 11)
    out = torch.empty(n, dtype=out_dtype)
    bounds = [0, *splits, n]
    for s in (1, 2):
        for lo, hi in zip(bounds, bounds[1:]):
            ca.adam_update(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step=s, lr=1e-3,
                           weight_decay=0.01, adamw_mode=False, out16=out[lo:hi],
                           num_threads=threads, **HP)
    return [p, m, v, out.view(torch.int16)]


def test_bitwise_1_vs_2_threads_and_any_split():
    n = 1_000_003
    base = _run(n, threads=1, splits=[])
    for threads, splits in ((2, []), (2, [333_331]), (1, [17, 500_001, 999_999])):
        for x, y in zip(base, _run(n, threads, splits)):
            assert torch.equal(x.view(torch.int32) if x.dtype == torch.float32 else x,
                               y.view(torch.int32) if y.dtype == torch.float32 else y)


def test_releases_the_gil():
    # Passes of ~75 ms: the scheduler can keep the polling thread off a core for ~13 ms on 2
    # shared cores (measured, with 8M params and ~25 ms passes), which is not the GIL.
    n = 24_000_000
    p, m, v = _state(n)
    g = torch.ones(n)
    spans = []

    def work():
        for s in range(1, 4):
            t0 = time.perf_counter()
            ca.adam_update(p, g, m, v, step=s, lr=1e-3, weight_decay=0.0, num_threads=1, **HP)
            spans.append(time.perf_counter() - t0)

    t = threading.Thread(target=work)
    last, gap = time.perf_counter(), 0.0
    t.start()
    while t.is_alive():
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    t.join()
    # Holding the GIL through a pass would freeze this loop for all of it.
    assert gap < 0.5 * min(spans), (gap, spans)


def test_features_report():
    assert set(ca.cpu_features()) == {"avx2", "avx512f", "f16c", "avx512_bf16"}
    feats = ca.compiled_features()
    assert feats["openmp"] == ca.openmp_available()
    assert all(isinstance(x, bool) for x in feats.values())
    for k in ("avx2", "avx512f", "f16c", "avx512_bf16"):
        assert not feats[k] or ca.cpu_features()[k]  # nothing compiled in that this CPU lacks


def _good(n=8):
    return dict(master=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))


BAD = [  # (field, value, exception, text in message)
    ("master", torch.zeros(8, dtype=torch.float64), TypeError, "master"),
    ("master", torch.zeros(8, device="meta"), ValueError, "master"),
    ("master", torch.zeros(16)[::2], ValueError, "master"),
    ("master", torch.zeros(2, 4), ValueError, "master"),
    ("master", [0.0] * 8, TypeError, "master"),
    ("grad", torch.zeros(8, dtype=torch.int32), TypeError, "grad"),
    ("grad", torch.zeros(9), ValueError, "grad"),
    ("grad", torch.zeros(16, dtype=torch.float16)[::2], ValueError, "grad"),
    ("exp_avg", torch.zeros(7), ValueError, "exp_avg"),
    ("exp_avg", torch.zeros(8, dtype=torch.bfloat16), TypeError, "exp_avg"),
    ("exp_avg_sq", torch.zeros(8, device="meta"), ValueError, "exp_avg_sq"),
    ("exp_avg_sq", torch.zeros(8).to_sparse(), TypeError, "exp_avg_sq"),
    ("out16", torch.zeros(8), TypeError, "out16"),
    ("out16", torch.zeros(9, dtype=torch.float16), ValueError, "out16"),
    ("step", 0, ValueError, "step"),
    ("step", 1.0, ValueError, "step"),
    ("step", True, ValueError, "step"),
    ("lr", -1e-3, ValueError, "lr"),
    ("lr", float("nan"), ValueError, "lr"),
    ("lr", "0.1", TypeError, "lr"),
    ("beta1", 1.0, ValueError, "beta1"),
    ("beta2", -0.1, ValueError, "beta2"),
    ("eps", -1e-8, ValueError, "eps"),
    ("weight_decay", -0.01, ValueError, "weight_decay"),
    ("grad_scale", float("inf"), ValueError, "grad_scale"),
    ("adamw_mode", 1, TypeError, "adamw_mode"),
    ("bias_correction", None, TypeError, "bias_correction"),
    ("num_threads", 0, ValueError, "num_threads"),
]


@pytest.mark.parametrize("fn", [ca.adam_update, ca.adam_update_reference])
@pytest.mark.parametrize("field, value, exc, text", BAD, ids=lambda x: str(x)[:20])
def test_bad_input_raises_before_any_work(fn, field, value, exc, text):
    bufs = {k: torch.full((8,), 0.5) for k in ("master", "grad", "exp_avg", "exp_avg_sq")}
    kw = dict(step=1, lr=1e-3, weight_decay=0.01, **HP)
    if field in bufs:
        bufs[field] = value
    else:
        kw[field] = value
    before = [t.clone() for t in bufs.values() if isinstance(t, torch.Tensor)]
    with pytest.raises(exc, match=text):
        fn(bufs["master"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"], **kw)
    for b, t in zip(before, [t for t in bufs.values() if isinstance(t, torch.Tensor)]):
        if t.device.type == "cpu" and t.layout == torch.strided and t.dtype == b.dtype:
            assert torch.equal(b, t)


def test_overlapping_buffers_rejected():
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="overlap"):
        ca.adam_update(buf[:8], torch.zeros(8), buf[4:12], torch.zeros(8), step=1, lr=1e-3,
                       weight_decay=0.0, **HP)


def test_unknown_variant_rejected():
    with pytest.raises(ValueError, match="variant"):
        ca._update(**_good(), step=1, lr=1e-3, weight_decay=0.0, variant="sse9", **HP)


@pytest.mark.parametrize("n", [1, 7, 4097, 100_003])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", sorted(ca._ext().TRAFFIC_KINDS))
@pytest.mark.parametrize("offsets", [(0, 0, 0), (3, 3, 3), (1, 0, 5)])
def test_traffic_passes_touch_every_element_once(n, threads, kind, offsets):
    """The benchmark's memory ceilings: each stream read and written once over the whole range,
    with the kernel's split across threads, every way of moving the bytes, the written streams
    starting off a 32-byte line together or apart (the streaming stores' alignment)."""
    ext = ca._ext()
    base = torch.arange(n, dtype=torch.float32)
    a, b, c = (torch.empty(n + 8)[o:o + n].copy_(base + k) for k, o in enumerate(offsets))
    d = base + 3
    ext.traffic_pass(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), n, threads,
                     ext.TRAFFIC_KINDS[kind])
    for t, k in ((a, 0), (b, 1), (c, 2)):
        assert torch.equal(t, base + k + (base + 3))
    assert torch.equal(d, base + 3)
    with pytest.raises(ValueError, match="traffic kind"):
        ext.traffic_pass(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), n, threads,
                         len(ext.TRAFFIC_KINDS))
    p, g = torch.zeros(n), torch.full((n,), 5, dtype=torch.int16)
    mc, uc = torch.full((n,), 254, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ext.traffic_pass_q8(p.data_ptr(), g.data_ptr(), mc.data_ptr(), uc.data_ptr(), n, threads)
    assert (p == 1).all() and (g == 6).all() and (mc == 255).all() and (uc == 1).all()


# ------------------------------------------------------------------ adam_update_many
def _llama_shapes(layers=3, h=40, inter=108, vocab=301):
    """A Llama's param list in miniature (embed, per layer two norms, q k v o with grouped k v,
    gate up down; final norm, head), odd sizes; an empty tensor among them."""
    shapes = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h,), (h, h), (h // 4, h), (h // 4, h), (h, h), (h,), (inter, h), (inter, h),
                   (h, inter)]
    return shapes + [(0,), (h,), (vocab, h)]


def _many_case(seed=0):
    """(params, grads, moments, steps, hypers): mixed grad dtypes, an AdamW and an Adam (L2)
    hyper set, steps differing between tensors (a param whose grad was None some steps)."""
    gen = torch.Generator().manual_seed(seed)
    adamw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                 adamw_mode=True, bias_correction=True)
    adam = dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1,
                adamw_mode=False, bias_correction=False)
    ps, gs, ms, vs, steps, hypers = [], [], [], [], [], []
    for i, shape in enumerate(_llama_shapes()):
        n = torch.Size(shape).numel()
        p, m, v = _state(n, seed=100 + i)
        ps.append(p.view(shape))
        ms.append(m.view(shape))
        vs.append(v.view(shape))
        gs.append(_grad(n, GRAD_DTYPES[i % 3][0], seed=200 + i).view(shape))
        steps.append(1 + int(torch.randint(0, 5, (), generator=gen)))
        hypers.append(adam if i % 4 == 1 else adamw)
    return ps, gs, ms, vs, steps, hypers


def _clones(ts):
    return [t.clone() for t in ts]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_bitwise_equal_to_one_call_per_tensor(threads):
    ps, gs, ms, vs, steps, hypers = _many_case()
    assert sum(p.numel() for p in ps) > 16384 * 3  # every thread count runs in parallel
    ref = [_clones(ps), _clones(ms), _clones(vs)]
    for p, g, m, v, s, h in zip(*ref[:1], gs, *ref[1:], steps, hypers):
        ca.adam_update(p.view(-1), g.view(-1), m.view(-1), v.view(-1), step=s, num_threads=1,
                       **h)
    ca.adam_update_many(ps, gs, ms, vs, steps=steps, hypers=hypers, num_threads=threads)
    for ours, theirs in zip((ps, ms, vs), ref):
        for a, b in zip(ours, theirs):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_many_variants_bitwise_equal_to_generic(variant):
    runs = []
    for var in ("generic", variant):
        ps, gs, ms, vs, steps, hypers = _many_case(seed=3)
        bufs = ca.many_buffers(ps, gs, ms, vs)
        ca.adam_update_many_unchecked(bufs, steps=steps, hypers=hypers, num_threads=2,
                                      variant=var)
        runs.append(ps + ms + vs)
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_many_matches_reference():
    ps, gs, ms, vs, steps, hypers = _many_case(seed=4)
    ref = [_clones(ps), _clones(ms), _clones(vs)]
    ca.adam_update_many(ps, gs, ms, vs, steps=steps, hypers=hypers, num_threads=2)
    for i, (g, s, h) in enumerate(zip(gs, steps, hypers)):
        want = [t[i].view(-1) for t in ref]
        ca.adam_update_reference(want[0], g.view(-1), want[1], want[2], step=s, **h)
        if g.numel():
            _assert_close([ps[i].view(-1), ms[i].view(-1), vs[i].view(-1)], want,
                          lr_max=h["lr"], steps=1, atol=2e-6, rtol=1e-6,
                          gmax=g.abs().max().item())


def _many_raises(args, exc, text):
    ps = args[0]
    before = [t.clone() for t in ps]
    with pytest.raises(exc, match=text):
        ca.adam_update_many(*args[:4], steps=args[4], hypers=args[5], num_threads=2)
    for a, b in zip(ps, before):
        assert torch.equal(a, b)


def test_many_rejects_overlap_before_any_work():
    ps, gs, ms, vs, steps, hypers = _many_case()
    flat = torch.zeros(100)
    _many_raises(([flat[:60], flat[50:]], [torch.zeros(60), torch.zeros(50)],
                  [torch.zeros(60), torch.zeros(50)], [torch.zeros(60), torch.zeros(50)],
                  [1, 1], hypers[:2]), ValueError, "param of tensor 0 and param of tensor 1")
    gs2 = list(gs)
    gs2[5] = ms[7].view(-1)[: gs[5].numel()].view(gs[5].shape)  # a grad inside a moment
    _many_raises((ps, gs2, ms, vs, steps, hypers), ValueError,
                 "grad of tensor 5 and exp_avg of tensor 7 overlap")


def test_many_grads_may_share_memory():
    ps, gs, ms, vs, steps, hypers = _many_case()
    flat = torch.randn(max(p.numel() for p in ps))  # every grad a view of one buffer
    gs = [flat[: p.numel()].view(p.shape) for p in ps]
    ref = [_clones(ps), _clones(ms), _clones(vs)]
    ca.adam_update_many(ps, gs, ms, vs, steps=steps, hypers=hypers, num_threads=2)
    for i, (g, s, h) in enumerate(zip(gs, steps, hypers)):
        ca.adam_update(ref[0][i].view(-1), g.reshape(-1), ref[1][i].view(-1), ref[2][i].view(-1),
                       step=s, **h)
        assert torch.equal(ps[i], ref[0][i])


@pytest.mark.parametrize("change, exc, text", [
    (lambda c: c[1].__setitem__(2, c[1][2].double()), TypeError, "grad of tensor 2 must be"),
    (lambda c: c[2].__setitem__(3, c[2][3][:-1]), ValueError, "exp_avg of tensor 3 has"),
    (lambda c: c[0].__setitem__(1, c[0][1].t() if c[0][1].dim() == 2 else c[0][1][::2]),
     ValueError, "param of tensor 1 must be a dense contiguous"),
    (lambda c: c[4].__setitem__(0, 0), ValueError, "step of tensor 0"),
    (lambda c: c[5].__setitem__(0, {**c[5][0], "lr": -1.0}), ValueError, "lr of tensor 0"),
    (lambda c: c[5].__setitem__(0, {"lr": 1e-3}), ValueError, "hypers of tensor 0"),
    (lambda c: c[4].pop(), ValueError, "steps has"),
])
def test_many_bad_input_raises_before_any_work(change, exc, text):
    case = list(_many_case())
    change(case)
    _many_raises(case, exc, text)


def _torch_bump(steps):
    torch._foreach_add_(steps, 1.0)
    return [int(c) for c in torch.stack(steps).tolist()]


@pytest.mark.parametrize("make", [
    lambda: [torch.tensor(float(k)) for k in (0, 1, 41, 2 ** 24 - 1, 2 ** 24)],
    lambda: [torch.tensor(2.0, dtype=torch.float64)] * 2,     # float64: torch's ops
    lambda: [torch.tensor(5.0), torch.tensor(6.0, dtype=torch.float64)],
], ids=["float32 up to 2^24", "float64 shared", "mixed"])
def test_bump_steps_matches_torch_foreach_add(make):
    """bump_steps gives the counts and leaves the tensors as torch's _foreach_add_ and stack
    do, on the compiled path (float32) and on torch's (anything else), 2^24 + 1 rounding to
    2^24 in float32 as it does in torch."""
    steps, ref = make(), make()
    assert ca.bump_steps(steps) == _torch_bump(ref)
    for got, want in zip(steps, ref):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_bump_steps_adds_twice_to_a_step_listed_twice_before_reading():
    a, b = torch.tensor(3.0), torch.tensor(7.0)
    ra, rb = a.clone(), b.clone()
    v = a._version
    assert ca.bump_steps([a, b, a]) == _torch_bump([ra, rb, ra]) == [5, 8, 5]
    assert a.item() == 5.0 and b.item() == 8.0 and a._version > v  # bumped, as in-place ops do
