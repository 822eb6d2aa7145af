"""Tensor parallelism in the integrations: accelerate's `ParallelismConfig` checked against
what the engine trains, and a whole model sharded with its transformers tensor-parallel plan.

The engine trains DTensor params through their local shards (offload/modes/tensor_parallel.py);
what the integrations add is the setup around it:

- the sizes: ``tp_size`` tensor-parallel ranks, and data parallelism over the rest of the
  world (``dp_shard_size`` x ``dp_replicate_size``: with ZeRO-Offload both mean the engine's
  data-parallel group, which partitions the host state; nothing is FSDP-sharded). Context
  and sequence parallelism are refused.
- the data: accelerate's data loader, given the accelerator's device mesh, hands every
  tensor-parallel rank of a group the same batches (its rank and world become the
  data-parallel ones, rank // tp and world // tp).
- the model: one already tensor-parallel (``from_pretrained(..., tp_plan="auto")``,
  ``parallelize_module``) must match ``tp_size``; a whole one (built from a config, or
  loaded whole) is sharded here over the accelerator's ``tp`` mesh dim with the model's own
  plan (transformers' ``apply_tensor_parallelism``, the rules ``tp_plan="auto"`` applies;
  both forms of that API, before and since transformers 5.23, are taken: compat.py).
  Each rank keeps its part of its own copy, so every rank must hold the same weights: the
  same seed or the same checkpoint. That is checked (one all-reduce of per-param sums).
- checkpoints: the integrations save whole tensors (core.py); the model's
  ``load_state_dict`` is taught to take them back, each rank keeping its part.
"""

from __future__ import annotations

import dataclasses
import os

import accelerate
import torch
import torch.distributed as dist
import transformers
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from . import compat, core

__all__ = ["ParallelismConfig", "parallelism_config", "parallel_sizes", "model_tp_size",
           "tp_plan", "shard_model", "setup", "data_parallel_group"]


class ParallelismConfig(accelerate.ParallelismConfig):
    """accelerate's `ParallelismConfig`, accepted by an Accelerator of CPU processes too.

    accelerate 1.15 refuses any parallelism config when its processes are CPU ones
    (distributed type MULTI_CPU, gloo), though its tensor-parallel path (the device mesh,
    the data loader's sharding by data-parallel rank) does not need a GPU. With GPUs this is
    accelerate's own class; `ZeroOffloadTrainer` converts the one it is given."""

    def _validate_accelerator(self, accelerator):
        if accelerator.distributed_type != DistributedType.MULTI_CPU:
            return super()._validate_accelerator(accelerator)
        if self.total_size not in (1, accelerator.num_processes):
            raise ValueError(f"ParallelismConfig total_size ({self.total_size}) does not match "
                             f"num_processes ({accelerator.num_processes})")
        return None


def parallelism_config(pc):
    """``pc`` (accelerate's, or None: the one the environment asks for, as accelerate's
    Accelerator reads it: ACCELERATE_USE_PARALLELISM_CONFIG=true and PARALLELISM_CONFIG_*)
    as a `ParallelismConfig`, or None."""
    if pc is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
        pc = accelerate.ParallelismConfig()  # its sizes from PARALLELISM_CONFIG_*
    if pc is None or isinstance(pc, ParallelismConfig):
        return pc
    return ParallelismConfig(**{f.name: getattr(pc, f.name) for f in dataclasses.fields(pc)})


def parallel_sizes(pc, world: int) -> tuple[int, int]:
    """(tensor-parallel size, data-parallel size) of accelerate's ParallelismConfig ``pc``
    (None: no tensor parallelism, ``world`` data-parallel ranks); raises for what the
    engine cannot train."""
    if pc is None:
        return 1, world
    bad = [f"{n}_size={getattr(pc, f'{n}_size')}" for n in ("cp", "sp")
           if getattr(pc, f"{n}_size") > 1]
    if bad:
        raise ValueError(f"ParallelismConfig {', '.join(bad)} is not supported with "
                         "ZeRO-Offload; allowed: tp_size, and dp_shard_size / "
                         "dp_replicate_size (data parallelism)")
    tp, dp = pc.tp_size, pc.dp_shard_size * pc.dp_replicate_size
    if tp * dp == 1:  # all sizes left at 1: plain data parallelism, as accelerate takes it
        return 1, world
    if tp * dp != world:
        raise ValueError(f"ParallelismConfig tp_size={tp} x data-parallel size {dp} = "
                         f"{tp * dp} ranks, but the world has {world} processes")
    return tp, dp


