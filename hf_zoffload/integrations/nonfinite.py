"""The non-finite stop: a run whose loss or gradient norm has been non-finite for
``max_nonfinite_steps`` consecutive optimizer steps stops with one error naming the first bad
step, in any precision; the Trainer saves no checkpoint from that step on, so rotation
(``save_total_limit``) never deletes the last finite one.

Why: in bf16 and fp32 the engine applies a non-finite gradient as any AdamW does, so from the
first bad step the masters are non-finite and every later step is too; the Trainer logs such
losses as the last finite mean (``logging_nan_inf_filter``), the run exits 0, and its saves
hold NaN. fp16's overflow skips are the loss scaler's: a skipped step leaves the masters as
they were, so an overflow counts here only once the scale is at its floor (``min_scale``: it
can back off no further), or when the loss itself is non-finite.

What is watched, per optimizer step: the engine's global gradient norm (the same on every
rank: the engine's step all-reduces it), and in the Trainer each micro-step's loss
(`observe_loss`, a device flag read once per step and, with several ranks, all-reduced, so
that every rank stops at the same step).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["NonFiniteError", "NonFiniteStop"]


class NonFiniteError(FloatingPointError):
    """The run stopped: its loss or gradient norm was non-finite too many steps running."""


class NonFiniteStop:
    """Counts consecutive non-finite optimizer steps and stops the run at ``limit`` (0: never).

    ``step_number()`` gives the number of the step being taken, as the user sees it (the
    Trainer's ``global_step + 1``); by default the steps this object has seen."""

    def __init__(self, limit: int, step_number: Callable[[], int] | None = None):
        self.limit = int(limit)
        self.step_number = step_number
        self.seen = 0
        self.first_bad: int | None = None
        self.first_what = ""
        self.streak = 0
        self._loss_bad: torch.Tensor | None = None  # any micro-step's loss non-finite

    def observe_loss(self, loss: torch.Tensor) -> None:
        """One micro-step's loss; no device sync (read once, at the step)."""
        if not self.limit or not isinstance(loss, torch.Tensor):
            return
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def after_step(self, engine) -> None:
        """Judge the step ``engine`` has just taken; raise `NonFiniteError` at the limit."""
        self.seen += 1
        if not self.limit:
            return
        step = self.step_number() if self.step_number is not None else self.seen
        loss_bad = self._take_loss_flag()
        norm = engine.grad_norm
        scaler = engine.loss_scaler
        norm_bad = norm is not None and not math.isfinite(norm)
        if norm_bad and engine.last_step_skipped and scaler.loss_scale > scaler.min_scale:
            norm_bad = False  # an fp16 overflow the scaler can still back off from
        if not (loss_bad or norm_bad):
            self.streak, self.first_bad = 0, None
            return
        if self.streak == 0:
            self.first_bad = step
            self.first_what = ", ".join(
                [w for w, b in (("a non-finite loss", loss_bad),
                                (f"grad_norm {norm}", norm_bad)) if b])
        self.streak += 1
        if self.streak >= self.limit:
            raise NonFiniteError(
                f"ZeRO-Offload: {self.streak} consecutive optimizer steps with a non-finite "
                f"loss or gradient norm, from step {self.first_bad} ({self.first_what}); "
                f"stopped at step {step} (max_nonfinite_steps={self.limit}), with no checkpoint "
                f"saved from step {self.first_bad} on. Resume from the last checkpoint with a "
                "lower learning rate, or check the data and the model around that step")

    @property
    def in_streak(self) -> bool:
        """A non-finite step was the last one taken: what a save now would hold is suspect."""
        return self.streak > 0

    def _take_loss_flag(self) -> bool:
        flag, self._loss_bad = self._loss_bad, None
        if flag is None:
            return False
        flag = flag.to(torch.int32)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        return bool(flag.item())
