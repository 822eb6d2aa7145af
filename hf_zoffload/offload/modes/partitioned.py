"""Data-parallel ZeRO-Offload: each rank owns 1/N of every bucket's host state (ZeRO-2).

Each rank holds the master weights, both moments and the gradient buffers of its shard only
(layout.py): 12/N B/param of optimizer state instead of 12. The padding (< N elements per
bucket) belongs to no param: it stays 0 and no update touches it. The protocol, the byte
counts and the accumulation rules: docs/design.md, "Data-parallel protocol".

Every rank builds the engine over the same params, on a model with no DDP wrapper
(support.check_model), and must run the same sequence of backward / step / state_dict calls.

AVG rather than SUM with 1/N folded into the CPU-Adam's grad_scale: NCCL implements AVG on
floats as a multiply by 1/N before the sum, so an fp16 sum of N loss-scaled grads cannot
overflow where their mean would not; the check then sees the very gradient the update uses
(no 1/N^2 correction of the norm) and there is no extra pass. gloo in torch 2.13 does AVG
for fp32/fp16/bf16 (checked with two processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..host import HostPool
from ..state import Bucket
from .collectives import Collectives, wants_sync
from .exchange import Exchange, Span


@dataclass(eq=False)
class _Unreduced:
    """A bucket's micro-steps that no collective has reduced yet (full bucket, this rank's
    own gradients), allocated on first use."""

    grad16: torch.Tensor | None = None  # compute dtype: the latest unreduced backward
    acc: torch.Tensor | None = None  # fp32 sum of the earlier ones
    count: int = 0  # unreduced backwards held in grad16 / acc
    round: int = -1  # the last reduction round this bucket was submitted in


@dataclass(eq=False)
class _Reduction:
    """A reduce-scatter in flight: what to check and land once it completes."""

    bucket: Bucket
    work: object
    inp: torch.Tensor
    out: torch.Tensor
    landing: torch.Tensor


class _Gather(NamedTuple):
    """An all-gather of a bucket's new params in flight: ``flat`` fills from every rank."""

    bucket: Bucket
    work: object
    flat: torch.Tensor


class GroupSpan(Span):
    """The data-parallel group's span: every rank holds every param whole (its shard of the
    state aside), so the step's numbers are one all-reduce over the group and a gathered
    bucket is whole on the rank it was gathered to."""

    spans_ranks = True

    def __init__(self, coll: Collectives):
        self.coll, self.rank = coll, coll.rank

    @property
    def sent(self) -> dict[str, int]:
        return self.coll.sent

    def share_stats(self, buckets, flag: float, sumsq: float, sharded: float):
        """The step's one small collective: the overflow flag and the sum of squares over
        all shards, and which params got a grad on any rank (those step, on every rank)."""
        seen = [float(x) for b in buckets for x in b.window.present]
        flag, sumsq, *seen = self.coll.all_reduce_sum(
            [flag, sumsq + sharded, *seen], "all-reduce of the overflow flag and gradient norm")
        it = iter(seen)
        for b in buckets:
            b.window.set_present([next(it) > 0 for _ in b.layout.slots])
        return flag, sumsq

    def keeps_gathered(self, to: int) -> bool:
        return self.rank == to


