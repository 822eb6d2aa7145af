"""How a complete bucket's gradients reach this rank's host shard, and how new params get back.

`Exchange` is the interface, a docstring per method, with what a one-process mode does as the
defaults; the engine holds one exchange and never asks which. `LocalExchange` is one
process: a bucket's grads are checked and copied to the host whole, and its new params
uploaded. `partitioned.PartitionedExchange` is data parallelism (ZeRO-2 partitioning:
reduce-scatter, all-gather). `tensor_parallel.TensorParallelExchange` wraps either
(`ForwardingExchange`) for DTensor params, each rank's buckets holding its local shards.
"""

from __future__ import annotations

import abc

import torch

from ..copier import Copier
from ..state import Bucket


def whole_params(parts: list) -> list:
    """(slot, [flat tensors]) -> [tensors shaped as the param], where each param is whole
    on this rank (one process, data parallelism)."""
    return [[t.view(s.param.shape) for t in ts] for s, ts in parts]


class Exchange(abc.ABC):
    """The engine's view of a parallel layout, in the order a step calls it. Defaults are
    what one process does: nothing to share, everything already whole on this rank."""

    rank = 0  # which shard of every bucket this rank holds (layout.py)
    world = 1  # how many shards every bucket is cut into
    spans_ranks = False  # the state is spread over ranks: checkpoints are collectives
    params_on_host = False  # the params' 16-bit copy lives on the host (FSDP2's offload)

    copier: Copier  # the engine's, for every copy here

    def attach(self, buckets: list[Bucket], check, pool) -> None:
        """The engine's buckets (again after each re-layout; ``[]`` while it moves them).
        ``check(buf, bucket)`` runs the inf/nan and squared-norm kernel on a buffer of
        ``bucket`` about to leave for the host; ``pool`` is the engine's `host.HostPool`,
        where host buffers that copies touch come from."""
        self.buckets, self.check, self.pool = buckets, check, pool

    def initial_values(self, layout) -> torch.Tensor | None:
        """The values every rank starts ``layout``'s params from, flat fp32 (None: the
        params' own)."""
        return None

    def placed(self) -> None:
        """Every param has its new compute-dtype local tensor (`state.place`), before the
        engine notes the params' storage: a layout that holds its own reference to the
        params' storage re-reads it here."""

    # ------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        """At the first gradient of a backward."""

    def wait_for_grad(self, param: torch.Tensor) -> None:
        """In ``param``'s grad hook, before the engine reads ``param.grad``: wait until
        whatever wrote it has finished (FSDP2's copy to the host, fsdp2.py)."""

    @abc.abstractmethod
    def open(self, b: Bucket) -> None:
        """Give bucket ``b`` a device buffer for this backward (`Window.open`): its hooks
        write (or add) each param's gradient into it."""

    @abc.abstractmethod
    def flush(self, b: Bucket) -> None:
        """``b``'s buffer of this backward is complete (every param arrived, or the
        backward ended): send it on its way to the host (`Window.take_pending`,
        `Window.land`)."""

    def end_backward(self, ended: bool) -> None:
        """Every bucket of a backward is flushed; ``ended``: the outermost backward, not a
        checkpointed block's nested one."""

    # ---------------------------------------------------------------- step
    def end_window(self) -> None:
        """Before the step reads the window's grads: whatever is still to be sent goes."""

    def complete(self) -> None:
        """Finish whatever is in flight (``zero_grad``)."""

    def reset(self) -> None:
        """A new window starts."""

    def share_stats(self, flag: float, sumsq: float, sharded: float = 0.0):
        """(overflow flag, squared norm) the same on every rank: ``sumsq`` of whole
        params' buckets, ``sharded`` of tensor-parallel shards' buckets; also which params
        got a gradient (`Window.set_present`)."""
        return flag, sumsq + sharded

    @abc.abstractmethod
    def publish(self, b: Bucket, src: torch.Tensor | None) -> None:
        """Upload ``b``'s new params after its CPU-Adam from host buffer ``src``
        (`Bucket.out`; None: written into the params in place already), and mark the
        bucket ready (``copier.mark_ready``) once its params are all queued."""

    def finish_publish(self) -> None:
        """After the last `publish` of a step."""

    # ---------------------------------------------------------- checkpoints
    def gather(self, b: Bucket, shards: list[torch.Tensor], *, to: int = 0):
        """Each fp32 host shard of ``shards`` (this rank's part of the bucket: master,
        decoded moments) as the whole bucket on rank ``to``; None on the other ranks."""
        return list(shards)

    def whole_tensors(self, parts: list) -> list:
        """Each (slot, [flat local tensors]) of ``parts`` as tensors shaped as the whole
        param (a collective with tensor parallelism; every rank calls it alike)."""
        return whole_params(parts)

    def keeps_gathered(self, to: int) -> bool:
        """Whether this rank holds the result of `gather(..., to=to)`."""
        return True

    def local_part(self, s, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of slot ``s``'s whole tensor ``t``, flat (no collective): the
        inverse of `whole_tensors`."""
        return t.reshape(-1)

    # ----------------------------------------------------------- re-layout
    def first_rank_order(self, order: list[int]) -> list[int]:
        """The first rank's ``order`` (param indices) on every rank that shares this rank's
        buckets."""
        return list(order)

    def gather_all(self, b: Bucket, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Like `gather`, the whole bucket on each rank that shares the layout."""
        return list(shards)


class LocalExchange(Exchange):
    """One process: every bucket's whole gradient lands in its host state."""

    def __init__(self, copier):
        self.copier = copier
        self.attach([], None, None)

    def open(self, b: Bucket) -> None:
        b.add_last_to_sum(self.copier)  # on the CPU the buffer below is grad16 itself
        g16 = b.state.grads.grad16
        # Zeroed: params that get no grad in this backward keep their place.
        b.window.open(self.copier.device_buffer(b.layout.index, g16.numel(), g16.dtype, lambda: g16,
                                                zero=True))

    def flush(self, b: Bucket) -> None:
        buf = b.window.take_pending()
        self.check(buf, b)
        self.copier.to_host(b.layout.index, b.state.grads.grad16, buf)
        b.window.land(b.state.grads.grad16)

    def publish(self, b: Bucket, src: torch.Tensor | None) -> None:
        if src is not None:  # else the CPU-Adam wrote the params in place already
            self.copier.to_params(b.layout.index, b.layout, src)
            self.copier.mark_ready(b.layout.index)


class ForwardingExchange(Exchange):
    """An exchange that wraps another (``inner``), which moves the grads and params; a
    subclass overrides what it changes. Everything else is ``inner``'s."""

    def __init__(self, inner: Exchange):
        self.inner = inner
        self.rank, self.world = inner.rank, inner.world
        self.spans_ranks = inner.spans_ranks
        self.params_on_host = inner.params_on_host

    @property
    def copier(self):
        return self.inner.copier

    def attach(self, buckets, check, pool) -> None:
        self.buckets = buckets
        self.inner.attach(buckets, check, pool)

    def initial_values(self, layout):
        return self.inner.initial_values(layout)

    def placed(self) -> None:
        self.inner.placed()

    def begin_backward(self) -> None:
        self.inner.begin_backward()

    def wait_for_grad(self, param) -> None:
        self.inner.wait_for_grad(param)

    def open(self, b: Bucket) -> None:
        self.inner.open(b)

    def flush(self, b: Bucket) -> None:
        self.inner.flush(b)

    def end_backward(self, ended: bool) -> None:
        self.inner.end_backward(ended)

    def end_window(self) -> None:
        self.inner.end_window()

    def complete(self) -> None:
        self.inner.complete()

    def reset(self) -> None:
        self.inner.reset()

    def share_stats(self, flag: float, sumsq: float, sharded: float = 0.0):
        return self.inner.share_stats(flag, sumsq, sharded)

    def publish(self, b: Bucket, src) -> None:
        self.inner.publish(b, src)

    def finish_publish(self) -> None:
        self.inner.finish_publish()

    def gather(self, b: Bucket, shards, *, to: int = 0):
        return self.inner.gather(b, shards, to=to)

    def whole_tensors(self, parts: list) -> list:
        return self.inner.whole_tensors(parts)

    def keeps_gathered(self, to: int) -> bool:
        return self.inner.keeps_gathered(to)

    def local_part(self, s, t: torch.Tensor) -> torch.Tensor:
        return self.inner.local_part(s, t)

    def first_rank_order(self, order: list[int]) -> list[int]:
        return self.inner.first_rank_order(order)

    def gather_all(self, b: Bucket, shards):
        return self.inner.gather_all(b, shards)
