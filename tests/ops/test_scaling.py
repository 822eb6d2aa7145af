"""Triton unscale/check/sum-of-squares kernel against the torch reference.

On a machine without CUDA, conftest.py sets TRITON_INTERPRET=1 before this module imports
hf_zoffload.ops.scaling, so backend="triton" runs the real kernel code in the interpreter.
"""

import math

import pytest
import torch

from hf_zoffload.ops import scaling as S

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SMALL = [1, 7, 4097]
BIG = 1_000_003  # 123 programs of 8192: multi-program partials and a masked tail
FP16_MAX = 65504.0
# Norm tolerance. Each term rounds twice (fp32 product, fp32 square): 2**-23 relative;
# the kernel adds them in trees of depth <= 13 (tile) + 1 (lane) + 10 (lanes), so the sum's
# relative error is below 26 * 2**-24 ~ 1.6e-6, halved by the sqrt. 1e-5 leaves margin and
# still catches a dropped tile (>= 1/123 of the sum at BIG) or a double-counted one.
RTOL = 1e-5


def _atol(n):
    # Squares below fp32's smallest normal (2**-126) may flush to 0 in any fp32 sum, so at
    # most n * 2**-126 of the squared norm is lost: sqrt of that bounds the norm's error.
    return math.sqrt(n) * 2.0**-63