class PartitionedExchange(Exchange):
    """The exchange over a process group of N ranks.

    The accumulation boundary: a backward reduces gradients across ranks only when
    `collectives.wants_sync` says so. The flag decides when bytes move, never
    the result: any mix of synchronized and unsynchronized backwards gives the same
    gradient, and the step reduces whatever is still unreduced.
    """

    def __init__(self, group, *, device: torch.device, copier, dtype: torch.dtype,
                 engine_sync, pool: HostPool | None = None, span: Span | None = None):
        self.coll = Collectives(group, device=device)
        self.rank, self.world = self.coll.rank, self.coll.world
        # the group's own, or a mesh's over every rank (tensor parallelism: mesh.py)
        self.span = GroupSpan(self.coll) if span is None else span
        self.copier = copier
        self.pool = pool  # the engine's; set by attach at the latest
        self.dtype = dtype
        self._engine_sync = engine_sync  # () -> True / False / None (automatic)
        # gloo runs a collective on its own thread and only `wait()` blocks the host: wait
        # as late as possible, so the reduce-scatters overlap the rest of backward. NCCL's
        # wait() only orders streams: issuing it at once costs the host nothing.
        self.defer = device.type == "cpu"
        self.buckets: list[Bucket] = []
        self.check = None
        self._unreduced: dict[int, _Unreduced] = {}
        self._sync, self._unsynced, self._round = True, False, 0
        self._ready: dict[int, _Reduction] = {}
        self._next = 0
        self._inflight: list[_Reduction] = []
        self._gathers: list[_Gather] = []

    @property
    def sent(self) -> dict[str, int]:
        out = dict(self.coll.sent)
        if self.span.sent is not self.coll.sent:  # a mesh span's own collectives
            for k, v in self.span.sent.items():
                out[k] = out.get(k, 0) + v
        return out

    def attach(self, buckets: list[Bucket], check, pool: HostPool) -> None:
        self.buckets, self.check, self.pool = buckets, check, pool
        self._unreduced = {b.layout.index: _Unreduced() for b in buckets}

    def initial_values(self, layout) -> torch.Tensor:
        """The bucket's params as rank 0 has them, flat fp32 (exact for fp32/bf16/fp16
        params): every rank starts from the same values, as DDP makes sure. Frozen params
        and buffers are left to the caller."""
        flat = torch.zeros(layout.padded, dtype=torch.float32, device=self.coll.device)
        for s in layout.slots:
            flat[s.offset:s.offset + s.numel].copy_(s.local().reshape(-1))
        self.coll.broadcast_from_first(flat, f"broadcast of bucket {layout.index}'s initial "
                                             "params")
        return flat

    # ------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        self._sync = wants_sync(self._engine_sync())  # one decision per backward
        if self._sync:
            self._begin_round()
        else:
            self._unsynced = True

    def _begin_round(self) -> None:
        """A reduction round: every bucket is submitted once, launched in index order."""
        if self._ready:
            raise RuntimeError("internal: a reduction round started before the last ended")
        self._round += 1
        self._next = 0

    def _host16(self, b: Bucket) -> torch.Tensor:
        u = self._unreduced[b.layout.index]
        if u.grad16 is None:
            u.grad16 = self.pool.get(("unreduced16",), b.layout.index, self.dtype, full=True)
        return u.grad16

    def open(self, b: Bucket) -> None:
        self._complete(b)  # this bucket's last reduction no longer reads its buffers
        t = self.copier.of(b)
        t.wait_landed(b.layout.index)
        u, w = self._unreduced[b.layout.index], b.window
        if u.count:  # fold the unreduced micro-steps held on the host into their fp32 sum
            if u.acc is None:
                u.acc = self.pool.get(("unreduced32",), b.layout.index, torch.float32,
                                      full=True)
            (u.acc.copy_ if u.count == 1 else u.acc.add_)(u.grad16)
        if self._sync and u.count:  # this backward's grads are added to the sum, in fp32
            w.open(t.to_device(b.layout.index, u.acc), adds_to_sum=True)
            u.count = 0
        else:  # the whole (padded) bucket; on the CPU the unreduced host buffer itself
            w.open(t.device_buffer(b.layout.index, b.layout.padded, self.dtype,
                                   lambda: self._host16(b), zero=True))

    def send(self, b: Bucket) -> None:
        buf = b.window.take_pending()
        u = self._unreduced[b.layout.index]
        if not self._sync:  # no collective: the full unreduced bucket goes to the host
            self.copier.of(b).to_host(b.layout.index, self._host16(b), buf)
            u.count += 1
            return
        g = b.state.grads
        if buf.dtype != self.dtype:  # an fp32 sum over micro-steps lands in fp32
            if g.grad32 is None:
                g.grad32 = self.pool.get(("grad32", g.which), b.layout.index, torch.float32)
            landing = g.grad32
        else:
            landing = g.grad16
        self._complete(b)
        b.add_last_to_sum(self.copier.of(b))  # an earlier reduced micro-step joins the sum
        self._ready[b.layout.index] = _Reduction(b, None, buf, None, landing)
        while self._next in self._ready:  # launch in bucket order, whatever completed first
            self._launch(self._ready.pop(self._next))
            self._next += 1
        b.window.land(landing)
        u.round = self._round
        self._complete_finished()

    def _complete_finished(self) -> None:
        """Land the deferred reductions gloo has finished, in launch order (the order the
        norm sums them in): an overlapped step starts on them during backward."""
        while self._inflight and self._inflight[0].work.is_completed():
            self._finish(self._inflight.pop(0))

    def _launch(self, r: _Reduction) -> None:
        idx = r.bucket.layout.index
        r.out = self.copier.of(r.bucket).device_buffer(idx, r.landing.numel(), r.landing.dtype,
                                                       lambda: r.landing, zero=False)
        r.work = self.coll.reduce_scatter_avg(r.out, r.inp, f"reduce-scatter of bucket {idx}")
        if self.defer:
            self._inflight.append(r)
        else:
            self._finish(r)

    def _finish(self, r: _Reduction) -> None:
        """Check the reduced shard and land it; on CUDA all of it queues on the side stream,
        so neither the host nor the rest of backward waits for the collective."""
        idx = r.bucket.layout.index
        with self.coll.guard(f"reduce-scatter of bucket {idx}"), self.copier.streams.side():
            r.work.wait()  # CUDA: the side stream (not the host) waits for the collective
            self.check(r.out, r.bucket)
        self.copier.of(r.bucket).to_host(idx, r.landing, r.out, r.inp)

    def _complete(self, b: Bucket | None = None) -> None:
        """Finish the deferred reductions of bucket ``b`` (of all buckets when None)."""
        keep = []
        for r in self._inflight:
            if b is None or r.bucket is b:
                self._finish(r)
            else:
                keep.append(r)
        self._inflight = keep

    def _reduce_rest(self) -> None:
        """Submit every bucket not yet reduced in this round, in order: another rank may
        hold grads for a bucket this rank did not touch (zeros from here, then)."""
        for b in self.buckets:
            if self._unreduced[b.layout.index].round != self._round:
                self.open(b)
                self.send(b)
        self._unsynced = False

    def end_backward(self, ended: bool) -> None:
        if ended and self._sync:
            self._reduce_rest()

    # ---------------------------------------------------------------- step
    def end_window(self) -> None:
        if self._unsynced:  # the window ended without a synchronizing backward
            self._sync = True
            self._begin_round()
            self._reduce_rest()
        self._complete()

    def complete(self) -> None:
        self._complete()

    def reset(self) -> None:
        """A new window: micro-steps not yet reduced are discarded with it."""
        for u in self._unreduced.values():
            u.count = 0
        self._unsynced = False

    def publish(self, b: Bucket, src: torch.Tensor | None) -> None:
        """Upload this rank's new shard into its slice of a transient flat device bucket,
        which an all-gather (in place) fills from every rank; `finish_publish` copies it out
        to the params. Transient because each param keeps its own storage (layout.py). At
        most two gathers stay in flight (the transient buffers then cost about two buckets,
        not a copy of the model): on CUDA finishing one only queues work on the side
        stream; with gloo it still overlaps the CPU-Adam of the next bucket."""
        lay = b.layout
        flat = self.copier.streams.side_buffer(lay.padded, self.dtype)
        own = flat[lay.start:lay.start + lay.shard]
        if src is None:  # the params hold this rank's new values already (written in place)
            own.zero_()
            lay.copy_from_params(own, lay.start)
        else:  # the whole shard, padding included
            self.copier.of(b).to_flat(lay.index, own, src)
        with self.copier.streams.side():
            work = self.coll.all_gather(flat, own, f"all-gather of bucket {lay.index}")
        self._gathers.append(_Gather(b, work, flat))
        if len(self._gathers) > 2:
            self._copy_out([self._gathers.pop(0)])

    def finish_publish(self) -> None:
        gathers, self._gathers = self._gathers, []
        self._copy_out(gathers)

    def _copy_out(self, gathers) -> None:
        """Finish all-gathers and copy every slot out of its flat buffer to its param. On
        CUDA all of it queues on the side stream: `wait()` makes that stream wait for the
        collective, so the buffer is complete before the copies read it. Every slot is
        copied, also those that got no grad: each rank's shard holds their current values
        (`Bucket.fill_absent`), so those params get their own values back."""
        streams = self.copier.streams
        with streams.side(), self.coll.guard("all-gather of the updated params"):
            for b, work, flat in gathers:
                work.wait()
                b.layout.copy_to_params(flat, 0)
                streams.mark_ready(b.layout.index)

    # ---------------------------------------------------------- checkpoints
    def gather_shards(self, b: Bucket, shards: list[torch.Tensor], *, to: int):
        """Each of ``shards`` (this rank's fp32 host shards of the bucket) as the whole
        (padded) bucket on rank ``to``, CPU tensors; None on the other ranks. One bucket at
        a time, so the extra memory is 4 B x one bucket per shard (on the device with NCCL)."""
        local = torch.stack(shards).to(self.coll.device)
        parts = self.coll.gather_to(local, to, f"gather of bucket {b.layout.index}'s "
                                               f"optimizer state to rank {to}")
        return list(torch.cat(parts, dim=1).cpu()) if parts is not None else None

    def gather_all(self, b: Bucket, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of ``shards`` as the whole (padded) bucket on every rank, CPU tensors."""
        local = torch.stack(shards).to(self.coll.device)  # (kinds, shard)
        out = torch.empty((self.world, *local.shape), dtype=local.dtype, device=local.device)
        what = f"all-gather of bucket {b.layout.index}'s optimizer state"
        work = self.coll.all_gather(out.view(-1), local.view(-1), what)
        with self.coll.guard(what):
            work.wait()
        return list(out.transpose(0, 1).reshape(len(shards), -1).cpu())

    def first_rank_order(self, order: list[int]) -> list[int]:
        t = torch.tensor(order, dtype=torch.int64, device=self.coll.device)
        self.coll.broadcast_from_first(t, "broadcast of the bucket order")
        return t.tolist()

