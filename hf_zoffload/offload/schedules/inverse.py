"""Undo one CPU-Adam step over fp32 state, from the gradient it read: the overlapped
schedule's correction (docs/protocols/step.md, "The correction bound").

The kernel's step (cython_ext/adam_kernel_body.h, AdamW, fp32 master and moments), with
``g = fl(grad * grad_scale)``, ``c = fl(1 - beta1)``, ``w2 = fl(1 - beta2)``:

    m1 = fma(c, g - m, m)                 v1 = fma(fl(w2 * g), g, fl(beta2 * v))
    d  = sqrt(v1) * rbc2 + eps            p1 = fl(p * decay) + fl(ns * m1) / d

Rounding loses information, so the inverse is not exact: `undo` computes (the compiled pass
of ops.adam_undo, bitwise its torch reference `undo_reference`), in float64 from the fp32
values and rounded once to fp32,

    q = fl32(ns * m1) / fl32(d)   (as the kernel)      p = (p1 - q) / decay
    m = (m1 - c g) / (1 - c)                           v = max(0, (v1 - fl(w2 g) g) / beta2)

(each division a multiplication by the divisor's reciprocal rounded in double: a relative
2^-52 at most, 2^-28 of u, inside the bounds below), and at Adam step 1 the moments were zero:
m = v = 0 exactly. With u = 2^-24, to first order:
|m~ - m| <= u (c |g - m| + |m1|) / (1 - c) + u |m|,
|v~ - v| <= u (w2 g^2 + v1) / beta2 + 2 u v, |p~ - p| <= 2 u |p| + u |p1| + 4 u |q|
(q: each side's rounding, and d an ulp apart where the kernel fuses its multiply-add).
Redoing the step from them (`bound` gives what that leaves against a step from the true state).
"""

from __future__ import annotations

import torch

from ...ops.adam_undo import adam_undo_unchecked, undo_coefficients, undo_reference_unchecked
from ..update import Work

U = 2.0**-24  # fp32's unit roundoff


def coefficients(run, grad_scale: float) -> dict[str, float]:
    """The kernel's fp32 scalars for ``run`` and the undo's double reciprocals
    (`ops.adam_undo.undo_coefficients`)."""
    h = run.hyper
    return undo_coefficients(run.step, h["lr"], *h["betas"], h["eps"], h["weight_decay"],
                             grad_scale)


def undo(work: Work, *, threads: int | None = None) -> None:
    """The state of ``work``'s bucket back to what it was before ``work`` ran (within the
    bound above), from ``work.grad``, which the step read and which is still there: one
    compiled pass per run on ``threads`` threads (None: torch's count, which the schedule's
    `host_threads` sets)."""
    s = work.bucket.state
    for r in work.runs:
        adam_undo_unchecked(s.master[r.lo:r.hi], work.grad[r.lo:r.hi], s.exp_avg[r.lo:r.hi],
                            s.exp_avg_sq[r.lo:r.hi], coefficients(r, r.grad_scale),
                            first=r.step == 1, num_threads=threads)


def undo_reference(work: Work) -> None:
    """`undo` in torch ops (float64 passes over chunks of each run), bitwise the same."""
    s = work.bucket.state
    for r in work.runs:
        undo_reference_unchecked(s.master[r.lo:r.hi], work.grad[r.lo:r.hi],
                                 s.exp_avg[r.lo:r.hi], s.exp_avg_sq[r.lo:r.hi],
                                 coefficients(r, r.grad_scale), first=r.step == 1)


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
