"""Runs for the overlapped schedule over N gloo ranks (spawned by `_dp_worker.spawn` as
``"tests.offload._overlap_worker:<function>"``): data parallel over `_dp_worker.Model`,
tensor parallel over `_tp_worker.Model`. Every step accumulates two micro-steps, the first
in ``no_sync()`` (the boundary told, as accelerate's accumulate() tells it), then clips."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from tests.offload import _dp_worker as dpw
from tests.offload import _tp_worker as tpw


def _loop(rank, world, model, opt, forward, *, steps, clip, poison, rows):
    data = dpw.batches(steps * 2)
    k = dpw.ROWS // rows
    part = rank % rows
    inf = {"on": False}
    model.up.weight.register_hook(
        lambda g: g.index_fill(0, torch.tensor([1]), float("inf")) if inf["on"] else g)
    trace = []
    for step in range(steps):
        total = 0.0
        for micro in range(2):
            inf["on"] = (step, rank) in poison and micro == 1
            ids = data[step * 2 + micro][part * k:(part + 1) * k]
            with opt.no_sync() if micro == 0 else _null():
                loss = forward(model, ids, step)
                opt.backward(loss / 2)
            total += loss.item() / 2
        norm = float(opt.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad()
        trace.append((total, norm, opt.last_step_skipped))
    host = [t.clone() for b in opt.buckets
            for t in (b.state.master, b.state.exp_avg, b.state.exp_avg_sq)]
    masters = opt.master_state_dict(model)
    stats = {"hits": getattr(opt.schedule, "hits", None),
             "speculated": getattr(opt.schedule, "speculated", None)}
    dist.barrier()
    return {"trace": trace, "host": host, "masters": masters, "stats": stats}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def dp(rank: int, world: int, *, plugin: dict, steps: int = 4, clip: float = 1e3,
       poison=()) -> dict:
    """Data parallel: each rank its rows, each rank its shard of every bucket."""
    model, opt = dpw.build(bucket_size_mb=0.004, **plugin)

    def forward(m, ids, step):
        return m(ids, extra_rows=0, extra_weight=0.0)

    return _loop(rank, world, model, opt, forward, steps=steps, clip=clip, poison=poison,
                 rows=world)


def tp(rank: int, world: int, *, plugin: dict, steps: int = 4, clip: float = 1e3) -> dict:
    """Tensor parallel over all ranks: the same rows, each rank its local shards."""
    model = tpw.parallelize(tpw.Model(), world)
    opt = ZeroOffloadOptimizer(tpw.decay_groups(model), lr=tpw.LR, plugin=ZeroOffloadPlugin(
        bucket_size_mb=0.004, **plugin))
    model.frozen.to(opt.dtype)

    def forward(m, ids, step):
        return m(ids, extra=False)

    return _loop(rank, world, model, opt, forward, steps=steps, clip=clip, poison=(), rows=1)


def runs(rank: int, world: int, *, jobs: list[tuple[str, dict]]) -> list[dict]:
    """Several runs in one spawn: starting processes costs more than a tiny run."""
    return [globals()[name](rank, world, **kwargs) for name, kwargs in jobs]
