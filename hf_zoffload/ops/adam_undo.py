"""Undo one fp32 CPU-Adam step from the gradient it read: the compiled pass and the torch
float64 reference beside it, bitwise equal (the overlapped schedule's correction,
offload/schedules/inverse.py; the bound in docs/protocols/step.md, "The correction bound").

The step undone is `adam_kernels.adam_update`'s AdamW (decoupled decay, bias correction) over
an fp32 master and fp32 moments, with ``g = fl(grad * grad_scale)``, ``c = fl(1 - beta1)``,
``w2 = fl(1 - beta2)``:

    m1 = fma(c, g - m, m)                 v1 = fma(fl(w2 * g), g, fl(beta2 * v))
    d  = sqrt(v1) * rbc2 + eps            p1 = fl(p * decay) + fl(ns * m1) / d

The undo computes, in float64 from the fp32 values and rounded once to fp32,

    q = fl32(ns * m1) / fl32(d)   (in fp32, as the step)      p = (p1 - q) / decay
    m = (m1 - c g) / (1 - c)                                  v = max(0, (v1 - fl(w2 g) g) / beta2)

and at Adam step 1 the moments were zero: m = v = 0 exactly. Rounding lost information in the
step, so the result is the previous state within inverse.undo_bound, not bitwise.

`adam_undo` checks its arguments; `adam_undo_unchecked` is the engine's call (its buffers are
its own); `adam_undo_reference` is the same arithmetic in torch ops, op for op: fp32 where the
compiled pass computes in fp32 (the square root correctly rounded, as sqrtf), float64 elsewhere.
The three divisions by a scalar are, in both, multiplications by the scalar's reciprocal rounded
in double (`undo_coefficients`' r_decay, r_omc, r_b2: a relative 2^-52 at most, 2^-28 of the
fp32 result's unit roundoff): torch's own division by a Python scalar is a true one (bitwise
x / s on CPU, torch 2.13), and three of them cost the compiled pass a third of its time
(cython_ext/adam_undo.h).
"""

from __future__ import annotations

import numbers

import torch

from ._native import ext as _ext
from .adam_kernels import (
    _GRAD_KIND,
    _check_buffer,
    _check_real,
    _checked_variant,
    _f32,
    check_hyper,
)

__all__ = ["adam_undo", "adam_undo_reference", "adam_undo_unchecked", "undo_coefficients",
           "undo_reference_unchecked"]

# Elements per float64 pass of the reference: 1 Mi (8 MiB per temporary) keeps a chunk's few
# temporaries in a 32 MiB L3 rather than streaming 12 passes of the buffer through memory.
_REF_CHUNK = 1 << 20


def undo_coefficients(step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, grad_scale: float) -> dict[str, float]:
    """The step's fp32 scalars (as adam_kernels.adam_update_unchecked derives them in double
    before the kernel rounds them), each as the Python float of its fp32 value, and the
    undo's reciprocals of decay, 1 - c and beta2 (from those values, rounded in double)."""
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    k = {"gs": _f32(grad_scale), "decay": _f32(1.0 - lr * weight_decay),
            "c": _f32(1.0 - beta1), "b2": _f32(beta2), "w2": _f32(1.0 - beta2),
            "rbc2": _f32(1.0 / bc2**0.5), "eps": _f32(eps), "ns": _f32(-(lr / bc1))}
    k.update(r_decay=1.0 / k["decay"], r_omc=1.0 / (1.0 - k["c"]), r_b2=1.0 / k["b2"])
    return k


def _check(master, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
           grad_scale, num_threads):
    """Every argument of `adam_undo`, before any work: one TypeError / ValueError naming the
    first bad one."""
    _check_buffer("master", master, (torch.float32,))
    n = master.numel()
    _check_buffer("grad", grad, tuple(_GRAD_KIND), n)
    _check_buffer("exp_avg", exp_avg, (torch.float32,), n)
    _check_buffer("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    if n:
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), nm)
                       for nm, t in (("master", master), ("grad", grad), ("exp_avg", exp_avg),
                                     ("exp_avg_sq", exp_avg_sq)))
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise ValueError(f"{a} and {b} overlap in memory; every buffer must be distinct")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an int >= 1 (Adam counts from 1), got {step!r}")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ValueError(f"num_threads must be None or an int >= 1, got {num_threads!r}")
    hyper = check_hyper(lr, (beta1, beta2), eps, weight_decay, beta_names=("beta1", "beta2"))
    return undo_coefficients(int(step), *hyper,
                             _check_real("grad_scale", grad_scale))


