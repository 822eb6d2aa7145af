"""The parallel mode, decided in one place from the params, the model and the process groups.

`resolve` reads what the caller built (FSDP2 modules in ``model``, DTensor params, an
initialized process group or ``process_group=``) and returns a `ParallelMode`: which mode,
the group the state is partitioned over, and the mesh whose ranks hold different shards.
`make_exchange` builds the engine's exchange for it. Every layout the engine cannot train is
refused in `resolve`, before anything changes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import Collectives, resolve_group
from .exchange import Exchange, LocalExchange
from .fsdp2_offload import Fsdp2Exchange, fsdp2_states, sharded_params
from .mesh import MeshSpan
from .partitioned import PartitionedExchange
from .tensor_parallel import data_parallel_group, dtensor_mesh


class Kind(enum.Enum):
    ONE_PROCESS = "one process"
    DATA_PARALLEL = "data parallel"  # ZeRO-2 partitioning over `data_group` (partitioned.py)
    TENSOR_PARALLEL = "tensor parallel"  # DTensor params; partitioned over `data_group` if set
    FSDP2 = "FSDP2 parameter offload"  # FSDP2 moves the params (fsdp2_offload.py)


@dataclass(frozen=True)
class ParallelMode:
    """What `resolve` decided."""

    kind: Kind
    data_group: object = None  # the ranks that split each bucket's state (None: this rank)
    mesh: object = None  # the DTensor mesh whose ranks hold different shards (None: whole)
    tp: int = 1  # how many ranks hold different shards of one param
    span_group: object = None  # the group of the mesh span's collectives (every rank)
    fsdp_params: tuple = ()  # FSDP2: each trained param's ``FSDPParam``

    @property
    def name(self) -> str:
        if self.kind is Kind.TENSOR_PARALLEL and self.data_group is not None:
            return "tensor parallel x data parallel"
        return self.kind.value


def resolve(process_group, *, slots, model: torch.nn.Module | None, device: torch.device,
            dtype: torch.dtype) -> ParallelMode:
    """The mode of ``slots``' params: FSDP2 when ``model`` holds ``fully_shard`` modules;
    tensor parallel when the params are DTensors (data parallel too where several ranks hold
    the same shards: ``process_group``, else derived from the mesh and the world); data
    parallel over ``process_group`` (or torch.distributed's world of more than one rank);
    else one process. Raises ValueError for a layout the engine cannot train."""
    states = fsdp2_states(model)
    if states:
        fsdp_params = sharded_params(states, slots, process_group=process_group, dtype=dtype)
        mesh = slots[0].param.device_mesh  # support.check_params: one mesh for every param
        return ParallelMode(Kind.FSDP2, mesh=mesh, tp=mesh.size(), span_group=mesh.get_group(),
                            fsdp_params=tuple(fsdp_params))
    mesh = dtensor_mesh(slots)
    if mesh is not None:
        if mesh.device_type != device.type:
            raise ValueError(f"the params' device mesh is on {mesh.device_type}, the params "
                             f"on {device.type}")
        tp = mesh.size(mesh.ndim - 1)
        dp_group, span_group = data_parallel_group(mesh, tp, process_group)
        group = resolve_group(dp_group, device) if dp_group is not None else None
        if group is not None and process_group is None and dist.get_world_size(group) == 1:
            group = None  # one rank per shard: nothing to partition
        resolve_group(span_group, device)  # the backend must fit the device
        return ParallelMode(Kind.TENSOR_PARALLEL, data_group=group, mesh=mesh, tp=tp,
                            span_group=span_group)
    group = resolve_group(process_group, device)
    if group is None:
        return ParallelMode(Kind.ONE_PROCESS)
    return ParallelMode(Kind.DATA_PARALLEL, data_group=group)


def make_exchange(mode: ParallelMode, *, device: torch.device, copier, dtype: torch.dtype,
                  engine_sync) -> Exchange:
    """The engine's exchange for ``mode``: the data path (one process, or partitioned over
    ``mode.data_group``) holding the span of the mode's mesh where it has one."""
    if mode.kind is Kind.FSDP2:
        return Fsdp2Exchange(copier, mesh=mode.mesh, fsdp_params=list(mode.fsdp_params))
    span = None if mode.mesh is None else \
        MeshSpan(mode.mesh, tp=mode.tp, coll=Collectives(mode.span_group, device=device))
    if mode.data_group is None:
        return LocalExchange(copier, span=span)
    return PartitionedExchange(mode.data_group, device=device, copier=copier, dtype=dtype,
                               engine_sync=engine_sync, span=span)
