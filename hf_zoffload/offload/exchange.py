"""How a complete bucket's gradients reach this rank's host shard, and how new params get back.

The engine holds one exchange and never asks which. `LocalExchange` is one process: a
bucket's grads are checked and copied to the host whole, and its new params uploaded.
`partitioned.PartitionedExchange` is data parallelism (ZeRO-2 partitioning: reduce-scatter,
all-gather). `tensor_parallel.TensorParallelExchange` wraps either for DTensor params (each
rank's buckets hold its local shards). The interface, in the order a step calls it:

- ``rank``, ``world``: which shard of every bucket this rank holds (layout.py);
  ``spans_ranks``: whether the state is spread over ranks (checkpoints are collectives);
  ``initial_values(layout)``: the values every rank starts from (None: the params' own);
  ``attach(buckets, check, pool)`` once the buckets exist (``check(buf, bucket)`` runs the
  inf/nan and squared-norm kernel on a buffer of ``bucket`` about to leave for the host;
  ``pool`` is the engine's `host.HostPool`, where host buffers that copies touch come from).
- ``begin_backward()`` at the first gradient of a backward; ``open(b)`` gives the bucket a
  device buffer (``b.window.pending``) its hooks write into; ``flush(b)`` sends a complete
  one on its way; ``end_backward(ended)`` after every bucket of a backward is flushed.
- ``end_window()`` before a step reads the window's grads; ``complete()`` finishes whatever
  is in flight (``zero_grad``); ``reset()`` starts a new window; ``share_stats(flag,
  sumsq, sharded)`` makes the overflow flag, the squared norm (``sumsq`` of whole params'
  buckets, ``sharded`` of tensor-parallel shards' buckets) and which params got a gradient
  the same on every rank.
- ``publish(b, src)`` uploads a bucket's new params after its CPU-Adam from host buffer
  ``src`` (`Bucket.out`; None: written into the params in place already), and marks the
  bucket ready (``copier.mark_ready``) once its params are all queued; ``finish_publish()``
  after the last one.
- ``gather(b, shards, to)``: each fp32 host shard of ``shards`` (this rank's part of the
  bucket: master, decoded moments) as the whole bucket on rank ``to`` (None elsewhere), for
  checkpoints and the full-precision weights; ``whole(parts)`` then makes each (slot, [flat
  local tensors]) of ``parts`` whole params (a collective with tensor parallelism),
  ``receives(to)`` says whether this rank gets the result, ``local_part(slot, t)`` is the inverse of
  ``whole``: this rank's part of a whole tensor, flat (no collective).
- ``agree(order)``: the first rank's list of ints on every rank that shares this rank's
  buckets; ``gather_all(b, shards)``: like ``gather``, the whole bucket on each of those
  ranks (reorder.py moves the host state between buckets with them).
"""

from __future__ import annotations

import torch

from .state import Bucket


def whole_params(parts: list) -> list:
    """(slot, [flat tensors]) -> [tensors shaped as the param], where each param is whole
    on this rank (one process, data parallelism)."""
    return [[t.view(s.param.shape) for t in ts] for s, ts in parts]


def local_flat(s, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of whole tensor ``t`` of slot ``s``'s param, flat: all of it."""
    return t.reshape(-1)


class LocalExchange:
    """One process: every bucket's whole gradient lands in its host state."""

    rank, world = 0, 1
    spans_ranks = False  # state_dict() needs no collective

    def __init__(self, copier):
        self.copier = copier
        self.buckets: list[Bucket] = []
        self.check = None

    def attach(self, buckets: list[Bucket], check, pool) -> None:
        self.buckets, self.check = buckets, check

    def initial_values(self, layout) -> torch.Tensor | None:
        return None

    def begin_backward(self) -> None:
        pass

    def open(self, b: Bucket) -> None:
        b.fold(self.copier)  # on the CPU the buffer below is grad16 itself: fold it first
        g16 = b.state.grads.grad16
        # Zeroed: params that get no grad in this backward keep their place.
        b.window.pending = self.copier.twin(g16.numel(), g16.dtype, lambda: g16, zero=True)
        b.window.last = g16

    def flush(self, b: Bucket) -> None:
        buf = b.window.take_pending()
        self.check(buf, b)
        self.copier.to_host(b.layout.index, b.state.grads.grad16, buf)
        b.window.landed += 1

    def end_backward(self, ended: bool) -> None:
        pass

    def end_window(self) -> None:
        pass

    def complete(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def share_stats(self, flag: float, sumsq: float, sharded: float = 0.0):
        return flag, sumsq + sharded

    def publish(self, b: Bucket, src: torch.Tensor | None) -> None:
        if src is not None:  # else the CPU-Adam wrote the params in place already
            self.copier.to_params(b.layout.index, b.layout, src)
            self.copier.mark_ready(b.layout.index)

    def finish_publish(self) -> None:
        pass

    def gather(self, b: Bucket, shards: list[torch.Tensor], *, to: int = 0):
        return list(shards)

    def gather_all(self, b: Bucket, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(shards)

    def agree(self, order: list[int]) -> list[int]:
        return list(order)

    whole = staticmethod(whole_params)
    local_part = staticmethod(local_flat)

    def receives(self, to: int) -> bool:
        return True

