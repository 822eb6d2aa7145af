"""Undo one CPU-Adam step over fp32 state, from the gradient it read: the overlapped
schedule's correction (docs/protocols/step.md, "The correction bound").

The kernel's step (cython_ext/adam_kernel_body.h, AdamW, fp32 master and moments), with
``g = fl(grad * grad_scale)``, ``c = fl(1 - beta1)``, ``w2 = fl(1 - beta2)``:

    m1 = fma(c, g - m, m)                 v1 = fma(fl(w2 * g), g, fl(beta2 * v))
    d  = sqrt(v1) * rbc2 + eps            p1 = fl(p * decay) + fl(ns * m1) / d

Rounding loses information, so the inverse is not exact: `undo` computes, in float64 from
the fp32 values and rounded once to fp32,

    q = fl32(ns * m1) / fl32(d)   (as the kernel)      p = (p1 - q) / decay
    m = (m1 - c g) / (1 - c)                           v = max(0, (v1 - fl(w2 g) g) / beta2)

and at Adam step 1 the moments were zero: m = v = 0 exactly. With u = 2^-24, to first
order: |m~ - m| <= u (c |g - m| + |m1|) / (1 - c) + u |m|,
|v~ - v| <= u (w2 g^2 + v1) / beta2 + 2 u v, |p~ - p| <= 2 u |p| + u |p1| + 4 u |q|
(q: each side's rounding, and d an ulp apart where the kernel fuses its multiply-add).
Redoing the step from them (`bound` gives what that leaves against a step from the true state).
"""

from __future__ import annotations

import struct

import torch

from ..update import Work

U = 2.0**-24  # fp32's unit roundoff
# Elements per float64 pass: 1 Mi (8 MiB per temporary) keeps a chunk's few temporaries
# in a 32 MiB L3 rather than streaming 12 passes of the bucket through memory.
CHUNK = 1 << 20


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def coefficients(run, grad_scale: float) -> dict[str, float]:
    """The kernel's fp32 scalars for ``run`` (as ops.adam_kernels.adam_update_unchecked derives
    them in double before they are rounded)."""
    h = run.hyper
    b1, b2 = h["betas"]
    bc1, bc2 = 1.0 - b1**run.step, 1.0 - b2**run.step
    return {"gs": _f32(grad_scale), "decay": _f32(1.0 - h["lr"] * h["weight_decay"]),
            "c": _f32(1.0 - b1), "b2": _f32(b2), "w2": _f32(1.0 - b2),
            "rbc2": _f32(1.0 / bc2**0.5), "eps": _f32(h["eps"]), "ns": _f32(-(h["lr"] / bc1))}


@torch.no_grad()
def undo(work: Work) -> None:
    """The state of ``work``'s bucket back to what it was before ``work`` ran (within the
    bound above), from ``work.grad``, which the step read and which is still there."""
    s = work.bucket.state
    for r in work.runs:
        k = coefficients(r, r.grad_scale)
        for a in range(r.lo, r.hi, CHUNK):
            z = min(r.hi, a + CHUNK)
            _undo(s.master[a:z], s.exp_avg[a:z], s.exp_avg_sq[a:z], work.grad[a:z], k,
                  first=r.step == 1)


def _undo(p, m, v, grad, k, *, first: bool) -> None:
    g = grad.float() * k["gs"]  # fp32 x fp32 scalar: the kernel's own product, bit for bit
    d = v.sqrt().mul_(k["rbc2"]).add_(k["eps"])
    q = (m * k["ns"]).div_(d).double()
    p.copy_(p.double().sub_(q).div_(k["decay"]))
    if first:  # Adam step 1 started from zero moments
        m.zero_()
        v.zero_()
        return
    g64 = g.double()
    m.copy_(m.double().sub_(g64 * k["c"]).div_(1.0 - k["c"]))
    a = (g * k["w2"]).double()  # fl(w2 * g), as the kernel rounds it before the fma
    v.copy_(v.double().sub_(a.mul_(g64)).div_(k["b2"]).clamp_(min=0.0))


def bound(prev: dict, spec: dict, new: dict, g: torch.Tensor, k: dict,
          k_new: dict) -> dict[str, torch.Tensor]:
    """Per element, how far a step redone from the undone state may land from the step from
    the true previous state (first order in u; the derivation is in docs/design.md).
    ``prev`` / ``spec`` / ``new``: the state before, after the speculative step (grad
    ``g``, scaled by ``k``'s gs) and after the true step (``k_new``'s gs); each a dict of
    ``p``, ``m``, ``v`` fp64 tensors."""
    c = k["c"]
    pm, sm, nm = prev["m"].abs(), spec["m"].abs(), new["m"].abs()
    bm = 4 * U * (pm + sm + nm + c * g.abs())
    bv = 4 * U * (prev["v"] + spec["v"] + new["v"])
    d_new = new["v"].sqrt() * k_new["rbc2"] + k_new["eps"]
    q_spec = (spec["m"] * k["ns"]).abs() / (spec["v"].sqrt() * k["rbc2"] + k["eps"])
    q_new = (new["m"] * k_new["ns"]).abs() / d_new
    bp = (6 * U * prev["p"].abs() + U * spec["p"].abs() + 2 * U * new["p"].abs() + 4 * U * q_spec
          + abs(k_new["ns"]) * bm / d_new
          + q_new * (bv / (2 * new["v"].clamp(min=1e-300)) + 10 * U))
    return {"m": bm, "v": bv, "p": bp}


def undo_bound(prev: dict, spec: dict, g: torch.Tensor, k: dict) -> dict[str, torch.Tensor]:
    """Per element, how far `undo` may land from the true previous state ``prev`` (first
    order in u, the module docstring's bounds; fp64 tensors as in `bound`)."""
    c, w2, b2 = k["c"], k["w2"], k["b2"]
    q = (spec["m"] * k["ns"]).abs() / (spec["v"].sqrt() * k["rbc2"] + k["eps"])
    return {"m": U * (c * (g - prev["m"]).abs() + spec["m"].abs()) / (1 - c)
            + U * prev["m"].abs(),
            "v": U * (w2 * g * g + spec["v"]) / b2 + 2 * U * prev["v"],
            "p": 2 * U * prev["p"].abs() + U * spec["p"].abs() + 4 * U * q}
