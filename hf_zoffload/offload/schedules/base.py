"""`Schedule`: when a step's buckets are planned, updated and published (docs/design.md,
"Step schedules").

The engine holds one schedule, chosen once from the settings (`make_schedule`), and calls it
at fixed points of a step: a backward begins, a bucket's gradient is on its way to the host,
the window's gradients are about to be read, the step, and whenever the state must be
settled (checkpoints, re-layout, ``flush``). What a schedule reads of the engine is `Steps`,
which the engine implements; the update itself is update.py's plan / commit / run.
"""

from __future__ import annotations

import abc
from typing import Protocol

import torch

from ..state import Bucket
from ..update import Work, check_betas, commit, forward_order, out_for, plan, run


class Steps(Protocol):
    """What a schedule reads and calls of the engine (`ZeroOffloadOptimizer` is one)."""

    buckets: list[Bucket]
    host_pool: object  # host.HostPool: landing buffers, also a schedule's second set
    param_groups: list[dict]
    param_steps: dict[int, int]
    copier: object  # copier.Copier
    exchange: object  # exchange.Exchange: `publish` after each bucket's update
    cpu_threads: int
    sr_seed: int
    device: torch.device
    timings: dict[str, float]
    applied_steps: int
    order_settled: bool  # the buckets follow the first backward's order (reorder.py)

    def settle_step(self, overflow: bool, norm: float) -> float | None:
        """The loss scale updated from ``overflow``; the step's grad_scale (1 / loss scale
        x clip coefficient), or None when the step is skipped (fp16 overflow)."""

    def params_written(self) -> None:
        """The params got new values from the host (`params.ParamWatch.note_written`)."""

    def finish_publish(self) -> float:
        """After the last publish of a step; the host seconds it took."""

    def speculation(self) -> tuple[float | None, float]:
        """(limit, inverse loss scale of the window): what an early update assumes. limit:
        None when the step stands whatever the gradient (no fp16 scale, no clipping the
        last step), else the last step's max_norm (0: no clipping, only finiteness)."""


class Schedule(abc.ABC):
    """One step schedule. The engine calls, per window: `begin_backward` at each backward's
    first gradient, `landed` for each bucket the exchange has sent to the host, `end_window`
    before it reads the window's gradients, then `step`; `settle` before anything reads or
    replaces the host state between steps; `close` once."""

    name: str

    def begin_backward(self, eng: Steps, *, final: bool, explicit: bool = False) -> None:
        """A backward starts; ``final``: it ends the accumulation window (sync_gradients);
        ``explicit``: the caller said so (no_sync, accelerate), not the default."""

    def landed(self, eng: Steps, b: Bucket) -> None:
        """Bucket ``b``'s gradient of the current backward was checked and its copy to the
        host queued."""

    def end_backward(self, eng: Steps) -> None:
        """The outermost backward ended (every bucket of it flushed)."""

    def end_window(self, eng: Steps) -> None:
        """Before the engine reads the window's gradients: nothing of this schedule still
        reads or writes them."""

    def took_sum(self, b: Bucket) -> bool:
        """Whether the schedule added ``b``'s last landed gradients to the window's fp32 sum
        already (the engine then does not)."""
        return False

    @abc.abstractmethod
    def step(self, eng: Steps, *, overflow: bool, norm: float) -> None:
        """The step over the window's gradients (unscaled global ``norm``)."""

    def discard(self, eng: Steps) -> None:
        """The window is dropped (``zero_grad``): whatever was updated from it is undone."""

    def reset_window(self) -> None:
        """A new window starts."""

    def settle(self, eng: Steps) -> None:
        """Nothing runs and nothing is pending: the params hold the last step's values and
        the host state is what the applied steps made it."""

    @property
    def in_flight(self) -> bool:
        """An update is running, or its params are not on the device yet."""
        return False

    def stats(self) -> dict[str, float]:
        """Figures of the last step for the step metrics (`ZeroOffloadOptimizer.timings`)."""
        return {}

    def close(self) -> None:
        """The engine is closing: stop whatever runs."""


def plan_all(eng: Steps, grad_scale: float, *, in_place: bool) -> list[Work]:
    """Every bucket's plan at ``grad_scale``, in forward order (`update.forward_order`)."""
    check_betas(eng.buckets, eng.param_groups)
    work = []
    for b in forward_order(eng.buckets):
        item = plan(b, eng.param_groups, eng.param_steps, grad_scale,
                    out=out_for(b, in_place=in_place))
        if item is not None:
            work.append(item)
    return work


def update_now(eng: Steps, grad_scale: float) -> None:
    """Today's step: plan every bucket, run the CPU-Adam bucket by bucket in forward order,
    each bucket's params published as soon as it is done."""
    work = plan_all(eng, grad_scale, in_place=eng.copier.streams.updates_in_place(False))
    commit(work, eng.param_steps)
    eng.timings["cpu_adam"], t_publish = run(
        work, copier=eng.copier, threads=eng.cpu_threads, publish=eng.exchange.publish,
        sr_seed=eng.sr_seed)
    eng.timings["upload_host"] = t_publish + eng.finish_publish()
    eng.params_written()
