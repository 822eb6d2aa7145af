"""The synchronous schedule: at ``step()``, after backward, every bucket is planned, updated
and published in forward order (the default; ZeRO-Offload as the paper describes it)."""

from __future__ import annotations

from .base import Schedule, Steps, update_now


class Synchronous(Schedule):
    name = "synchronous"

    def step(self, eng: Steps, *, overflow: bool, norm: float) -> None:
        grad_scale = eng.settle_step(overflow, norm)
        if grad_scale is not None:
            update_now(eng, grad_scale)
