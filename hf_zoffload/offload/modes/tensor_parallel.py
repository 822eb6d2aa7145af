"""Tensor parallelism (DTensor params) with ZeRO-Offload: which ranks share which shards.

Each rank's buckets hold its local tensors; the ranks that hold the same shards form the
data-parallel group, over which the exchange partitions the state as with plain params
(partitioned.py), and every rank together is the span of the step's numbers and the
checkpoints (mesh.py). Here: the mesh of the params and those groups, for resolve.py.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.tensor import DTensor


def dtensor_mesh(slots):
    """The device mesh of the DTensor params among ``slots``, or None (plain params)."""
    meshes = {s.param.device_mesh for s in slots if isinstance(s.param, DTensor)}
    return next(iter(meshes)) if meshes else None  # support.check_params: one at most


def data_parallel_group(mesh, tp: int, process_group):
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
