"""FSDP2 parameter offload in the integrations: accelerate's FSDP plugin applied by ZeRO-Offload.

The engine's FSDP2 mode (offload/modes/fsdp2_offload.py) trains a model sharded by
``fully_shard`` with ``CPUOffloadPolicy``. The integrations take the plugin that asks for it,
accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True)`` (the Trainer's
``--fsdp "full_shard offload"`` / ``fsdp_config`` build one; `requested` says where else it is
read from), and run one path on CPU and GPU processes alike:

1. `check` refuses, in one line and before anything changes, what the engine cannot train
   behind it: FSDP1, FSDP2 without CPU offload, HSDP or FSDP beside tensor parallelism, and
   the plugin options this path does not carry out (`_why_not`).
2. `shard` shards the whole model with accelerate's own ``fsdp2_prepare_model`` (its
   auto-wrap policy, ``reshard_after_forward``, the embedding and the tail in groups of their
   own, the root), before the engine is built over the sharded params. accelerate's later
   ``prepare`` of a model that is already an ``FSDPModule`` leaves it as it is.
3. `leave_fsdp_mode`: accelerate 1.15 keeps the plugin only on GPU-like processes
   (``DistributedType.FSDP``); on CPU processes it drops it. On a GPU the accelerator is put
   back to the data-parallel type it had before the plugin turned it to FSDP, so that both
   kinds of process run the same accelerate code from here on: ``prepare`` does not shard or
   swap the optimizer's params again, ``accumulate``/``no_sync`` does not keep FSDP2's
   unsharded gradients on the device between micro-steps (FSDP2 reduce-scatters each
   backward, the engine sums them in fp32 on the host: +4 B per element of this rank's
   shard), and ``save_state`` / the Trainer's checkpoints write the engine's format.

Checkpoints are the plain ZeRO-Offload ones (the Trainer's ``model.safetensors`` with the
whole fp32 masters, ``optimizer.pt`` with torch AdamW's per-param state, whole tensors
gathered on rank 0), so they load with any number of ranks and in the ZeRO-2 mode without
FSDP, and back (docs/design.md, "FSDP2 parameter offload").
"""

from __future__ import annotations

import copy
import logging
import os

import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

__all__ = ["requested", "check", "why_not", "unsupported_option", "shard", "leave_fsdp_mode",
           "is_sharded"]

logger = logging.getLogger(__name__)

# The data-parallel type accelerate 1.15 (state.py, AcceleratorState.__init__) turns into
# DistributedType.FSDP when a plugin is given, by the device type of the process.
_DATA_PARALLEL = {"cuda": DistributedType.MULTI_GPU}


def requested(accelerator, given: FullyShardedDataParallelPlugin | None = None):
    """The FSDP plugin this run asks for, or None: ``given`` (the Trainer's, built from
    ``--fsdp`` / ``fsdp_config``; ``prepare_zero_offload(fsdp_plugin=...)``), else the
    accelerator's (GPU processes keep ``Accelerator(fsdp_plugin=...)`` and ``accelerate
    launch``'s FSDP config there), else, when ``ACCELERATE_USE_FSDP`` is true, the plugin
    accelerate builds from the environment (``FSDP_*``, what ``accelerate launch`` exports)."""
    if given is not None:
        return given
    held = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if held is not None:
        return held
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return FullyShardedDataParallelPlugin()
    return None


def why_not(plugin, *, dtype: torch.dtype, tp: int = 1, replicas: int = 1) -> str | None:
    """Why the engine cannot train behind ``plugin`` (compute dtype ``dtype``, ``tp``
    tensor-parallel ranks, ``replicas`` data-parallel replicas of the shards), or None."""
    if plugin.fsdp_version != 2:
        return (f"FSDP{plugin.fsdp_version} (fsdp_version={plugin.fsdp_version}); only FSDP2 "
                "(fsdp_version=2) with CPU offload is supported")
    if not isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        return ("FSDP2 without CPU offload (cpu_offload=False): the engine writes the sharded "
                "params on the host; set cpu_offload=True ('--fsdp \"full_shard offload\"'), "
                "or use ZeRO-Offload without FSDP")
    if replicas > 1:
        return f"HSDP (dp_replicate_size={replicas}); only a 1-D shard mesh is supported"
    if tp > 1:
        return f"FSDP2 with tensor parallelism (tp_size={tp}); use one of them"
    why = unsupported_option(plugin)
    if why:
        return why
    want = getattr(plugin.mixed_precision_policy, "param_dtype", None)
    if want is not None and want != dtype:
        return (f"the plugin's mixed precision param_dtype {want} differs from the compute "
                f"dtype {dtype}: leave it unset or make them agree")
    return None


