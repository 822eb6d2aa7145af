"""fp16 loss scaling: a one-pass unscale / inf-nan check / sum-of-squares kernel, and the
loss multiply, with the plain torch reference beside each Triton kernel.

Dispatch (`kernel_backend`): CUDA tensors use Triton, CPU tensors the torch reference;
`HF_ZOFFLOAD_KERNELS=triton|torch|auto` (or `backend=`) forces a choice. Triton on CPU tensors
works only under `TRITON_INTERPRET=1`, which must be set before this module is imported:
Triton picks the interpreter when a kernel is decorated, not when it is launched.

No function here reads device memory on the host: no `.item()`, no `bool()` of a tensor, no
Python branch on a device value. Flags and sums stay in 1-element device tensors.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

__all__ = ["kernel_backend", "scale_loss", "unscale_check_", "unscale_check_host_",
           "unscale_check_reference"]

ENV_KERNELS = "HF_ZOFFLOAD_KERNELS"
_BACKENDS = ("auto", "triton", "torch")
_GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Elements per program. 8192 with 8 warps is 32 elements per thread: four 16-byte loads in
# flight per thread for fp16 (eight for fp32), enough to cover HBM latency, while a 25M
# bucket still makes 3052 programs, about 2.9 waves of 8 resident 256-thread programs on
# each of an H200's 132 SMs, so the ragged last wave costs little. It also keeps the
# interpreter fast: 123 programs for the 1_000_003-element test case. Compiled for sm_90
# (Triton 3.9) a full fp16 tile is 4 ld.global.v4 per thread; only the last tile is masked.
# Not yet timed on a GPU: scripts/bench/bench_scaling.py is the check.
_BLOCK = 8192
_NUM_WARPS = 8
# Lanes of the one-program second stage that adds the per-program partials.
_PARTIALS_BLOCK = 1024
# No multiply-add contraction: every square is rounded before it is added, as documented,
# on every Triton version (3.9 warns that its default flips in 3.10). The kernel is bound
# by memory, so the extra rounding step costs no time.
_FP_FUSION = False


@triton.jit
def _unscale_tile(src, dst, inv_scale, found_inf_ptr, n_left,
                  BLOCK: tl.constexpr, WRITE_OUT: tl.constexpr, MASKED: tl.constexpr):
    # One tile: returns the fp32 sum of squares of the unscaled values. MASKED is a
    # constexpr so full tiles get unmasked, vectorized 16-byte loads whatever n is.
    offs = tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < n_left
        g = tl.load(src + offs, mask=mask, other=0.0)
    else:
        g = tl.load(src + offs)
    if g.dtype == tl.bfloat16:
        # bf16 is the high half of an fp32: widen by a 16-bit shift. Exact, the same as the
        # GPU's own convert, and right for subnormals, which Triton 3.9's interpreter
        # widens wrongly through its float conversion (5e-39 came out as 8e-39).
        g = (g.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        g = g.to(tl.float32)
    # Same rounding as the reference: exact widening to fp32, then one fp32 multiply.
    v = g * inv_scale
    if WRITE_OUT:
        if MASKED:
            tl.store(dst + offs, v, mask=mask)
        else:
            tl.store(dst + offs, v)
    # The unscaled value is tested, as torch's _amp_foreach_non_finite_check_and_unscale_
    # does: an inf or nan grad stays inf or nan after the multiply.
    bad = (v != v) | (tl.abs(v) == float("inf"))
    any_bad = tl.max(bad.to(tl.int32), axis=0)
    # Every writer stores the same 1.0 and nobody reads it here, so the race is benign and
    # the result does not depend on program order; 0 is never written (the flag is sticky).
    tl.store(found_inf_ptr, 1.0, mask=any_bad > 0)
    return tl.sum(v * v, axis=0)


@triton.jit(do_not_specialize=["n"])
def _unscale_check_kernel(grad_ptr, out_ptr, inv_scale_ptr, found_inf_ptr, sumsq_ptr,
                          partials_ptr, n,
                          BLOCK: tl.constexpr, WRITE_OUT: tl.constexpr,
                          SINGLE: tl.constexpr):
    # n is not specialized (no recompiles per bucket size); tiles split on n at run time.
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK  # int64: buckets may pass 2**31 elements
    src = grad_ptr + start
    dst = out_ptr + start
    n_left = n - start
    inv_scale = tl.load(inv_scale_ptr)
    if n_left >= BLOCK:
        s = _unscale_tile(src, dst, inv_scale, found_inf_ptr, n_left,
                          BLOCK, WRITE_OUT, False)
    else:
        s = _unscale_tile(src, dst, inv_scale, found_inf_ptr, n_left,
                          BLOCK, WRITE_OUT, True)
    if SINGLE:
        # One program in all: add straight into the accumulator, no second launch.
        tl.store(sumsq_ptr, tl.load(sumsq_ptr) + s)
    else:
        tl.store(partials_ptr + pid, s)


@triton.jit(do_not_specialize=["num_partials"])
def _sum_partials_kernel(partials_ptr, sumsq_ptr, num_partials, BLOCK: tl.constexpr):
    # One program: lane j adds partials j, j+BLOCK, j+2*BLOCK, ... in that order, then a
    # tree over the lanes; a fixed order, so the sum is bitwise reproducible.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for first in range(0, num_partials, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        acc += tl.load(partials_ptr + offs, mask=offs < num_partials, other=0.0)
    tl.store(sumsq_ptr, tl.load(sumsq_ptr) + tl.sum(acc, axis=0))


def _kernels_interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - layout of other Triton versions
        return False
    return isinstance(_unscale_check_kernel, InterpretedFunction)


def kernel_backend(device: torch.device, backend: str | None = None) -> str:
    """Return "triton" or "torch" for tensors on `device`.

    `backend` wins when given, else the env var HF_ZOFFLOAD_KERNELS, else "auto"; each is
    one of auto|triton|torch. auto picks Triton for CUDA and the torch reference elsewhere.
    """
    name, value = "backend", backend
    if value is None:
        name, value = ENV_KERNELS, os.environ.get(ENV_KERNELS, "") or "auto"
    choice = str(value).strip().lower()
    if choice not in _BACKENDS:
        raise ValueError(f"{name}={value!r}: allowed values are {', '.join(_BACKENDS)}")
    device = torch.device(device)
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and device.type != "cuda" and not _kernels_interpreted():
        raise RuntimeError(
            f"{name}=triton on a {device.type} tensor needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before hf_zoffload.ops.scaling is imported, or use "
            f"{name}=torch")
    return choice


def _check_scalar(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.numel() != 1 or t.dtype != torch.float32 or t.device != device:
        raise ValueError(f"{name} must be a 1-element float32 tensor on {device}, got "
                         f"shape {tuple(t.shape)} {t.dtype} on {t.device}")


def _check_args(grad, inv_scale, found_inf, sumsq, out) -> None:
    # Metadata only (shape, dtype, device): none of these reads tensor data.
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"grad dtype must be float16, bfloat16 or float32, got {grad.dtype}")
    if grad.dim() != 1 or not grad.is_contiguous():
        raise ValueError(f"grad must be a 1-D contiguous tensor, got shape {tuple(grad.shape)}")
    for name, t in (("inv_scale", inv_scale), ("found_inf", found_inf), ("sumsq", sumsq)):
        _check_scalar(name, t, grad.device)
    if found_inf.data_ptr() == sumsq.data_ptr():
        raise ValueError("found_inf and sumsq must be distinct tensors")
    if out is not None and (out.dtype != torch.float32 or out.dim() != 1
                            or out.numel() != grad.numel() or not out.is_contiguous()
                            or out.device != grad.device):
        raise ValueError(f"out must be a contiguous 1-D float32 tensor of {grad.numel()} "
                         f"elements on {grad.device}")


def unscale_check_reference(grad, inv_scale, found_inf, sumsq, *, out=None) -> None:
    """Plain torch form of `unscale_check_`, same contract; the sum of squares is added
    in torch.sum's own order (cascade summation on CPU), so it may differ in the last bits."""
    _check_args(grad, inv_scale, found_inf, sumsq, out)
    # fp32 result from fp16/bf16 input: torch widens exactly, then rounds one fp32 multiply.
    v = torch.mul(grad, inv_scale, out=out) if out is not None else grad.float() * inv_scale
    found_inf.masked_fill_(~torch.isfinite(v).all(), 1.0)
    # Not torch.dot: its fp32 BLAS running sum was 2.3e-5 off at 1M terms of ~1, where
    # torch.sum's cascade summation was 2e-8 off (tests/ops/test_scaling.py data).
    sumsq.add_(torch.sum(v * v))


