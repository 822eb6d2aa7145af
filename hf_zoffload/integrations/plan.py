"""One integration plan: what `ZeroOffloadTrainer` and `prepare_zero_offload` check and set up
around the engine, validated once into an `OffloadPlan` that both front ends execute.

`make_plan` reads the accelerator (its distributed type, mixed precision, parallelism config,
FSDP plugin) and refuses, before anything changes, what the engine cannot train behind it:
DeepSpeed or Megatron, a mixed precision other than no / fp16 / bf16, context or sequence
parallelism, ``save_on_each_node`` with tensor parallelism (the weights and optimizer state are
gathered on the first rank), and an FSDP plugin other than FSDP2 with CPU offload. The plan
then holds the answers (``tp``, ``fsdp``) and runs the steps in the order each front end needs
them:

1. `OffloadPlan.enter`: an accelerator that the FSDP plugin had turned to accelerate's FSDP
   mode is put back to plain data parallel (fsdp2.py, `leave_fsdp_mode`).
2. `OffloadPlan.place`: a model is checked and sharded for tensor parallelism with its
   transformers plan (parallel.py), or, sharded by hand with ``fully_shard``, taken as it is
   (refused beside an FSDP plugin or tensor parallelism: the "already sharded" refusal).
   The Trainer places its model when the accelerator exists, before the model moves to the
   device; ``prepare_zero_offload`` when it is called.
3. `OffloadPlan.shard`: the FSDP2 plugin shards the whole model with accelerate's own
   function, before the engine is built over the sharded params.
4. `OffloadPlan.wire`: the engine goes into the accelerator (the clip route and the fp16 loss
   scaler, core.install), the trained models' frozen float params join the compute dtype
   (core.prepare_models), and the engine is wrapped as accelerate's optimizer.
5. `prepare_unwrapped`: a trained model is prepared by accelerate without a DDP wrapper
   (``evaluation_mode=True``): the engine reduce-scatters the gradients itself.
"""

from __future__ import annotations

import dataclasses

import torch
from accelerate.utils import DistributedType

from ..offload.support import check_model
from . import core, fsdp2, parallel

__all__ = ["Front", "TRAINER", "ACCELERATE", "OffloadPlan", "make_plan", "prepare_unwrapped"]


@dataclasses.dataclass(frozen=True)
class Front:
    """How a front end names things in its messages."""

    who: str  # what asked for offload
    option: str  # how an option is spelled: "--{}" or "{}"
    fsdp_source: str  # where an FSDP plugin came from


TRAINER = Front("zero_offload=True", "--{}", "--fsdp (or accelerate's FSDP config)")
ACCELERATE = Front("ZeRO-Offload", "{}",
                   "an FSDP plugin (fsdp_plugin=, the Accelerator's, ACCELERATE_USE_FSDP)")

_DATA_PARALLEL = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """What one accelerator's offload run does, decided and checked by `make_plan`."""

    front: Front
    tp: int  # tensor-parallel ranks (1: none)
    fsdp: object | None  # accelerate's FSDP2 plugin this run applies, or None

    def enter(self, accelerator) -> None:
        """Take the FSDP plugin out of accelerate's hands (fsdp2.py): from here on
        accelerate runs as plain data parallel and ZeRO-Offload applies the plugin."""
        if self.fsdp is not None:
            fsdp2.leave_fsdp_mode(accelerator)

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a model sharded by hand (``fully_shard``) beside an FSDP plugin or tensor
        parallelism, and a model wrapper (DDP, DataParallel) around it."""
        check_model(model)
        if not fsdp2.is_sharded(model):
            return
        if self.fsdp is not None:
            raise ValueError(f"the model is sharded by fully_shard already and "
                             f"{self.front.fsdp_source} asks to shard it: pass one of them")
        if self.tp > 1:
            raise ValueError(f"a model sharded by fully_shard with tensor parallelism "
                             f"(tp_size={self.tp}): use one of them")

    def place(self, accelerator, model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
        """Check ``model`` and shard it for tensor parallelism (a whole one, ``tp`` > 1);
        returns {id(old param): new param} for the params sharding replaced."""
        self.check_model(model)
        if fsdp2.is_sharded(model):
            # a checkpoint to resume from loads before the engine is built
            core.take_whole_tensors(model)
            return {}
        return parallel.setup(accelerator, model)

    def shard(self, accelerator, model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
        """FSDP2 with CPU offload: shard the whole ``model`` with the plan's plugin; {}
        without one (or for a model sharded by hand)."""
        if self.fsdp is None:
            return {}
        return fsdp2.shard(accelerator, model, self.fsdp)

    def wire(self, accelerator, engine, models, *, replace: bool = False):
        """Install ``engine`` in ``accelerator`` (``replace``: a re-created optimizer on the
        same accelerator), prepare the models it trains (core.prepare_models) and return it
        as accelerate's optimizer (`core.OffloadedOptimizer`)."""
        core.install(accelerator, engine, replace=replace)
        core.prepare_models(engine, models)
        return core.OffloadedOptimizer(engine)


def make_plan(accelerator, *, front: Front, save_on_each_node: bool, dtype: torch.dtype,
              fsdp_plugin=None) -> OffloadPlan:
    """Check ``accelerator`` for an offload run whose compute dtype is ``dtype``; the FSDP
    plugin is ``fsdp_plugin``, else the one accelerate holds or its environment asks for
    (`fsdp2.requested`). Raises before anything changes."""
    fsdp = fsdp2.requested(accelerator, fsdp_plugin)
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise ValueError(f"{front.who} and a DeepSpeed accelerate config cannot be combined "
                         "(both own the optimizer state; ZeRO-Offload needs accelerate's "
                         "distributed_type NO, MULTI_CPU or MULTI_GPU): launch without DeepSpeed")
    # FSDP: a GPU process's accelerator with the FSDP plugin, which `fsdp2.check` decides on
    if kind not in _DATA_PARALLEL and not (kind == DistributedType.FSDP and fsdp is not None):
        raise ValueError(
            f"ZeRO-Offload needs accelerate's distributed_type NO, MULTI_CPU or MULTI_GPU, got "
            f"{kind}: it replaces DeepSpeed/FSDP/Megatron optimizers and cannot run under them.")
    if str(accelerator.mixed_precision) not in ("no", "fp16", "bf16"):
        raise ValueError(f"accelerate mixed_precision {accelerator.mixed_precision!r} is not "
                         "supported with ZeRO-Offload; allowed: no, fp16, bf16")
    pc = accelerator.parallelism_config
    tp, _ = parallel.parallel_sizes(pc, accelerator.num_processes)
    if tp > 1 and save_on_each_node:
        raise ValueError(f"{front.who} with tensor parallelism saves on the first rank only "
                         "(the weights and optimizer state are gathered there): drop "
                         + front.option.format("save_on_each_node"))
    if fsdp is not None:
        fsdp2.check(fsdp, dtype=dtype, tp=tp,
                    replicas=getattr(pc, "dp_replicate_size", 1) if pc is not None else 1)
    return OffloadPlan(front=front, tp=tp, fsdp=fsdp)


def prepare_unwrapped(accelerator, model: torch.nn.Module, device_placement=None):
    """``accelerator.prepare_model`` without the DDP wrapper: with several processes the
    engine reduce-scatters the gradients itself; DDP would all-reduce them a second time and
    keep a full gradient copy on the device. ``evaluation_mode=True`` is accelerate's way to
    prepare a model unwrapped (autocast and compilation still apply)."""
    return accelerator.prepare_model(model, device_placement=device_placement,
                                     evaluation_mode=True)
