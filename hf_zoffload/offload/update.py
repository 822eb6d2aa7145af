"""The host update of one step: plan the CPU-Adam calls, then run them bucket by bucket.

Planning reads the hyperparameters and advances every param's Adam step count on the
caller's thread, at ``step()``; running may happen on the delayed update's thread, so it
reads nothing that the next step could change (the plan holds its own copy).
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


def plan(buckets: list[Bucket], param_groups, param_steps: dict, grad_scale: float, *,
         in_place: bool) -> list[Work]:
    """The step's CPU-Adam calls over the params that got a gradient in this window, bucket
    by bucket in forward order. Runs
    outside this rank's shard are dropped, but every rank counts every param's steps
    (``param_steps`` is advanced here). ``in_place``: the CPU-Adam writes the new 16-bit
    values into the params' own storage (params on the CPU, no delayed update)."""
    for fmt in {b.state.fmt for b in buckets}:
        for g in param_groups:  # betas changed since the engine was built: refused here
            fmt.check_betas(*g["betas"])
    work = []
    # Forward order: the last bucket holds the first layers' params (buckets fill in
    # backward order), so their uploads finish first and the next forward can start.
    for b in reversed(buckets):
        if not any(b.window.present):
            continue
        lay, runs = b.layout, []
        for run in lay.runs(b.window.present, lambda s: (s.group, param_steps[s.index])):
            for s in run:
                param_steps[s.index] += 1
            lo = max(run[0].offset, lay.lo)
            hi = min(run[-1].offset + run[-1].numel, lay.hi)
            if lo < hi:
                g = param_groups[run[0].group]
                runs.append(Run(lo - lay.start, hi - lay.start, param_steps[run[0].index],
                                {k: v for k, v in g.items() if k != "params"}, grad_scale))
        out = b.out()
        work.append(Work(b, b.grad(), runs,
                         None if in_place and out.dtype != torch.float32 else out,
                         list(b.window.present)))
    return work


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
    for b, grad, runs, out, present in work:
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
