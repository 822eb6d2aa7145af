"""Every private transformers API the integrations touch, in one place, each with the
versions it was read in and tested against: transformers 5.17.0 (the floor, setup.cfg) and
5.24.0 (the latest release). A new transformers release is checked here first.

What is private: a name with a leading underscore, and the module constants and helpers that
transformers does not export from its top level (``transformers.trainer.OPTIMIZER_NAME``,
``trainer_pt_utils.reissue_pt_warnings``). Public hooks are used wherever one does the job:
``create_optimizer`` builds the engine, ``create_accelerator_and_postprocess`` and
``call_model_init`` shard the model, callbacks report memory and land the delayed update at the
end, ``save_model`` / ``evaluate`` / ``train`` are overridden as documented methods.

What has no public hook, and so stays here:

- `TrainerInternals`: the private `Trainer` methods the offload Trainer takes part in (the
  checkpoint files, the saved weights, the fp16 scaler's file, the out-of-memory retry, the best
  model's load, the accelerator's arguments, the device move). Each override is a few lines
  that hand the stock method to a ``_zo_*`` method of `ZeroOffloadTrainerMixin` (trainer.py),
  so what the offload path does reads there, and what it hooks reads here.
- `trainer_being_built`: which Trainer's ``__init__`` calls ``args.get_process_log_level()``
  (its first call into the arguments), so that a Trainer that would ignore ``zero_offload=True``
  arguments refuses them before it touches the model. An argument object has no other way to
  learn which trainer holds it, and scripts call the same method themselves beforehand.
- The tensor-parallel API of ``transformers.distributed.tensor_parallel`` and the model's
  ``_resolve_parallel_plans`` (`resolved_plan`, `apply_plan`), which changed form in 5.23.

Two accelerator methods are replaced on the Trainer's own accelerator instance, for want of a
public hook in transformers or accelerate: ``clip_grad_norm_`` (core.install; the Trainer's
clip call is private, 5.24's ``_clip_grad_norm``, inline in 5.17's loop, and both reach the
accelerator's method) and ``prepare_model`` (trainer.py: the Trainer prepares the model with
no option to leave out the DDP wrapper).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

import torch
import transformers
from transformers import PreTrainedModel, Trainer
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

try:
    # transformers.distributed.tensor_parallel is new in 5.16.0 (5.15 and before have
    # another API, in transformers.integrations.tensor_parallel), transformers'
    # DistributedConfig in 5.16.1 (before, only transformers.distributed's). In 5.16
    # to 5.24 replace_layer_number_by_wildcard can be imported from
    # transformers.distributed.tensor_parallel (defined there until 5.22, imported there
    # from transformers.distributed.parallel_utils in 5.23 and 5.24).
    from transformers import DistributedConfig
    from transformers.distributed.tensor_parallel import (
        apply_tensor_parallelism,
        replace_layer_number_by_wildcard,
    )
except ImportError as e:
    raise ImportError(f"hf_zoffload needs transformers>=5.17 (its DistributedConfig and "
                      f"transformers.distributed.tensor_parallel); transformers "
                      f"{transformers.__version__} is installed") from e

__all__ = ["OPTIMIZER_NAME", "SCALER_NAME", "SCHEDULER_NAME", "reissue_pt_warnings",
           "TrainerInternals", "trainer_being_built", "checkpoint_folder", "resolved_plan",
           "apply_plan"]

# 5.17-5.24: Trainer.__init__ calls args.get_process_log_level() itself, once, before it
# resolves or moves the model (5.24: after create_accelerator_and_postprocess, 5.17 before it).
_TRAINER_INIT = inspect.unwrap(Trainer.__init__).__code__


def trainer_being_built(depth: int = 2):
    """The Trainer whose ``Trainer.__init__`` is the caller's caller (``depth`` frames up from
    here), or None: what ``get_process_log_level`` asks to tell a Trainer's call from a
    script's."""
    frame = sys._getframe(depth)
    if frame.f_code is not _TRAINER_INIT:
        return None
    return frame.f_locals.get("self")