def model_tp_size(model: torch.nn.Module) -> int:
    """The tensor-parallel size of ``model``'s DTensor params (the last dim of their mesh),
    1 when it has none."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.size(p.device_mesh.ndim - 1)
    return 1


def _check_heads(model, tp: int) -> None:
    # The attention plans shard the q/k/v projections by output rows: a rank must get whole
    # heads, or the model's reshape into heads fails inside the first forward.
    config = model.config.get_text_config()
    for name in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, name, None)
        if isinstance(n, int) and n % tp:
            raise ValueError(f"{type(model).__name__} has {name}={n}, not divisible by the "
                             f"tensor-parallel size {tp}: each rank needs whole heads")


def _check_tied(model, plan: dict) -> None:
    # Sharding replaces the parameter of a module in the plan: a weight tied to another
    # (tie_word_embeddings) would become two params, trained apart.
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    for names in groups.values():
        if len(names) > 1 and any(n in plan or n.rpartition(".")[0] in plan for n in names):
            raise ValueError(f"{' and '.join(names)} are one tied weight that the "
                             "tensor-parallel plan shards: untie them (e.g. "
                             "tie_word_embeddings=False) to train with tensor parallelism")


def _check_same_weights(model, mesh) -> None:
    """Every rank of ``mesh`` holds the same weights (each keeps its part of its own copy)."""
    sums = torch.tensor([float(p.detach().sum(dtype=torch.float64)) for p in model.parameters()],
                        dtype=torch.float64, device=mesh.device_type)
    lo, hi = sums.clone(), sums.clone()
    group = mesh.get_group()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    names = [n for n, _ in model.named_parameters()]
    differ = [names[i] for i in torch.nonzero(lo != hi).flatten().tolist()]
    if differ:
        raise ValueError(f"the model's weights differ between the tensor-parallel ranks "
                         f"({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}): "
                         "build it with the same seed on every rank, or load the same "
                         "checkpoint, before it is sharded")


def tp_plan(model: torch.nn.Module, tp: int) -> dict[str, str]:
    """``model``'s transformers tensor-parallel plan for ``tp`` ranks, one rule per module or
    param; raises (no collective, nothing changed) for a model that cannot be sharded so."""
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"{type(model).__name__} is not a transformers PreTrainedModel, so it "
                         "has no tensor-parallel plan: shard it yourself (torch's "
                         "parallelize_module) before it reaches the trainer / accelerator")
    if not model.supports_tp_plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in "
                         "transformers: train a model that has one (Llama, Mistral, Qwen2, "
                         "...) or use tp_size=1")
    plan = compat.resolved_plan(model, tp)
    _check_heads(model, tp)
    _check_tied(model, plan)
    return plan


def shard_model(model: torch.nn.Module, mesh) -> dict[int, torch.nn.Parameter]:
    """Shard the whole ``model`` over the 1-D tensor-parallel ``mesh`` with its
    transformers tensor-parallel plan, in place. Returns {id(old param): new param} for the
    params it replaced (an optimizer built before refers to the old ones)."""
    plan = tp_plan(model, mesh.size())
    _check_same_weights(model, mesh)
    before = dict(model.named_parameters())
    compat.apply_plan(model, mesh, plan)
    after = dict(model.named_parameters())
    replaced = {n for n, p in before.items() if after[n] is not p}
    # The checks above read `plan`; transformers 5.22 and before shard by their own reading of
    # the model's plan: they must have replaced the params it names, and no other.
    named = {n for n in before if n in plan or n.rpartition(".")[0] in plan}
    if (named and not replaced) or not replaced <= named:
        raise RuntimeError(f"transformers {transformers.__version__} sharded {len(replaced)} "
                           f"params where the plan names {len(named)} (not in it: "
                           f"{sorted(replaced - named)[:3]}): hf_zoffload does not know this "
                           "version's tensor-parallel API (it knows 5.17 to 5.24)")
    return {id(before[n]): after[n] for n in replaced}


def setup(accelerator, model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """Check ``model`` (unwrapped) against the accelerator's parallelism config and shard it
    if it is whole and ``tp_size`` > 1; its ``load_state_dict`` then takes whole tensors
    (a checkpoint to resume from). Returns what `shard_model` returns ({} if nothing was
    sharded). Raises, before anything changes, for sizes that do not fit."""
    tp, _ = parallel_sizes(accelerator.parallelism_config, accelerator.num_processes)
    have = model_tp_size(model)
    if have > 1 and tp == 1:
        raise ValueError(
            f"the model is tensor-parallel ({have} ranks) but the accelerator is not (no "
            f"parallelism_config, or tp_size=1): pass ParallelismConfig(tp_size={have}) "
            "(TrainingArguments(parallelism_config=...) or Accelerator(parallelism_config="
            "...)), so that the tensor-parallel ranks get the same batches")
    if have > 1 and have != tp:
        raise ValueError(f"the model is tensor-parallel over {have} ranks, the "
                         f"parallelism_config says tp_size={tp}")
    if tp == 1:
        return {}
    sharded = {} if have > 1 else shard_model(model, accelerator.torch_device_mesh["tp"])
    core.take_whole_tensors(model)
    return sharded


def data_parallel_group(accelerator):
    """The engine's data-parallel group under tensor parallelism: the accelerator's ``dp``
    mesh dim (the ranks whose data loaders differ), or None when there is one data-parallel
    rank or no tensor parallelism (the engine then takes the world)."""
    tp, dp = parallel_sizes(accelerator.parallelism_config, accelerator.num_processes)
    if tp == 1 or dp == 1:
        return None
    return accelerator.torch_device_mesh["dp"].get_group()
