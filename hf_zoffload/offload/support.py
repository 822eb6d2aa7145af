"""What the engine can train: checks that run before anything changes, and the local tensors.

The engine keeps every trainable param on one device and streams its gradient itself. Params
of torch tensor parallelism (DTensor: ``parallelize_module``, transformers' ``tp_plan``) are
trained through their local shards (docs/design.md, "Tensor-parallel protocol"): `local` is
the tensor the engine reads and writes, `set_local` gives a param a new local tensor. What
cannot work is refused here, with the reason, before any state moves: FSDP's FlatParameter,
a DTensor sharded over the first dim of a 2-D mesh, Partial or strided placements, meshes of
more than 2 dims, params on different meshes, and models wrapped in DistributedDataParallel.
FSDP2's shards on a 1-D mesh pass here: fsdp2.py decides what of FSDP2 the engine trains.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor, Replicate, Shard = (), (), ()


def is_dtensor(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor)


def local(p: torch.Tensor) -> torch.Tensor:
    """The tensor the engine reads and writes for ``p``, detached: ``p`` itself, or a
    DTensor's local shard (or replica), which shares its storage (what ``to_local()``
    returns when grad is disabled, without entering no_grad on every call)."""
    return (p._local_tensor if isinstance(p, DTensor) else p).detach()


def local_grad(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a tensor shaped like `local(p)`: a DTensor grad in the param's placements
    gives its local tensor; one in other placements (a Partial sum, when a replicated param
    meets sharded activations) is redistributed to the param's first (a collective over the
    param's mesh, issued in backward order, which every rank of the mesh shares)."""
    if not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad._local_tensor


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p``'s local tensor is a part of it (its elements differ between the ranks
    of its mesh); plain params and replicated DTensors hold the whole param."""
    return isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)


def set_local(p: torch.nn.Parameter, new: torch.Tensor) -> None:
    """Make ``new`` (``p``'s local shape) the param's local tensor, keeping the Parameter
    object (optimizers and the model refer to it). A DTensor keeps its dtype in the wrapper
    and its spec, so ``p.data = new`` cannot recast it: the Parameter's contents are swapped
    with a new DTensor's, as ``Module.to`` does for wrapper subclasses (`check_params`
    refused params that cannot be swapped)."""
    if not isinstance(p, DTensor):
        p.data = new
        return
    made = DTensor.from_local(new, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())
    torch.utils.swap_tensors(p, torch.nn.Parameter(made, requires_grad=p.requires_grad))


def _why_dtensor_unsupported(p) -> str | None:
    mesh, places = p.device_mesh, tuple(p.placements)
    if mesh.ndim > 2:
        return f"a DTensor on a {mesh.ndim}-D device mesh (at most 2: data x tensor parallel)"
    for pl in places:
        if type(pl) not in (Shard, Replicate):  # Partial, _StridedShard, custom placements
            return f"a DTensor placement {pl!r} (only Shard and Replicate are supported)"
    if mesh.ndim == 2 and not isinstance(places[0], Replicate):
        return ("a DTensor sharded over the first dim of a 2-D mesh (FSDP2's layout; the "
                "first dim must be the data-parallel one, Replicate)")
    if weakref.getweakrefs(p):
        return "a DTensor param that something holds a weak reference to (it cannot be recast)"
    return None


def _why_unsupported(p: torch.Tensor) -> str | None:
    if isinstance(p, DTensor):
        return _why_dtensor_unsupported(p)
    if getattr(p, "_is_flat_param", False):
        return "FSDP (the param is an FSDP FlatParameter)"
    return None


def check_params(params) -> None:
    """Raise before anything changes if a param cannot be trained by the engine."""
    meshes = {}
    for i, p in enumerate(params):
        why = _why_unsupported(p)
        if why:
            raise ValueError(f"param {i}: ZeRO-Offload with {why} is not supported")
        if isinstance(p, DTensor) and p.requires_grad:
            meshes.setdefault(p.device_mesh, i)
    if len(meshes) > 1:
        a, b = sorted(meshes.values())[:2]
        raise ValueError(f"params {a} and {b} are DTensors on different device meshes: "
                         "ZeRO-Offload needs one tensor-parallel mesh for all params")


def check_clip_args(max_norm, norm_type, error_if_nonfinite) -> None:
    """What `clip_grad_norm_` accepts of torch's arguments."""
    if float(norm_type) != 2.0:
        raise ValueError(f"clip_grad_norm_: only norm_type=2 is supported, got {norm_type}")
    if error_if_nonfinite:
        raise ValueError("clip_grad_norm_: error_if_nonfinite=True is not supported (fp16 "
                         "overflow skips the step instead)")
    if not float(max_norm) >= 0.0:
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")


def check_model(model: torch.nn.Module) -> None:
    """For the integrations: the model must reach the engine unwrapped, not FSDP1-sharded.

    The engine averages gradients itself; DistributedDataParallel around the model would
    all-reduce them a second time and keep a full gradient copy on the device. FSDP1 flattens
    the params into FlatParameters; FSDP2's ``fully_shard`` modules pass here (fsdp2.py
    decides what of FSDP2 the engine trains). Tensor-parallel params
    (DTensor, on a tensor-parallel mesh) are trained through their local shards, as
    `check_params` allows."""
    if isinstance(model, DistributedDataParallel):
        raise ValueError("ZeRO-Offload averages gradients itself: do not wrap the model in "
                         "DistributedDataParallel (prepare it without DDP)")
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError("ZeRO-Offload with FSDP1 (FullyShardedDataParallel) is not supported; "
                         "FSDP2 (fully_shard) with CPU offload is")
    if (getattr(model, "fsdp_size", None) or 1) > 1:
        raise ValueError(f"ZeRO-Offload with a model loaded with fsdp_size="
                         f"{model.fsdp_size} (FSDP2) is not supported; load it with "
                         "tp_size alone, or whole")
    check_params(model.parameters())