def checkpoint_folder(trainer, trial) -> str:
    """The folder ``Trainer._save_checkpoint`` writes for this step (5.17-5.24:
    ``_get_output_dir(trial)`` / ``checkpoint-<global_step>``)."""
    return os.path.join(trainer._get_output_dir(trial=trial),
                        f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")


class TrainerInternals:
    """The private `Trainer` methods the offload Trainer overrides, each handing the stock
    method (the next class's in the MRO: a TRL trainer's own override runs too) to the
    ``_zo_<name>`` method of `ZeroOffloadTrainerMixin`. Signatures as in 5.17 and 5.24."""

    # Trainer.__init__ sets it from the model (a model sharded at load time); read by
    # _inner_training_loop / _prepare_for_training, _save and the optimizer checkpoint paths.
    # With offload the engine reduces the gradients and gathers what is saved: such a model is
    # trained as one sharded by the integrations (`ZeroOffloadTrainerMixin`).
    @property
    def is_distributed_loading_by_transformers(self) -> bool:
        return getattr(self, "_sharded_at_load", False) and not self.zero_offload

    @is_distributed_loading_by_transformers.setter
    def is_distributed_loading_by_transformers(self, value: bool) -> None:
        self._sharded_at_load = bool(value)

    def _build_accelerator_args(self, **kwargs):
        return self._zo_accelerator_args(super()._build_accelerator_args(**kwargs))

    # 5.17 and 5.24 call it in __init__ once the accelerator exists (place_model_on_device),
    # and in _inner_training_loop after model_init and with fp16/bf16_full_eval: each move
    # of the model for training. (An evaluation before training moves it otherwise: the
    # evaluation loop's own .to() with fp16/bf16_full_eval, accelerate's prepare_model.)
    def _move_model_to_device(self, model, device):
        if self._zo_keeps_on_host(model):
            return None
        return super()._move_model_to_device(model, device)

    def _save_checkpoint(self, model, trial):
        return self._zo_save_checkpoint(functools.partial(super()._save_checkpoint, model, trial),
                                        trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        return self._zo_load_from_checkpoint(
            functools.partial(super()._load_from_checkpoint, resume_from_checkpoint, model),
            resume_from_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir):
        return self._zo_save_optimizer(
            functools.partial(super()._save_optimizer_and_scheduler, output_dir))

    def _load_optimizer_and_scheduler(self, checkpoint):
        return self._zo_load_optimizer(
            functools.partial(super()._load_optimizer_and_scheduler, checkpoint), checkpoint)

    def _save(self, output_dir=None, state_dict=None):
        return super()._save(output_dir, state_dict=self._zo_saved_weights(state_dict))

    def _save_scaler(self, output_dir):
        return self._zo_save_scaler(functools.partial(super()._save_scaler, output_dir))

    def _load_scaler(self, checkpoint):
        return self._zo_load_scaler(functools.partial(super()._load_scaler, checkpoint),
                                    checkpoint)

    def _inner_training_loop(self, batch_size=None, *args, **kwargs):
        self._zo_before_training_loop(batch_size)
        return super()._inner_training_loop(batch_size, *args, **kwargs)

    def _load_best_model(self):
        return self._zo_load_best_model(super()._load_best_model)


# --------------------------------------------------------------------------- tensor parallel
# transformers' tensor-parallel API comes in two forms (read in the released wheels):
# - 5.23 and later: the model's `_resolve_parallel_plans(DistributedConfig)` returns its plans
#   with the layer numbers filled in (one rule per module and per param name), and
#   `apply_tensor_parallelism(model, tp_mesh, tp_plan)` requires that plan: it looks each
#   name up as it is, a rule with a `*` names nothing.
# - 5.16 to 5.22 (5.17 tested): no `_resolve_parallel_plans`; `apply_tensor_parallelism(model,
#   tp_mesh)` reads `model.tp_plan` (rules with `*` for the layer numbers) and shards each
#   param whose name, or whose module's name, matches a rule with its layer numbers read as
#   `*`, and hooks each module whose name matches one. 5.19 to 5.22 take such a plan as an
#   optional third argument and have a module-level `resolve_parallel_plans` returning them.
# The form is told by what the installed transformers has, one function per difference.

def resolved_plan(model: PreTrainedModel, tp: int) -> dict[str, str]:
    """``model``'s tensor-parallel plan for ``tp`` ranks, one rule per module or param name."""
    resolve = getattr(model, "_resolve_parallel_plans", None)
    if resolve is not None:  # 5.23 and later
        plan, _, _ = resolve(DistributedConfig(tp_size=tp))
        return plan
    return _expand_plan(model, model.tp_plan)  # 5.22 and before


def _expand_plan(model: torch.nn.Module, rules: dict[str, str]) -> dict[str, str]:
    """``rules`` (names with ``*`` for the layer numbers) as the modules and params they name
    in ``model`` (what transformers 5.22 and before shard and hook by them): a module's params
    first (its rule, or their own), then the module."""
    plan = {}
    for module_name, module in model.named_modules():
        module_rule = rules.get(replace_layer_number_by_wildcard(module_name))
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            rule = rules.get(replace_layer_number_by_wildcard(name), module_rule)
            if rule is not None:
                plan[name] = rule
        if module_rule is not None:
            plan[module_name] = module_rule
    return plan


def _plan_is_an_argument() -> bool:
    # 5.23 and later: the plan is apply_tensor_parallelism's required third parameter; 5.19 to
    # 5.22 have an optional one that takes rules with `*` (the resolved plan would name
    # nothing there), 5.16 to 5.18 none.
    params = list(inspect.signature(apply_tensor_parallelism).parameters.values())
    return len(params) >= 3 and params[2].default is inspect.Parameter.empty


def apply_plan(model: PreTrainedModel, mesh, plan: dict[str, str]) -> None:
    """Shard ``model`` over ``mesh`` by ``plan`` (`resolved_plan`'s), with transformers'
    apply_tensor_parallelism."""
    if _plan_is_an_argument():
        apply_tensor_parallelism(model, mesh, plan)
    else:  # it reads model.tp_plan, whose expansion `plan` is
        apply_tensor_parallelism(model, mesh)