def unscale_check_host_(grad, inv_scale, found_inf, sumsq, *, out=None) -> None:
    """`unscale_check_reference` for CPU tensors, bit for bit, in fewer passes (with ``out``
    it is the reference).

    On the CPU reading a value is no sync, so it branches on one: an inf or nan in the
    unscaled grad makes the sum of squares inf or nan, so a finite sum proves every element
    finite and the separate isfinite pass is skipped (run only when the sum is not finite,
    where squares of finite values may also have overflowed: the flag then follows the
    reference exactly). An fp32 grad with a scale of 1 is squared as it is, since x * 1.0 is
    x. On the quickstart model's 52 params this cut the check from 5.0 to 1.5 ms a step
    (2-vCPU AMD EPYC; scripts/bench/bench_trainer.py)."""
    if grad.device.type != "cpu":
        raise ValueError(f"unscale_check_host_ takes CPU tensors, got {grad.device}")
    if out is not None:
        unscale_check_reference(grad, inv_scale, found_inf, sumsq, out=out)
        return
    _check_args(grad, inv_scale, found_inf, sumsq, None)
    if grad.dtype == torch.float32 and inv_scale.item() == 1.0:
        v = grad
    else:
        v = grad.float() * inv_scale
    total = torch.sum(v * v)
    if not torch.isfinite(total).item():
        found_inf.masked_fill_(~torch.isfinite(v).all(), 1.0)
    sumsq.add_(total)