def unsupported_option(plugin) -> str | None:
    """Which of the plugin's options this path does not carry out, or None: read from
    ``plugin``'s ``activation_checkpointing``, ``cpu_ram_efficient_loading``,
    ``ignored_modules`` and ``state_dict_type`` (the wizard checks accelerate's config
    answers with it too)."""
    if plugin.activation_checkpointing:
        return ("the plugin's activation_checkpointing (it renames the wrapped layers' "
                "params); use the model's gradient checkpointing (--gradient_checkpointing, "
                "model.gradient_checkpointing_enable()), which trains the same")
    if plugin.cpu_ram_efficient_loading:
        return ("cpu_ram_efficient_loading (rank 0 loads, the others start on the meta "
                "device); load the model on every rank")
    if plugin.ignored_modules is not None:
        return "ignored_modules (the engine trains every param FSDP2 does not ignore)"
    if plugin.state_dict_type != StateDictType.FULL_STATE_DICT:
        name = getattr(plugin.state_dict_type, "name", plugin.state_dict_type)
        return (f"state_dict_type {name}: checkpoints hold whole tensors gathered on rank 0; "
                "set state_dict_type='FULL_STATE_DICT'")
    return None


def check(plugin, *, dtype: torch.dtype, tp: int = 1, replicas: int = 1) -> None:
    """Raise `why_not`'s reason, naming ZeRO-Offload, if there is one."""
    why = why_not(plugin, dtype=dtype, tp=tp, replicas=replicas)
    if why:
        raise ValueError(f"ZeRO-Offload with accelerate's FSDP plugin: {why}")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 (``fully_shard``) modules."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


class _Sharding:
    """What accelerate's ``fsdp2_prepare_model`` reads of an accelerator (accelerate 1.15:
    ``state.fsdp_plugin``, ``torch_device_mesh``, ``mixed_precision``, ``is_main_process``,
    ``device``), given as this run's: the plugin passed, no mesh (``fully_shard``'s default,
    the world on the process's device type), and mixed precision "no" so that it does not
    upcast 16-bit params to fp32 first (the engine recasts them to the compute dtype and keeps
    the fp32 masters itself)."""

    def __init__(self, accelerator, plugin):
        self.state = type("State", (), {"fsdp_plugin": plugin})()
        self.torch_device_mesh = None
        self.parallelism_config = None
        self.mixed_precision = "no"
        self.is_main_process = accelerator.is_main_process
        self.device = accelerator.device


def shard(accelerator, model: torch.nn.Module, plugin) -> dict[int, torch.nn.Parameter]:
    """Shard the whole ``model`` in place as accelerate's FSDP2 plugin says, with accelerate's
    ``fsdp2_prepare_model``. Returns {id(old param): new param} (``fully_shard`` replaces
    each param by a DTensor one; an optimizer built before refers to the old ones); {} for a
    model that holds FSDP2 modules already (sharded by hand: taken as it is)."""
    if is_sharded(model):
        return {}
    plugin = copy.copy(plugin)  # set_auto_wrap_policy and the policy below change it
    if accelerator.device.type == "cpu" and plugin.cpu_offload.pin_memory:
        # Page-locked host memory is for copies to a device; a CPU process has none, and
        # torch 2.13's pin_memory() raises there ("Cannot access accelerator device").
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    before = dict(model.named_parameters())
    fsdp2_prepare_model(_Sharding(accelerator, plugin), model)
    after = dict(model.named_parameters())
    return {id(p): after[n] for n, p in before.items() if after[n] is not p}


def leave_fsdp_mode(accelerator) -> None:
    """Put an accelerator that a plugin turned to ``DistributedType.FSDP`` (GPU processes)
    back to its data-parallel type, its plugin dropped as on CPU processes (module
    docstring, 3). Refuses device types other than CUDA (not tested)."""
    state = accelerator.state
    if state.distributed_type != DistributedType.FSDP:
        return
    kind = _DATA_PARALLEL.get(accelerator.device.type)
    if kind is None:
        raise ValueError(f"ZeRO-Offload with FSDP2 on {accelerator.device.type} processes is "
                         f"not supported; allowed: {', '.join(_DATA_PARALLEL)} (and CPU)")
    # accelerate's two process-wide states both hold the type (PartialState's is what
    # PartialState() reports; AcceleratorState's what the accelerator's methods branch on).
    for shared in (AcceleratorState._shared_state, PartialState._shared_state):
        shared["distributed_type"] = kind
    state.fsdp_plugin = None
    logger.info("ZeRO-Offload applies the FSDP2 plugin itself; accelerate runs as %s",
                kind.value)