def make_grad(case, n, dtype, seed=0):
    """Returns (grad, inv_scale) for a named case."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    u = torch.rand(n, generator=gen)
    inv = 2.0**-16
    if case == "normal":
        g = torch.randn(n, generator=gen) * 1000
    elif case == "near_fp16_max":  # loss-scaled grads near fp16's max, moderate once unscaled
        g = sign * FP16_MAX * (0.9 + 0.1 * u)
    elif case == "subnormal":  # the dtype's own subnormals, some exactly the smallest
        g = sign * torch.finfo(dtype).smallest_normal * u
        g[::5] = sign[::5] * torch.finfo(dtype).smallest_normal * 2.0**-8
        inv = 1.0
    elif case == "fp16_subnormal":  # fp16 subnormal magnitudes in any dtype
        g = sign * 2.0**-14 * u
        inv = 1.0
    elif case == "zeros":
        g = torch.zeros(n)
    else:
        raise AssertionError(case)
    return g.to(dtype), torch.tensor([inv], dtype=torch.float32)


def run(fn, grad, inv, *, with_out, found=0.0, sumsq=0.0, **kw):
    f = torch.tensor([found])
    s = torch.tensor([sumsq])
    out = torch.full((grad.numel(),), 12345.0) if with_out else None
    fn(grad, inv, f, s, out=out, **kw)
    return f, s, out


def check_against_reference(grad, inv, *, with_out):
    f, s, out = run(S.unscale_check_, grad, inv, with_out=with_out, backend="triton")
    rf, rs, rout = run(S.unscale_check_reference, grad, inv, with_out=with_out)
    assert f.item() == rf.item()  # the flag is exact
    expect_bad = not torch.isfinite(grad.double() * inv).all().item()
    assert f.item() == float(expect_bad)
    if with_out:  # same exact widening and one fp32 multiply: bitwise equal
        torch.testing.assert_close(out, rout, rtol=0, atol=0, equal_nan=True)
    if not expect_bad:
        want = torch.linalg.vector_norm(grad.double() * inv.double()).item()
        assert math.isclose(math.sqrt(s.item()), want, rel_tol=RTOL, abs_tol=_atol(grad.numel()))
        assert math.isclose(s.item(), rs.item(), rel_tol=2 * RTOL, abs_tol=grad.numel() * 2**-126)
    return f, s, out


CASES = ["normal", "near_fp16_max", "subnormal", "fp16_subnormal", "zeros"]


@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n", SMALL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference_small(dtype, n, case, with_out):
    grad, inv = make_grad(case, n, dtype)
    check_against_reference(grad, inv, with_out=with_out)


# The interpreter takes about 0.5 s per launch at this size: a few cases per dtype only.
@pytest.mark.parametrize(("case", "with_out"), [("near_fp16_max", True), ("normal", False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference_big(dtype, case, with_out):
    grad, inv = make_grad(case, BIG, dtype)
    check_against_reference(grad, inv, with_out=with_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_big_nan_in_middle_and_neg_inf_last(dtype):
    grad, inv = make_grad("normal", BIG, dtype)
    grad[BIG // 2] = float("nan")
    check_against_reference(grad, inv, with_out=True)
    grad, inv = make_grad("normal", BIG, dtype)
    grad[-1] = float("-inf")  # inside the masked tail tile
    check_against_reference(grad, inv, with_out=False)


SPECIALS = [float("inf"), float("nan"), float("-inf")]


@pytest.mark.parametrize("value", SPECIALS, ids=["inf", "nan", "-inf"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("n", [*SMALL, 3 * 8192 + 5])  # the last: 4 programs, ragged tail
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_special_value_sets_flag(dtype, n, where, value):
    grad, inv = make_grad("near_fp16_max", n, dtype)
    grad[{"first": 0, "middle": n // 2, "last": n - 1}[where]] = value
    f, _, _ = check_against_reference(grad, inv, with_out=True)
    assert f.item() == 1.0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_found_inf_sticky_and_sumsq_accumulates(backend):
    bad, inv = make_grad("normal", 9000, torch.float16)
    bad[5] = float("inf")
    clean, _ = make_grad("normal", 9000, torch.float16, seed=1)
    f = torch.zeros(1)
    s = torch.zeros(1)
    S.unscale_check_(bad, inv, f, s, backend=backend)
    assert f.item() == 1.0
    s.zero_()
    S.unscale_check_(clean, inv, f, s, backend=backend)
    assert f.item() == 1.0  # a clean bucket never clears the flag
    once = s.item()
    S.unscale_check_(clean, inv, f, s, backend=backend)
    assert s.item() == pytest.approx(2 * once, rel=1e-6)
    f0 = torch.zeros(1)
    S.unscale_check_(clean, inv, f0, s, backend=backend)
    assert f0.item() == 0.0


# The interpreter computes with numpy, which warns on the intended fp32 overflow.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_finite_but_square_overflows_is_not_flagged(backend):
    # 1e30 ** 2 is beyond fp32: the norm is inf, yet no element is inf/nan.
    grad = torch.full((10,), 1e30, dtype=torch.bfloat16)
    f, s, _ = run(S.unscale_check_, grad, torch.ones(1), with_out=False, backend=backend)
    assert f.item() == 0.0 and s.item() == math.inf


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_grad_changes_nothing(backend):
    f, s, out = run(S.unscale_check_, torch.empty(0, dtype=torch.float16), torch.ones(1),
                    with_out=True, found=1.0, sumsq=3.0, backend=backend)
    assert f.item() == 1.0 and s.item() == 3.0 and out.numel() == 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_out_may_alias_fp32_grad(backend):
    grad, inv = make_grad("normal", 10_000, torch.float32)
    want = grad * inv
    f = torch.zeros(1)
    s = torch.zeros(1)
    S.unscale_check_(grad, inv, f, s, out=grad, backend=backend)
    assert torch.equal(grad, want)


@pytest.mark.parametrize("bad", [
    dict(grad=torch.zeros(2, 3)),
    dict(grad=torch.zeros(8, dtype=torch.float64)),
    dict(grad=torch.zeros(8, dtype=torch.int32)),
    dict(grad=torch.zeros(16)[::2]),
    dict(inv_scale=torch.ones(1, dtype=torch.float16)),
    dict(inv_scale=torch.ones(2)),
    dict(found_inf=torch.zeros(1, dtype=torch.bool)),
    dict(sumsq=torch.zeros(1, dtype=torch.float64)),
    dict(out=torch.zeros(7)),
    dict(out=torch.zeros(8, dtype=torch.float16)),
])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_arguments_raise(backend, bad):
    args = dict(grad=torch.zeros(8), inv_scale=torch.ones(1), found_inf=torch.zeros(1),
                sumsq=torch.zeros(1), out=None)
    args.update(bad)
    with pytest.raises(ValueError):
        S.unscale_check_(args["grad"], args["inv_scale"], args["found_inf"], args["sumsq"],
                         out=args["out"], backend=backend)


@pytest.mark.parametrize("inv", [1.0, 2.0**-10, 3.0])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n", [*SMALL, 3 * 8192 + 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_host_path_is_the_reference_bit_for_bit(dtype, n, case, inv):
    grad, _ = make_grad(case, n, dtype)
    inv = torch.tensor([inv])
    for special in (None, float("inf"), float("nan"), float("-inf")):
        if special is not None:
            grad[n // 2] = special
        f, s, _ = run(S.unscale_check_host_, grad, inv, with_out=False, found=0.0, sumsq=0.5)
        rf, rs, _ = run(S.unscale_check_reference, grad, inv, with_out=False, found=0.0,
                        sumsq=0.5)
        assert f.item() == rf.item() == float(special is not None)
        assert torch.equal(s, rs) or (s.isnan().all() and rs.isnan().all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_path_finite_squares_overflowing(dtype):
    # finite values whose squares overflow fp32: the sum is inf, the flag stays clear
    grad = torch.full((9,), 3e19).to(dtype) if dtype == torch.float32 else \
        torch.full((9,), 60000.0).to(dtype)
    inv = torch.tensor([1e15 if dtype != torch.float32 else 1.0])
    f, s, _ = run(S.unscale_check_host_, grad, inv, with_out=False)
    rf, rs, _ = run(S.unscale_check_reference, grad, inv, with_out=False)
    assert f.item() == rf.item() == 0.0 and s.item() == rs.item() == math.inf


# --------------------------------------------------------------------- dispatch
def test_backend_auto_by_device(monkeypatch):
    monkeypatch.delenv(S.ENV_KERNELS, raising=False)
    assert S.kernel_backend(torch.device("cpu")) == "torch"
    assert S.kernel_backend(torch.device("cuda")) == "triton"
    assert S.kernel_backend("cpu", "auto") == "torch"


def test_backend_env_and_argument(monkeypatch):
    monkeypatch.setenv(S.ENV_KERNELS, "torch")
    assert S.kernel_backend(torch.device("cuda")) == "torch"
    assert S.kernel_backend(torch.device("cuda"), "triton") == "triton"  # the argument wins
    monkeypatch.setenv(S.ENV_KERNELS, "TRITON")
    assert S.kernel_backend(torch.device("cpu")) == "triton"  # the interpreter is on here
    monkeypatch.setenv(S.ENV_KERNELS, "")
    assert S.kernel_backend(torch.device("cpu")) == "torch"


def test_backend_bad_value_names_the_setting(monkeypatch):
    monkeypatch.setenv(S.ENV_KERNELS, "cuda")
    with pytest.raises(ValueError, match="HF_ZOFFLOAD_KERNELS.*auto, triton, torch"):
        S.kernel_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="backend='fast'.*auto, triton, torch"):
        S.kernel_backend(torch.device("cpu"), "fast")


def test_backend_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(S, "_kernels_interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        S.kernel_backend(torch.device("cpu"), "triton")


def test_env_forces_the_kernel_path(monkeypatch):
    calls = []
    monkeypatch.setattr(S, "unscale_check_reference", lambda *a, **k: calls.append(1))
    monkeypatch.setenv(S.ENV_KERNELS, "triton")
    f, s, _ = run(S.unscale_check_, torch.ones(4), torch.ones(1), with_out=False)
    assert not calls and s.item() == 4.0
    monkeypatch.setenv(S.ENV_KERNELS, "torch")
    run(S.unscale_check_, torch.ones(4), torch.ones(1), with_out=False)
    assert calls == [1]


# ----------------------------------------------------------------- no host sync
def _forbid_host_reads(monkeypatch):
    """Every way Python code reads a tensor's value on the host raises."""
    def boom(*_a, **_k):
        raise AssertionError("host read of a device tensor")
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__",
                 "__complex__"):
        monkeypatch.setattr(torch.Tensor, name, boom)


