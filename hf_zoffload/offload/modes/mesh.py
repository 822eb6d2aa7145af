"""The span of params laid out on a DTensor mesh: what tensor parallelism and FSDP2 share.

Each rank's buckets hold its local tensors: a sharded param's local shard, a replicated param
(plain, or a Replicate DTensor) whole. `MeshSpan` is what spans the mesh's ranks beyond the
exchange that moves those local tensors: the step's one all-reduce runs over every rank, and
checkpoints hold whole tensors (loading takes this rank's part). Tensor parallelism holds it
around a one-process or data-parallel exchange, FSDP2 around its one-process one
(resolve.py). The protocol (why the grads are complete, how the norm counts shards and
replicated params): see docs/design.md, "Tensor-parallel protocol".
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..state import Bucket
from .collectives import Collectives
from .exchange import Span


class MeshSpan(Span):
    """Numbers and checkpoints over ``mesh``'s ``tp`` ranks that hold different shards of each
    param, through collectives over ``coll`` (every rank: the data-parallel ones too)."""

    spans_ranks = True  # the shards are gathered over the mesh's ranks

    def __init__(self, mesh, *, tp: int, coll: Collectives):
        self.mesh, self.tp, self.coll = mesh, tp, coll
        self.rank = coll.rank
        self._to = 0  # the rank the last gather was for: `whole_tensors` keeps them there

    @property
    def sent(self) -> dict[str, int]:
        return self.coll.sent

    def share_stats(self, buckets: list[Bucket], flag: float, sumsq: float,
                    sharded: float) -> tuple[float, float]:
        """One all-reduce over every rank. ``sumsq`` (whole params) is on every shard rank
        alike: divided by ``tp`` it adds up to one copy (exact in float64 for a
        power-of-two ``tp``; else within 1 ulp of float64). The present flags go in
        param-index order, the same on every rank whatever its buckets hold."""
        slots = sorted(((s, b, i) for b in buckets for i, s in enumerate(b.layout.slots)),
                       key=lambda x: x[0].index)
        seen = [float(b.window.present[i]) for _, b, i in slots]
        flag, total, *seen = self.coll.all_reduce_sum(
            [flag, sharded + sumsq / self.tp, *seen],
            "all-reduce of the overflow flag and gradient norm over the tensor-parallel ranks")
        present = {id(b): list(b.window.present) for b in buckets}
        for (_, b, i), got in zip(slots, seen):
            present[id(b)][i] = got > 0
        for b in buckets:
            b.window.set_present(present[id(b)])
        return flag, total

    def gather_rank(self, to: int) -> int:
        """The state is gathered whole over the data-parallel ranks on the first of them
        for each shard (those ranks form one mesh group, which `whole_tensors` then gathers
        over onto rank ``to``)."""
        if not 0 <= to < self.tp:
            raise ValueError(f"with tensor parallelism the state is gathered on one of the "
                             f"first data-parallel rank's {self.tp} tensor-parallel ranks; "
                             f"got to={to}")
        self._to = to
        return 0

    def whole_tensors(self, parts: list) -> list:
        """(slot, [flat local tensors]) in param-index order (the same on every rank) ->
        the whole tensors (CPU) on the rank the last gather was for. The other ranks of
        the mesh take part in each all-gather and keep an empty tensor for each sharded one
        (their callers return nothing), so that no rank but the saving one holds the whole
        state (12 B per param of the model, fp32)."""
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