def adam_undo(master, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float,
              beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0,
              num_threads: int | None = None) -> None:
    """Undo `adam_kernels.adam_update`'s AdamW step number ``step`` (fp32 master and moments,
    ``adamw_mode`` and ``bias_correction`` on) in one compiled pass, in place, from the
    ``grad`` (fp32, fp16 or bf16) and the hyperparameters it ran with. 1-D contiguous CPU
    buffers of one size, none sharing memory. Bitwise `adam_undo_reference`, for any
    ``num_threads`` (None: torch.get_num_threads()) and any split of the buffers; a NaN as a
    NaN (torch subtracts with an FMA, p + (-1) q, whose NaN is q's where both are; the pass's
    p - q keeps p's)."""
    _undo(master, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
          eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, num_threads=num_threads)


def _undo(master, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
          grad_scale=1.0, num_threads=None, variant="auto") -> None:
    """adam_undo with a choice of compiled variant (tests compare them bit for bit)."""
    k = _check(master, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
               eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
               num_threads=num_threads)
    ext = _ext()
    _checked_variant()  # a -march=native build on another CPU, or no OpenMP: said once
    if variant not in ext.VARIANTS or not ext.variant_available(ext.VARIANTS[variant]):
        raise ValueError(f"kernel variant {variant!r} is not available here")
    adam_undo_unchecked(master, grad, exp_avg, exp_avg_sq, k, first=step == 1,
                        num_threads=num_threads, variant=variant)


def adam_undo_unchecked(master, grad, exp_avg, exp_avg_sq, k: dict, *, first: bool,
                        num_threads: int | None = None, variant: str = "auto") -> None:
    """`adam_undo` from `undo_coefficients` ``k``, without the checks (the engine's call: its
    buffers are its own; the checks would cost ~100 us a call). Bad arguments here are
    undefined behaviour."""
    n = master.numel()
    if n == 0:
        return
    ext = _ext()
    ext.adam_undo(master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
                  n, _GRAD_KIND[grad.dtype], first, k["gs"], k["c"], k["w2"], k["rbc2"],
                  k["eps"], k["ns"], k["r_decay"], k["r_omc"], k["r_b2"],
                  torch.get_num_threads() if num_threads is None else num_threads,
                  ext.VARIANTS[variant])


def adam_undo_reference(master, grad, exp_avg, exp_avg_sq, *, step: int, lr: float,
                        beta1: float, beta2: float, eps: float, weight_decay: float,
                        grad_scale: float = 1.0, num_threads: int | None = None) -> None:
    """`adam_undo` in torch ops (same checks; num_threads has no effect on the result)."""
    k = _check(master, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
               eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
               num_threads=num_threads)
    undo_reference_unchecked(master, grad, exp_avg, exp_avg_sq, k, first=step == 1)


@torch.no_grad()
def undo_reference_unchecked(master, grad, exp_avg, exp_avg_sq, k: dict, *,
                             first: bool) -> None:
    """`adam_undo_reference` from `undo_coefficients` ``k``, in chunks of _REF_CHUNK."""
    n = master.numel()
    for a in range(0, n, _REF_CHUNK):
        z = min(n, a + _REF_CHUNK)
        _reference(master[a:z], exp_avg[a:z], exp_avg_sq[a:z], grad[a:z], k, first=first)


def _reference(p, m, v, grad, k, *, first: bool) -> None:
    g = grad.float() * k["gs"]  # fp32 x fp32 scalar: the kernel's own product, bit for bit
    # The kernel's sqrtf is correctly rounded; torch's fp32 sqrt is not everywhere (its vector
    # body was an ulp off on 17% of 1 M random values, torch 2.13, AVX2): through float64,
    # where rounding twice is exact for a square root (53 >= 2 x 24 + 2 bits).
    d = v.double().sqrt_().float().mul_(k["rbc2"]).add_(k["eps"])
    q = (m * k["ns"]).div_(d).double()
    p.copy_(p.double().sub_(q).mul_(k["r_decay"]))
    if first:  # Adam step 1 started from zero moments
        m.zero_()
        v.zero_()
        return
    g64 = g.double()
    m.copy_(m.double().sub_(g64 * k["c"]).mul_(k["r_omc"]))
    a = (g * k["w2"]).double()  # fl(w2 * g), as the kernel rounds it before the fma
    v.copy_(v.double().sub_(a.mul_(g64)).mul_(k["r_b2"]).clamp_(min=0.0))