def test_forbid_host_reads_catches_a_sync(monkeypatch):
    # The guard can fail: the usual ways to branch on a device flag are caught.
    flag = torch.ones(1)
    _forbid_host_reads(monkeypatch)
    for read in (lambda: bool(flag), lambda: flag.item(), lambda: float(flag),
                 lambda: 1 if flag else 0, lambda: flag.tolist()):
        with pytest.raises(AssertionError, match="host read"):
            read()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("n", [7, 3 * 8192 + 5])
def test_unscale_check_never_reads_on_host(monkeypatch, backend, n):
    grad, inv = make_grad("normal", n, torch.float16)
    grad[1] = float("nan")
    f = torch.zeros(1)
    s = torch.zeros(1)
    out = torch.empty(n)
    _forbid_host_reads(monkeypatch)
    S.unscale_check_(grad, inv, f, s, out=out, backend=backend)
    S.unscale_check_(grad, inv, f, s, backend=backend)
    monkeypatch.undo()
    assert f.item() == 1.0


def test_scale_loss_never_reads_on_host(monkeypatch):
    loss = torch.tensor(2.5, requires_grad=True)
    scale = torch.tensor([1024.0])
    _forbid_host_reads(monkeypatch)
    scaled = S.scale_loss(loss, scale)
    scaled.backward()
    monkeypatch.undo()
    assert scaled.item() == 2560.0 and loss.grad.item() == 1024.0


