"""How a complete bucket's gradients reach this rank's host shard, and how new params get back.

`Exchange` is the interface, a docstring per method, with what a one-process mode does as the
defaults; the engine holds one exchange and never asks which. `LocalExchange` is one
process: a bucket's grads are checked and copied to the host whole, and its new params
uploaded. `partitioned.PartitionedExchange` is data parallelism (ZeRO-2 partitioning:
reduce-scatter, all-gather); `fsdp2_offload.Fsdp2Exchange` is FSDP2's sharded host params.

Every exchange holds a `Span`: how the step's numbers and a checkpoint's tensors combine with
the other ranks' (`OneRank` here; the data-parallel group's in partitioned.py; a DTensor
mesh's, which tensor parallelism and FSDP2 share, in mesh.py). resolve.py decides the mode
and builds the exchange with its span.
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


class Span:
    """How this rank's numbers (the step's overflow flag and squared norm, which params got a
    gradient) and its checkpoint tensors combine with the other ranks'. Defaults are one
    rank's: nothing to share, every param whole here."""

    rank = 0  # this rank's place in the span's group (a checkpoint's shell names it)
    spans_ranks = False  # the state is spread over ranks: checkpoints are collectives

    @property
    def sent(self) -> dict[str, int]:
        """Bytes handed to each kind of collective (`collectives.Collectives.sent`)."""
        return {}

    def share_stats(self, buckets: list[Bucket], flag: float, sumsq: float,
                    sharded: float) -> tuple[float, float]:
        """(overflow flag, squared norm) the same on every rank: ``sumsq`` of whole params'
        buckets, ``sharded`` of tensor-parallel shards' buckets; also which params of
        ``buckets`` got a gradient on any rank (`Window.set_present`)."""
        return flag, sumsq + sharded

    def gather_rank(self, to: int) -> int:
        """The rank of the exchange's own group that gathers a bucket's state when rank
        ``to`` of the span saves it (checked here: one error naming the allowed ranks)."""
        return to

    def whole_tensors(self, parts: list) -> list:
        """Each (slot, [flat local tensors]) of ``parts`` as tensors shaped as the whole
        param (a collective over a mesh; every rank calls it alike)."""
        return whole_params(parts)

    def keeps_gathered(self, to: int) -> bool:
        """Whether this rank holds the result of a gather for rank ``to``."""
        return True

    def local_part(self, s, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of slot ``s``'s whole tensor ``t``, flat (no collective): the
        inverse of `whole_tensors`."""
        return t.reshape(-1)


class OneRank(Span):
    """One process: the defaults."""


class Exchange(abc.ABC):
    """The engine's view of a parallel layout, in the order a step calls it. Defaults are
    what one process does: nothing to share, everything already whole on this rank."""

    rank = 0  # which shard of every bucket this rank holds (layout.py)
    world = 1  # how many shards every bucket is cut into
    params_on_host = False  # the params' 16-bit copy lives on the host (FSDP2's offload)

    copier: Copier  # the engine's, for every copy here
    span: Span  # how numbers and checkpoints combine over ranks

    @property
    def spans_ranks(self) -> bool:
        """The state is spread over ranks: checkpoints are collectives."""
        return self.span.spans_ranks

    @property
    def sent(self) -> dict[str, int]:
        """Bytes handed to each kind of collective, this exchange's and its span's."""
        return dict(self.span.sent)

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

    def params_recast(self) -> None:
        """Every param has its new compute-dtype local tensor (`state.state_from_params`),
        before the engine notes the params' storage: a layout that holds its own reference
        to the params' storage re-reads it here."""

    # ------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        """At the first gradient of a backward."""

    def wait_for_grad(self, param: torch.Tensor) -> None:
        """In ``param``'s grad hook, before the engine reads ``param.grad``: wait until
        whatever wrote it has finished (FSDP2's copy to the host, fsdp2_offload.py)."""

    @abc.abstractmethod
    def open(self, b: Bucket) -> None:
        """Give bucket ``b`` a device buffer for this backward (`Window.open`): its hooks
        write (or add) each param's gradient into it."""

    @abc.abstractmethod
    def send(self, b: Bucket) -> None:
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
        """(overflow flag, squared norm) the same on every rank, and which params got a
        gradient on any rank: the span's `Span.share_stats` over the attached buckets."""
        return self.span.share_stats(self.buckets, flag, sumsq, sharded)

    @abc.abstractmethod
    def publish(self, b: Bucket, src: torch.Tensor | None) -> None:
        """Upload ``b``'s new params after its CPU-Adam from host buffer ``src``
        (`Bucket.out`; None: written into the params in place already), and mark the
        bucket ready (``copier.streams.mark_ready``) once its params are all queued."""

    def finish_publish(self) -> None:
        """After the last `publish` of a step."""

    # ---------------------------------------------------------- checkpoints
    def gather(self, b: Bucket, shards: list[torch.Tensor], *, to: int = 0):
        """Each fp32 host shard of ``shards`` (this rank's part of the bucket: master,
        decoded moments) as the whole bucket of local tensors on the exchange's group rank
        that the span's rank ``to`` saves from (`Span.gather_rank`); None on the other
        ranks. Then `Span.whole_tensors` makes whole params of them."""
        return self.gather_shards(b, shards, to=self.span.gather_rank(to))

    def gather_shards(self, b: Bucket, shards: list[torch.Tensor], *, to: int):
        """`gather` within the exchange's own group (rank ``to`` of it)."""
        return list(shards)

    # ----------------------------------------------------------- re-layout
    def first_rank_order(self, order: list[int]) -> list[int]:
        """The first rank's ``order`` (param indices) on every rank that shares this rank's
        buckets."""
        return list(order)

    def gather_all(self, b: Bucket, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Like `gather`, the whole bucket on each rank that shares the layout."""
        return list(shards)


class LocalExchange(Exchange):
    """One process (or one per shard of a mesh, ``span``): every bucket's whole gradient
    lands in its host state."""

    def __init__(self, copier, *, span: Span | None = None):
        self.copier = copier
        self.span = OneRank() if span is None else span
        self.attach([], None, None)

    def open(self, b: Bucket) -> None:
        t = self.copier.of(b)
        b.add_last_to_sum(t)  # on the CPU the buffer below is grad16 itself
        g16 = b.state.grads.grad16
        # Zeroed: params that get no grad in this backward keep their values.
        b.window.open(t.device_buffer(b.layout.index, g16.numel(), g16.dtype, lambda: g16,
                                      zero=True))

    def send(self, b: Bucket) -> None:
        buf = b.window.take_pending()
        self.check(buf, b)
        self.copier.of(b).to_host(b.layout.index, b.state.grads.grad16, buf)
        b.window.land(b.state.grads.grad16)

    def publish(self, b: Bucket, src: torch.Tensor | None) -> None:
        if src is not None:  # else the CPU-Adam wrote the params in place already
            self.copier.of(b).to_params(b.layout.index, b.layout, src)
            self.copier.streams.mark_ready(b.layout.index)
