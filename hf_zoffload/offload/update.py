"""The host update of one bucket: plan its CPU-Adam calls, commit the step counts, run them.

A step schedule (schedules/) plans each bucket when it decides to update it: at ``step()``
(the synchronous and delayed schedules), or as soon as the bucket's gradient has landed
(the overlapped one, during backward). Planning reads the hyperparameters and the params'
Adam step counts and changes nothing: `commit` advances the counts once the step is known
to stand, so a speculative plan that is dropped (an fp16 overflow) leaves no trace. Running
may happen on a background thread, so it reads nothing that the next step could change (the
plan holds its own copy).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from .state import Bucket
from .threads import host_threads


class Run(NamedTuple):
    """One CPU-Adam call: this rank's host elements [lo, hi) of a bucket, whose params share
    a param group and an Adam step count."""

    lo: int
    hi: int
    step: int
    hyper: dict  # the group's lr, betas, eps, weight_decay, read when the step was planned
    grad_scale: float  # 1 / loss scale x clip coefficient


class Work(NamedTuple):
    bucket: Bucket
    grad: torch.Tensor  # the window's gradient of the bucket's shard on the host
    runs: list[Run]
    out: torch.Tensor | None  # host buffer for the new params (`Bucket.out`); None: in place
    present: list[bool]  # which slots got a grad: the window's, copied (a delayed update
    # runs after the engine has started the next window)
    counted: tuple[int, ...]  # param indices whose Adam step count `commit` advances (every
    # present slot, this rank's shard or not: every rank counts every param's steps)


def check_betas(buckets: list[Bucket], param_groups) -> None:
    """Betas changed since the engine was built are refused here, before any update."""
    for fmt in {b.state.fmt for b in buckets}:
        for g in param_groups:
            fmt.check_betas(*g["betas"])


def out_for(b: Bucket, *, in_place: bool) -> torch.Tensor | None:
    """Where the CPU-Adam writes ``b``'s new params: `Bucket.out`, or None for each param's
    own storage (``in_place``: params on the CPU, nothing reading them meanwhile) unless
    the compute dtype is fp32 (the master, or the buffer filled from it, is the output)."""
    out = b.out()
    return None if in_place and out.dtype != torch.float32 else out


def plan(b: Bucket, param_groups, param_steps: dict, grad_scale: float, *,
         out: torch.Tensor | None) -> Work | None:
    """Bucket ``b``'s CPU-Adam calls over the params that got a gradient in this window
    (None: none did), each at its param's next Adam step. Runs outside this rank's shard
    are dropped; ``param_steps`` is read, not changed (`commit`). ``out``: `out_for`."""
    if not any(b.window.present):
        return None
    lay, runs, counted = b.layout, [], []
    for run in lay.runs(b.window.present, lambda s: (s.group, param_steps[s.index])):
        counted.extend(s.index for s in run)
        lo = max(run[0].offset, lay.lo)
        hi = min(run[-1].offset + run[-1].numel, lay.hi)
        if lo < hi:
            g = param_groups[run[0].group]
            runs.append(Run(lo - lay.start, hi - lay.start, param_steps[run[0].index] + 1,
                            {k: v for k, v in g.items() if k != "params"}, grad_scale))
    return Work(b, b.grad(), runs, out, list(b.window.present), tuple(counted))


def commit(work: list[Work], param_steps: dict) -> None:
    """The planned steps stand: advance each counted param's Adam step count."""
    for item in work:
        for i in item.counted:
            param_steps[i] += 1


def forward_order(buckets: list[Bucket]) -> list[Bucket]:
    """The last bucket holds the first layers' params (buckets fill in backward order):
    updating and uploading in this order lets the next forward start first."""
    return list(reversed(buckets))


def run(work: list[Work], *, copier, threads: int, publish=None,
        sr_seed: int = 0) -> tuple[float, float]:
    """Run the planned calls; after each bucket, ``publish(bucket, out)`` if given (async
    on CUDA: it overlaps the next bucket's update). Returns the seconds spent in the CPU-Adam
    and in ``publish``. Every host pass here runs on ``threads`` threads. ``sr_seed``: the
    stochastic rounding's seed of a bf16 master."""
    with host_threads(threads):
        return _run(work, copier=copier, threads=threads, publish=publish, sr_seed=sr_seed)


def _run(work: list[Work], *, copier, threads: int, publish, sr_seed) -> tuple[float, float]:
    t_adam = t_publish = 0.0
    for b, grad, runs, out, present, _ in work:
        copier.of(b).wait_uploaded(b.layout.index)  # its last upload has read `out`
        t0 = time.perf_counter()
        if out is not None:
            b.fill_absent(out, present)
        for r in runs:
            b.updater(b, grad, r, out, threads=threads, sr_seed=sr_seed)
        if out is not None:
            b.fill_from_master(out)  # fp32 compute: the upload reads pinned memory
        t1 = time.perf_counter()
        t_adam += t1 - t0
        if publish is not None:
            publish(b, out)
            t_publish += time.perf_counter() - t1
    return t_adam, t_publish
