"""What the engine can train: checks that run before anything changes.

The engine keeps every trainable param whole on one device and averages gradients itself.
Params sharded by another form of parallelism (DTensor, FSDP's FlatParameter) and models
wrapped in DistributedDataParallel are refused here, with the reason, before any state moves.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()


def _why_unsupported(p: torch.Tensor) -> str | None:
    if isinstance(p, DTensor):
        return ("tensor parallelism or FSDP2 (the param is a DTensor, as with transformers' "
                "tp_plan / tp_size or torch's fully_shard)")
    if getattr(p, "_is_flat_param", False):
        return "FSDP (the param is an FSDP FlatParameter)"
    return None


def check_params(params) -> None:
    """Raise before anything changes if a param is sharded by another form of parallelism."""
    for i, p in enumerate(params):
        why = _why_unsupported(p)
        if why:
            raise ValueError(f"param {i}: ZeRO-Offload with {why} is not supported yet; "
                             "use plain data parallelism (no model wrapper) or one process")


def check_model(model: torch.nn.Module) -> None:
    """For the integrations: the model must reach the engine unwrapped and unsharded.

    The engine averages gradients itself; DistributedDataParallel around the model would
    all-reduce them a second time and keep a full gradient copy on the device."""
    if isinstance(model, DistributedDataParallel):
        raise ValueError("ZeRO-Offload averages gradients itself: do not wrap the model in "
                         "DistributedDataParallel (prepare it without DDP)")
    if type(model).__name__ in ("FullyShardedDataParallel", "FSDPModule") or any(
            type(m).__name__.startswith("FSDP") for m in model.modules()):
        raise ValueError("ZeRO-Offload with FSDP is not supported yet")
    for attr in ("tp_size", "fsdp_size"):
        if (getattr(model, attr, None) or 1) > 1:
            raise ValueError(f"ZeRO-Offload with a model loaded with {attr}="
                             f"{getattr(model, attr)} is not supported yet")
    check_params(model.parameters())
