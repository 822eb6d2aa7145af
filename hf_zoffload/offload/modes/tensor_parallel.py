"""Tensor parallelism (DTensor params) with ZeRO-Offload, and the choice of the exchange.

Each rank's buckets hold its local tensors: a sharded param's local shard, a replicated
param (plain, or a Replicate DTensor) whole. `TensorParallelExchange` wraps the exchange of
one process, or of data parallelism over the ranks that hold the same shards (``inner``), and
changes only what spans the tensor-parallel ranks: the step's one all-reduce runs over every
rank, and checkpoints hold whole tensors (loading takes this rank's part). `make_exchange`
chooses the engine's exchange from the params and the process group. The protocol (why the
grads are complete, how the norm counts shards and replicated params, why replicated params
need no collective): see docs/design.md, "Tensor-parallel protocol".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..state import Bucket
from .collectives import Collectives, resolve_group
from .exchange import Exchange, ForwardingExchange, LocalExchange
from .partitioned import PartitionedExchange
from .partitioned import make_exchange as make_plain_exchange


class TensorParallelExchange(ForwardingExchange):
    """The exchange for DTensor params: ``inner`` (one process per shard, or data parallel
    over ``inner``'s group) moves the grads and params; this adds the numbers that span the
    ``tp`` tensor-parallel ranks, over ``stats_group`` (every rank)."""

    def __init__(self, inner: Exchange, *, mesh, tp: int, stats_group, device: torch.device):
        super().__init__(inner)
        self.spans_ranks = True  # the shards are gathered over the tensor-parallel ranks
        self.mesh, self.tp = mesh, tp
        self.coll = Collectives(stats_group, device=device)
        self.buckets: list[Bucket] = []
        self._to = 0  # the rank the last `gather` was for: `whole_tensors` keeps them there

    @property
    def sent(self) -> dict[str, int]:
        out = dict(getattr(self.inner, "sent", {}))
        for k, v in self.coll.sent.items():
            out[k] = out.get(k, 0) + v
        return out

    # what spans the tensor-parallel ranks
    def share_stats(self, flag: float, sumsq: float, sharded: float = 0.0):
        """One all-reduce over every rank. ``sumsq`` (whole params) is on every
        tensor-parallel rank alike: divided by ``tp`` it adds up to one copy (exact in
        float64 for a power-of-two ``tp``; else within 1 ulp of float64)."""
        slots = sorted(((s, b, i) for b in self.buckets for i, s in enumerate(b.layout.slots)),
                       key=lambda x: x[0].index)
        seen = [float(b.window.present[i]) for _, b, i in slots]
        flag, total, *seen = self.coll.all_reduce_sum(
            [flag, sharded + sumsq / self.tp, *seen],
            "all-reduce of the overflow flag and gradient norm over the tensor-parallel ranks")
        present = {id(b): list(b.window.present) for b in self.buckets}
        for (_, b, i), got in zip(slots, seen):
            present[id(b)][i] = got > 0
        for b in self.buckets:
            b.window.set_present(present[id(b)])
        return flag, total

    def gather(self, b: Bucket, shards: list[torch.Tensor], *, to: int = 0):
        """This rank's local tensors' state, whole over the data-parallel ranks, on the
        first data-parallel rank of each shard (those ranks form one tensor-parallel group,
        which `whole_tensors` then gathers over); None elsewhere."""
        if not 0 <= to < self.tp:
            raise ValueError(f"with tensor parallelism the state is gathered on one of the "
                             f"first data-parallel rank's {self.tp} tensor-parallel ranks; "
                             f"got to={to}")
        self._to = to
        return self.inner.gather(b, shards, to=0)

    def whole_tensors(self, parts: list) -> list:
        """(slot, [flat local tensors]) in param-index order (the same on every rank) ->
        the whole tensors (CPU) on the rank the last `gather` was for. The other ranks of
        the tensor-parallel group take part in each all-gather and keep an empty tensor for
        each sharded one (their callers return nothing), so that no rank but the saving one
        holds the whole state (12 B per param of the model, fp32)."""
        keep, out = self.keeps_gathered(self._to), []
        with self.coll.guard("all-gather of the tensor-parallel shards of the optimizer "
                             "state"):
            for s, ts in parts:
                p = s.param
                if not isinstance(p, DTensor):
                    out.append([t.view(p.shape) for t in ts])
                    continue
                dev = p.device_mesh.device_type
                shape = s.local().shape
                full = (DTensor.from_local(t.view(shape).to(dev), p.device_mesh, p.placements,
                                           run_check=False, shape=p.shape,
                                           stride=p.stride()).full_tensor() for t in ts)
                out.append([f.cpu() if keep else f.new_empty(0) for f in full])
        self.coll.sent["all_gather"] += sum(t.numel() * t.element_size()
                                            for _, ts in parts for t in ts)
        return out

    def keeps_gathered(self, to: int) -> bool:
        return self.coll.rank == to

    def local_part(self, s, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of whole tensor ``t`` of ``s``'s param, flat: where DTensor puts
        the local shard (torch's own rule, uneven shards included); no collective."""
        p = s.param
        if not isinstance(p, DTensor):
            return t.reshape(-1)
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                              p.placements)
        return t[tuple(slice(o, o + n) for o, n in zip(offset, shape))].reshape(-1)