# ------------------------------------------------------------------- scale_loss
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_loss_keeps_shape_dtype_and_scales_backward(dtype):
    x = torch.randn(5, dtype=dtype, requires_grad=True)
    loss = (x.float() ** 2).sum().to(dtype)
    scaled = S.scale_loss(loss, torch.tensor([8.0]))
    reference = torch.amp.GradScaler("cpu", init_scale=8.0).scale(loss.detach())
    assert scaled.shape == loss.shape and scaled.dtype == reference.dtype
    vec = torch.ones(3, dtype=dtype)
    assert S.scale_loss(vec, torch.tensor([8.0])).dtype == dtype  # as GradScaler
    assert scaled.item() == 8 * loss.item()
    scaled.backward()
    torch.testing.assert_close(x.grad.float(), 16 * x.detach().float(), rtol=1e-2, atol=0)
    with pytest.raises(ValueError):
        S.scale_loss(loss, torch.ones(2))


# ------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 4097, BIG, 25_000_001])
def test_gpu_kernel_matches_reference(dtype, n):
    for case in ("near_fp16_max", "subnormal", "normal"):
        grad, inv = make_grad(case, n, dtype)
        grad, inv = grad.cuda(), inv.cuda()
        if case == "normal":
            grad[n // 2] = float("nan")
        f, s, out = (torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda"),
                     torch.empty(n, device="cuda"))
        S.unscale_check_(grad, inv, f, s, out=out, backend="triton")
        want = (grad.double() * inv.double())
        assert f.item() == float(not torch.isfinite(want).all().item())
        # Exact but for a possible flush to zero of fp32 subnormal results on the device.
        torch.testing.assert_close(out, want.float(), rtol=0, equal_nan=True,
                                   atol=torch.finfo(torch.float32).smallest_normal)
        if case != "normal":
            norm = torch.linalg.vector_norm(want).item()
            assert math.isclose(math.sqrt(s.item()), norm, rel_tol=RTOL, abs_tol=_atol(n))


@pytest.mark.gpu
def test_gpu_no_sync_and_deterministic():
    grad, inv = make_grad("normal", BIG, torch.float16)
    grad, inv = grad.cuda(), inv.cuda()
    sums = []
    S.unscale_check_(grad, inv, torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda"),
                     backend="triton")  # compile outside the guarded region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            f, s = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
            S.unscale_check_(grad, inv, f, s, backend="triton")
            S.scale_loss(grad[:1].float().sum(), inv)
            sums.append(s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len({x.item() for x in sums}) == 1  # fixed summation order: bitwise equal