def unscale_check_(grad, inv_scale, found_inf, sumsq, *, out=None, backend=None) -> None:
    """One read of a flat gradient buffer, all in fp32 and on the device, no host sync:

    - `found_inf` (1-element fp32) is set to 1.0 when any `grad * inv_scale` is inf or nan
      (so whenever grad holds an inf or nan); it is never cleared here, so it stays set
      across buckets and micro-steps until the caller zeroes it;
    - `sumsq` (1-element fp32) += sum((grad.float() * inv_scale) ** 2);
    - `out`, if given (fp32, grad's numel, may alias an fp32 grad), receives
      grad.float() * inv_scale.

    grad: 1-D contiguous fp16/bf16/fp32, any length; inv_scale: 1-element fp32, same device.

    Order of summation (Triton path): each program of 8192 consecutive elements squares in
    fp32 and reduces its tile with a tree (tl.sum); the per-program partials are added by a
    second one-program kernel, lane j taking partials j, j+1024, ... in order, then a tree
    over the 1024 lanes; finally the total is added to `sumsq`. Mostly-tree summation keeps
    the relative error near (log2(n) + n/2**23) * 2**-24 (about 1.5e-6 at 25M elements)
    instead of n * 2**-24 for a running sum, so small terms are not lost; the terms are
    non-negative, so no partial exceeds the total and nothing overflows unless the total
    itself is above the fp32 range. The order is fixed (no atomics), so results are
    bitwise reproducible run to run on a given device.
    """
    if kernel_backend(grad.device, backend) == "torch":
        unscale_check_reference(grad, inv_scale, found_inf, sumsq, out=out)
        return
    _check_args(grad, inv_scale, found_inf, sumsq, out)
    n = grad.numel()
    if n == 0:
        return
    programs = triton.cdiv(n, _BLOCK)
    single = programs == 1
    # Partials come from the caching allocator on CUDA: no cudaMalloc, no sync.
    partials = sumsq if single else torch.empty(programs, dtype=torch.float32,
                                                device=grad.device)
    # Triton launches on the current device: make it grad's (cuda:1 grads, cuda:0 current).
    with torch.cuda.device(grad.device) if grad.is_cuda else contextlib.nullcontext():
        _unscale_check_kernel[(programs,)](
            grad, grad if out is None else out, inv_scale, found_inf, sumsq, partials, n,
            BLOCK=_BLOCK, WRITE_OUT=out is not None, SINGLE=single, num_warps=_NUM_WARPS,
            enable_fp_fusion=_FP_FUSION)
        if not single:
            _sum_partials_kernel[(1,)](partials, sumsq, programs, BLOCK=_PARTIALS_BLOCK,
                                       num_warps=4, enable_fp_fusion=_FP_FUSION)


def scale_loss(loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`loss * scale` for a 1-element fp32 device tensor `scale`, with no host sync.

    Differentiable through autograd: the backward multiplies the upstream grad by `scale`.
    The scale is viewed as 0-dim, as torch.amp.GradScaler's own scale tensor, so shape and
    dtype follow GradScaler.scale exactly: a 0-dim fp16 loss comes out fp32 (so the scaled
    loss cannot overflow), a non-scalar fp16 tensor stays fp16. It is one elementwise
    kernel on a scalar; a fused Triton form would save nothing measurable.
    """
    if scale.numel() != 1:
        raise ValueError(f"scale must hold one element, got shape {tuple(scale.shape)}")
    return loss * scale.reshape(())