def _tp_mesh(slots):
    meshes = {s.param.device_mesh for s in slots if isinstance(s.param, DTensor)}
    return next(iter(meshes)) if meshes else None  # support.check_params: one at most


def _data_parallel_group(mesh, tp: int, process_group):
    """The group of ranks that hold the same shards, and the group of every rank. A 2-D
    mesh names its data-parallel dim (0); a 1-D mesh smaller than the world repeats over
    the world: the ranks at the same position of their tensor-parallel groups form one
    data-parallel group (found by one all_gather_object, then a new_group per position,
    which every rank creates in the same order)."""
    world = dist.get_world_size()
    if process_group is not None:
        return process_group, dist.group.WORLD
    if mesh.ndim == 2:
        if mesh.size() != world:
            raise ValueError(f"the params' 2-D mesh has {mesh.size()} ranks, the world "
                             f"{world}: pass process_group= (the data-parallel group)")
        return (mesh.get_group(0) if mesh.size(0) > 1 else None), dist.group.WORLD
    if world == tp:
        return None, mesh.get_group()
    if world % tp:
        raise ValueError(f"world size {world} is not a multiple of the tensor-parallel size "
                         f"{tp}: pass process_group= (the data-parallel group)")
    groups = [None] * world
    dist.all_gather_object(groups, tuple(mesh.mesh.flatten().tolist()))
    tps = sorted(set(groups))
    if any(len(g) != tp for g in tps) or len(tps) * tp != world:
        raise ValueError("the tensor-parallel meshes do not tile the world evenly: pass "
                         "process_group= (the data-parallel group)")
    mine = None
    for j in range(tp):
        ranks = [g[j] for g in tps]
        made = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = made
    return mine, dist.group.WORLD


def make_exchange(process_group, *, slots, device, copier, dtype, engine_sync):
    """The engine's exchange: for DTensor params a `TensorParallelExchange` around the one
    that moves their local tensors (over the data-parallel group: ``process_group``, else
    derived from the params' mesh and the world), else `partitioned.make_exchange`."""
    mesh = _tp_mesh(slots)
    if mesh is None:
        return make_plain_exchange(process_group, device=device, copier=copier, dtype=dtype,
                                   engine_sync=engine_sync)
    if mesh.device_type != device.type:
        raise ValueError(f"the params' device mesh is on {mesh.device_type}, the params on "
                         f"{device.type}")
    tp = mesh.size(mesh.ndim - 1)
    dp_group, stats_group = _data_parallel_group(mesh, tp, process_group)
    group = resolve_group(dp_group, device) if dp_group is not None else None
    inner = LocalExchange(copier) if group is None or dist.get_world_size(group) == 1 and \
        process_group is None else \
        PartitionedExchange(group, device=device, copier=copier, dtype=dtype,
                            engine_sync=engine_sync)
    resolve_group(stats_group, device)  # the backend must fit the device
    return TensorParallelExchange(inner, mesh=mesh, tp=tp, stats_group=stats_group,
                                  device=device)
