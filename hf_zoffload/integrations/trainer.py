"""ZeRO-Offload for `transformers.Trainer` users, and for any Trainer subclass (TRL's
``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ...): one argument, ``zero_offload=True``.

`zero_offload_args` (arguments.py) adds ``--zero_offload`` and one ``--zero_offload_<knob>``
per `ZeroOffloadPlugin` setting to an argument class; `zero_offload_trainer` puts
`ZeroOffloadTrainerMixin` in front of a Trainer class, which then builds the offload engine in
place of the Trainer's AdamW. ``ZeroOffloadTrainingArguments`` / ``ZeroOffloadTrainer`` are the
two applied to `TrainingArguments` / `Trainer`. The mixin's methods reach the class behind it
through ``super()``, so a subclass's own overrides run as they do without offload, in either
order of the bases. With ``zero_offload`` off the Trainer is the stock one: every override hands
straight to the class behind it.

How the engine is wired into the Trainer's loop (transformers 5.17-5.24, accelerate 1.x): the
checks and set-up shared with `prepare_zero_offload` are an `OffloadPlan` (plan.py), made when
the accelerator exists; the private Trainer methods taken part in are `compat.TrainerInternals`:

- Arguments: `__new__` checks what the trainer is given before any ``__init__`` of the class
  runs (a TRL trainer's ``__init__`` converts or reads its arguments first). Offload arguments
  of another class than the trainer's own config class (read from its ``args`` annotation):
  rebuilt as ``zero_offload_args(<config>)`` where the trainer takes any TrainingArguments
  and the mixin's ``__init__`` runs first (`_converted`, as SFTTrainer rebuilds plain ones),
  else refused, naming ``zero_offload_args(<config>)``. With offload, ``optimizers=`` /
  ``optimizer_cls_and_kwargs=``, several GPUs in one process and ``--auto_find_batch_size``
  where its retry cannot work are refused.

- Optimizer: `create_optimizer` (the documented override point) builds the engine over the
  Trainer's decay / no-decay groups and wraps it in `core.OffloadedOptimizer`, an
  `AcceleratedOptimizer` already marked prepared, so ``accelerator.prepare`` registers it as is:
  the stock wrapper would copy the host state to the device (12 B/param, what offload exists to
  avoid) and patch ``step`` for a torch GradScaler we do not use.
- Compute dtype: ``--fp16`` / ``--bf16`` (or accelerate's mixed precision); neither, the
  trained params' dtype for a model loaded in 16-bit (the stock Trainer trains it in its
  dtype), else fp32.
- Frozen params: float params without ``requires_grad`` are cast to the compute dtype too
  (`core.prepare_models`), or a partly frozen (LoRA-style) model would mix dtypes in its matmuls;
  others (a quantized base's integer codes) are left as they are. A peft model saves its
  adapter (peft's ``save_pretrained`` keeps the adapter's entries of the masters' dict).
  Models the engine does not train (DPO's reference model, a reward model) are left alone.
- Generation: with the delayed update, a forward without grad through the trained model
  (``generate``, a log-prob pass) first lands the pending update (`core.prepare_models`).
- Loss scale: the engine's `DynamicLossScaler` becomes ``accelerator.scaler`` (fp16 only), so
  ``accelerator.backward`` scales the loss. Its state is saved inside ``optimizer.pt`` (the
  engine's ``state_dict``), not as ``scaler.pt``: the stock Trainer loads a ``scaler.pt`` into
  its own scaler, which a bf16 or fp32 run does not have (AttributeError on resume). So a
  checkpoint resumes across precisions and in the stock Trainer; a stock fp16 checkpoint's
  ``scaler.pt`` (torch GradScaler's format) is read into the engine's scaler.
- Saved weights: the fp32 master weights, gathered across ranks, with ``dtype: float32`` in
  the config (``save_dtype=fp32``, the default; ``compute`` saves the device copy), as the
  stock Trainer saves fp32 weights under ``--fp16``/``--bf16`` (`core.saved_state_dict`).
- Precision: accelerate's autocast is turned off for offload runs (`_build_accelerator_args`):
  the engine already holds the params in the compute dtype; autocast over them would recast
  per op, differ from what the engine computes, and for fp16 on a CPU accelerate refuses to
  start at all.
- Clipping and ``grad_norm``: the Trainer clips through ``accelerator.clip_grad_norm_``, which
  sees no ``.grad`` once the hooks have streamed them to the host. That method is patched on
  this Trainer's accelerator only (`core.install`), to the engine's ``clip_grad_norm_``
  (unscaled global norm): the Trainer's clip call is private (5.24 ``_clip_grad_norm``, inline
  in 5.17's loop), the accelerator's method is what both call.
- Skipped steps: ``accelerator.optimizer_step_was_skipped`` reads our wrapper's
  ``step_was_skipped``, i.e. the engine's overflow skip, so the scheduler holds on those steps.
- Non-finite stop (nonfinite.py, ``max_nonfinite_steps``): ``training_step`` hands each raw
  loss to it (the Trainer's log filters non-finite ones), the wrapper's step judges it with the
  engine's norm; no checkpoint is saved inside a non-finite streak, and training that ends in
  one raises. A resume refuses a checkpoint whose optimizer state is non-finite.
- Replaced or reloaded under the Trainer: an ``auto_find_batch_size`` retry rebuilds the engine
  with the old one's masters and state, the old one closed (`_inner_training_loop`);
  ``load_best_model_at_end`` loads the best weights into the fp32 masters too
  (`_load_best_model`).
- Tensor parallelism: ``parallelism_config`` (``tp_size``, and ``dp_shard_size`` for data
  parallelism over the other ranks), from the arguments or from a model sharded at load
  time. A whole model is sharded with its transformers plan before it is placed
  (`create_accelerator_and_postprocess`, `call_model_init`, `OffloadPlan.place`); accelerate's
  data loader gives the tensor-parallel ranks the same batches; the engine trains the local
  shards and averages over the data-parallel group;
  checkpoints and saved weights are gathered whole (integrations/parallel.py).
- FSDP2 parameter offload: ``--fsdp "full_shard offload"`` (or ``fsdp_config`` with version 2
  and ``cpu_offload``; accelerate launch's FSDP environment): the plugin is taken out of the
  accelerator's hands (`_build_accelerator_args`; on GPU processes the accelerator is put back
  to plain data parallel), the model stays on the host, and `create_optimizer` shards it with
  accelerate's ``fsdp2_prepare_model`` before it builds the engine over the sharded params
  (integrations/fsdp2.py). Checkpoints are the plain ones: ``model.safetensors`` (the whole
  fp32 masters) and ``optimizer.pt`` (gathered on rank 0), so they resume with another number
  of ranks and without FSDP; ``load_best_model_at_end`` loads the best one into FSDP2's
  shards and the masters (core.take_whole_tensors). Other FSDP layouts are refused by the
  arguments. The whole model is never moved to the device: the arguments say
  ``place_model_on_device=False``, and `_move_model_to_device` declines the Trainer's other
  moves (``--fp16_full_eval`` / ``--bf16_full_eval`` at the start of training). A
  model sharded by hand (``fully_shard`` with ``CPUOffloadPolicy``) without ``--fsdp`` is
  trained the same way: it is not moved to the device either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import pickle
import re
import warnings
import zipfile

import torch
from safetensors import SafetensorError
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, sort_checkpoints

from ..offload.engine import ZeroOffloadOptimizer
from ..offload.memory import format_report
from ..offload.support import check_model
from . import compat, completeness, core, fsdp2, parallel
from .arguments import (
    ALLOWED_OPTIMS,
    ZeroOffloadArgumentsMixin,
    ZeroOffloadTrainingArguments,
    check_argv,
    zero_offload_args,
)
from .nonfinite import NonFiniteError
from .plan import TRAINER, make_plan

logger = logging.getLogger(__name__)

__all__ = ["ZeroOffloadTrainingArguments", "ZeroOffloadTrainer", "ZeroOffloadTrainerMixin",
           "zero_offload_trainer", "zero_offload_args", "ALLOWED_OPTIMS", "check_argv"]

_MULTI_DEVICE = "torch.nn.DataParallel is not supported"

# What a checkpoint file can still raise as it loads once `completeness.why_incomplete` found
# its structure whole: bytes garbled inside the data, a read error, tensors of another model.
_LOAD_ERRORS = (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile,
                SafetensorError)


@contextlib.contextmanager
def _loading(checkpoint: str, what: str):
    """A file of ``checkpoint`` that fails to load: one line naming it and the checkpoint."""
    try:
        yield
    except _LOAD_ERRORS as e:
        detail = " ".join(str(e).split())
        raise ValueError(f"checkpoint {checkpoint}: {what} failed to load ({type(e).__name__}: "
                         f"{detail}); nothing was trained or saved") from e


# --------------------------------------------------------------------------- callbacks
class _MemoryReport(TrainerCallback):
    """When training begins (the model is prepared by then): checks that no wrapper such as
    DDP came around the model, and logs the engine's model-state memory once."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        check_model(self.trainer.model_wrapped)
        self.trainer._log_memory_report()

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer.engine is not None:  # a pending delayed update lands now
            self.trainer.engine.flush()


# --------------------------------------------------------------------------- what it is given
def _given(cls, args, kwargs) -> dict | None:
    """The arguments of ``cls(*args, **kwargs)`` by name, read against the first ``__init__``
    behind the mixin that names an ``args`` parameter (a TRL trainer's own, or Trainer's);
    None where they do not bind (its own ``__init__`` then raises the TypeError)."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is ZeroOffloadTrainerMixin:
            continue
        sig = inspect.signature(init)
        if "args" not in sig.parameters:
            continue  # a pass-through (*args, **kwargs), e.g. TRL's _BaseTrainer
        try:
            bound = sig.bind(None, *args, **kwargs).arguments
        except TypeError:
            return None
        for name, p in sig.parameters.items():  # a subclass's **kwargs hold Trainer's names
            if p.kind is inspect.Parameter.VAR_KEYWORD and name in bound:
                bound = {**bound.pop(name), **bound}
        return bound
    return None


@dataclasses.dataclass(frozen=True)
class _Config:
    """What a trainer class's ``__init__`` wants as ``args``, read from its annotation."""

    cls: type  # the TrainingArguments subclass it names (TRL's SFTConfig, DPOConfig, ...)
    converts: bool  # it takes any TrainingArguments too (rebuilding them as ``cls``)
    before_mixin: bool  # that __init__ runs before the mixin's (it comes first in the MRO)


def _config_class(cls) -> _Config | None:
    """The argument class ``cls``'s ``__init__`` requires, read from the annotation of its
    ``args`` parameter (TRL's ``args: SFTConfig | TrainingArguments | None``: SFTConfig, and
    TrainingArguments are taken too), or None (any TrainingArguments)."""
    seen_mixin = False
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        seen_mixin = seen_mixin or klass is ZeroOffloadTrainerMixin
        if init is None or klass is ZeroOffloadTrainerMixin:
            continue
        param = inspect.signature(init).parameters.get("args")
        if param is None:
            continue
        hint = param.annotation
        if isinstance(hint, str):  # postponed annotations: resolved in the module that wrote it
            try:
                hint = eval(hint, vars(inspect.getmodule(init)))  # noqa: S307 (its own source)
            except Exception:  # noqa: BLE001 (a name not importable there: no requirement)
                return None
        kinds = [t for t in getattr(hint, "__args__", (hint,)) if isinstance(t, type)
                 and issubclass(t, TrainingArguments)]
        named = [t for t in kinds if t is not TrainingArguments]
        if len(named) != 1:
            return None
        return _Config(named[0], converts=TrainingArguments in kinds, before_mixin=not seen_mixin)
    return None


def _converted(cls, args: tuple, kwargs: dict):
    """``(args, kwargs)`` with offload arguments of another class rebuilt as
    ``zero_offload_args(<the trainer's config class>)``, as a trainer that takes any
    TrainingArguments (TRL's SFTTrainer) rebuilds plain ones: ``Config(**args.to_dict())``,
    ``to_dict`` leaving out the hub token."""
    bound, config = _given(cls, args, kwargs), _config_class(cls)
    targs = None if bound is None else bound.get("args")
    if config is None or not isinstance(targs, ZeroOffloadArgumentsMixin) or \
            isinstance(targs, config.cls):
        return args, kwargs
    rebuilt = zero_offload_args(config.cls)(**{**targs.to_dict(), "hub_token": targs.hub_token})
    if "args" in kwargs:
        return args, {**kwargs, "args": rebuilt}
    i = next(k for k, a in enumerate(args) if a is targs)  # given by position
    return (*args[:i], rebuilt, *args[i + 1:]), kwargs


# --------------------------------------------------------------------------- trainer
class ZeroOffloadTrainerMixin(compat.TrainerInternals):
    """In front of a `Trainer` class (`zero_offload_trainer`): with ``args.zero_offload``, it
    trains through the ZeRO-Offload engine; without, it is the class behind it."""

    # ZeroOffloadTrainingArguments(zero_offload=True) refuse any Trainer without it
    # (arguments.py, `get_process_log_level`): only this mixin builds the engine.
    builds_zero_offload_engine = True
    _fsdp_plugin = None  # accelerate's FSDP2 plugin, taken from its arguments (fsdp2.py)
    _plan = None  # the OffloadPlan, made once the accelerator exists

    def __new__(cls, *args, **kwargs):
        _check_given(cls, _given(cls, args, kwargs))
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        args, kwargs = _converted(type(self), args, kwargs)
        super().__init__(*args, **kwargs)
        if not self.zero_offload:
            return
        # No DDP wrapper around the trained model (plan.prepare_unwrapped): the Trainer
        # prepares it through this accelerator's prepare_model, which has no public option
        # for it; replaced on this instance only.
        prepare_model = self.accelerator.prepare_model
        self.accelerator.prepare_model = (
            lambda model, device_placement=None, evaluation_mode=False: prepare_model(
                model, device_placement=device_placement, evaluation_mode=True))
        self._memory_logged, self._memory_figures = False, None
        self.add_callback(_MemoryReport(self))
        core.show_info_logs(main_process=self.args.should_log)  # the report at default levels

    @property
    def zero_offload(self) -> bool:
        return bool(getattr(self.args, "zero_offload", False))

    # Tensor parallelism (parallelism_config with tp_size > 1, from TrainingArguments or the
    # environment accelerate reads): a whole model is sharded with its tensor-parallel plan
    # once the accelerator's device mesh exists and before it is placed on the device, so that
    # no device holds it whole (integrations/parallel.py).
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if not self.zero_offload:
            return
        # The checks shared with prepare_zero_offload, before the model is touched; FSDP2
        # parameter offload: the plugin (--fsdp / fsdp_config, or accelerate launch's FSDP
        # environment) is applied when the optimizer is created; accelerate runs as plain
        # data parallel on GPU processes too, as it does on CPU ones (fsdp2.py).
        self._plan = make_plan(self.accelerator, front=TRAINER, fsdp_plugin=self._fsdp_plugin,
                               save_on_each_node=self.args.save_on_each_node,
                               dtype=self.args.zero_offload_plugin().torch_dtype)
        self._plan.enter(self.accelerator)
        if self._plan.fsdp is not None:
            self.is_fsdp_enabled = False
        if self.model is not None:
            self._plan.place(self.accelerator, self.model)

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if self.zero_offload:
            self._plan.place(self.accelerator, model)
        return model

    def _zo_keeps_on_host(self, model) -> bool:
        # FSDP2 keeps each rank's shard on the host (CPUOffloadPolicy) and copies a layer's
        # to the device for its forward and backward; .to(device) would move the shards.
        # With an FSDP plugin the model is still whole when the Trainer would move it
        # (compat.TrainerInternals): create_optimizer shards it from the host, so no device
        # holds it whole (fully_shard cuts one group at a time, through the device).
        if not self.zero_offload:
            return False
        return fsdp2.is_sharded(model) or (self._plan is not None
                                           and self._plan.fsdp is not None)

    def _zo_accelerator_args(self, out: dict) -> dict:
        if self.zero_offload:
            out["mixed_precision"] = "no"  # the engine does mixed precision (module docstring)
            # applied by ZeRO-Offload when the optimizer is created (fsdp2.py)
            self._fsdp_plugin = out.pop("fsdp_plugin", None)
            # also accepted with CPU processes (parallel.ParallelismConfig)
            out["parallelism_config"] = parallel.parallelism_config(
                out.get("parallelism_config"))
        return out

    @property
    def engine(self):
        """The `ZeroOffloadOptimizer`, once created (None before, or without offload)."""
        opt = getattr(self, "optimizer", None)
        return opt.optimizer if isinstance(opt, core.OffloadedOptimizer) else None

    def create_optimizer(self, model=None):
        if not self.zero_offload:
            return super().create_optimizer(model)
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            # before the groups: it replaces the params
            self._plan.shard(self.accelerator, opt_model)
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if n in decay],
                 "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            engine = ZeroOffloadOptimizer(
                [g for g in groups if g["params"]], lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2), eps=self.args.adam_epsilon,
                weight_decay=self.args.weight_decay,
                plugin=self.args.zero_offload_plugin(opt_model),
                model=opt_model,  # buckets by layer, not by group; per-module upload waits
                # tensor x data parallel: the ranks whose batches differ (None: the world)
                process_group=parallel.data_parallel_group(self.accelerator))
            # The fp16 loss scaler and the clip route, on this accelerator only: the Trainer
            # clips (and reads grad_norm) through accelerator.clip_grad_norm_(
            # model.parameters(), ...); the grads are on the host by then. replace: with
            # model_init, each train() re-creates the optimizer on the same accelerator.
            # Frozen float params join the compute dtype; reading the weights (saving,
            # evaluating, the end of training) first lands a pending delayed update.
            self.optimizer = self._plan.wire(self.accelerator, engine, [opt_model],
                                             replace=True)
            # the Trainer's step numbers in the non-finite stop's messages
            self.optimizer.nonfinite.step_number = lambda: self.state.global_step + 1
        return self.optimizer

    # A checkpoint is whole once its marker is there, written last (completeness.py says
    # what the check before a resume verifies, and why it is needed).
    COMPLETE_NAME = completeness.COMPLETE_NAME

    def _zo_save_checkpoint(self, stock, trial) -> None:
        if not self.zero_offload:
            return stock()
        stop = self.optimizer.nonfinite if self.engine is not None else None
        if stop is not None and stop.in_streak:  # nonfinite.py: rotation keeps the finite one
            logger.warning("ZeRO-Offload: checkpoint of step %d not saved: the loss or "
                           "gradient norm has been non-finite since step %d (%s)",
                           self.state.global_step, stop.first_bad, stop.first_what)
            return None
        folder = compat.checkpoint_folder(self, trial)
        if self.args.should_save:
            completeness.remove_marker(folder)
        stock()
        self.accelerator.wait_for_everyone()  # every rank's rng_state_<rank>.pth is written
        if self.args.should_save:
            completeness.write_marker(folder, model_only=self.args.save_only_model)
        return None

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._attempts = 0  # of `_inner_training_loop` in this call (auto_find_batch_size)
        if self.zero_offload and resume_from_checkpoint is True:
            resume_from_checkpoint = self._newest_complete_checkpoint()
        out = super().train(resume_from_checkpoint, *args, **kwargs)
        stop = self.optimizer.nonfinite if self.engine is not None else None
        if stop is not None and stop.in_streak:  # the weights a save_model now writes
            raise NonFiniteError(
                f"ZeRO-Offload: training ended {stop.streak} step(s) into a run of non-finite "
                f"steps from step {stop.first_bad} ({stop.first_what}), fewer than "
                f"max_nonfinite_steps={stop.limit}; no checkpoint was saved from step "
                f"{stop.first_bad} on, and the model's weights are not to be saved")
        return out

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        if self.engine is not None:  # the raw loss: the Trainer's log filters non-finite ones
            self.optimizer.nonfinite.observe_loss(loss)
        return loss

    def _newest_complete_checkpoint(self) -> str | bool:
        """``resume_from_checkpoint=True``: the newest checkpoint in ``output_dir`` that
        `completeness.why_incomplete` finds whole, with one warning naming the newer ones
        skipped and why (a save cut short leaves the newest one broken; the stock Trainer
        would stop on it, or resume from it without a word). None whole: one error. No
        checkpoint at all: True, so the stock Trainer says so as it always has."""
        out = self.args.output_dir
        if not os.path.isdir(out) or get_last_checkpoint(out) is None:
            return True
        skipped = []
        for ckpt in reversed(sort_checkpoints(out)):  # newest first
            if not re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-\d+", os.path.basename(ckpt)):
                continue  # what get_last_checkpoint takes: not checkpoint-4-old
            why = completeness.why_incomplete(ckpt) or completeness.nonfinite_problem(ckpt)
            if why is None:
                if skipped and self.args.should_log:
                    logger.warning("resume_from_checkpoint=True: resuming from %s, the newest "
                                   "complete checkpoint; skipped %s", ckpt, "; ".join(
                                       f"{c} ({w})" for c, w in skipped))
                return ckpt
            skipped.append((ckpt, why))
        raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {out}: "
                         + "; ".join(f"{c} is incomplete ({w})" for c, w in skipped)
                         + ". Start without resuming, or delete the broken checkpoints")

    def _older_whole(self, ckpt: str) -> str:
        """What a refusal of ``ckpt`` adds: the newest other checkpoint beside it that is
        whole and finite, or that there is none."""
        parent = os.path.dirname(os.path.abspath(ckpt))
        whole = (c for c in reversed(sort_checkpoints(parent)) if not os.path.samefile(c, ckpt)
                 and completeness.why_incomplete(c) is None
                 and completeness.nonfinite_problem(c) is None)
        found = next(whole, None)
        return (f"The newest complete checkpoint is {found}: resume from it "
                "(resume_from_checkpoint=True picks it)" if found else
                f"No complete checkpoint in {parent}: start without resuming")

    def _zo_load_from_checkpoint(self, stock, resume_from_checkpoint) -> None:
        # Checked before anything is loaded, so a refused checkpoint changes nothing.
        ckpt = resume_from_checkpoint
        if not self.zero_offload or not os.path.isdir(ckpt):
            return stock()
        why = completeness.why_incomplete(ckpt)
        if why:
            raise ValueError(f"checkpoint {ckpt} is incomplete ({why}): its save was "
                             f"interrupted. {self._older_whole(ckpt)}")
        with _loading(ckpt, compat.OPTIMIZER_NAME):
            why = completeness.nonfinite_problem(ckpt)
        if why:
            raise ValueError(f"checkpoint {ckpt}: {why}: its run had diverged when it saved, "
                             f"or the file changed since; nothing was loaded. "
                             f"{self._older_whole(ckpt)}")
        changed = completeness.changed_since_saved(ckpt)
        if changed and self.args.should_log:
            logger.info("checkpoint %s changed since it was saved (%s); what a resume reads is "
                        "whole: resuming from it", ckpt, "; ".join(changed))
        files = completeness.weight_files(ckpt)
        what = files[0] if len(files) == 1 else f"the weights ({', '.join(files)})" if files \
            else "the weights"
        with _loading(ckpt, what):
            return stock()

    def _zo_save_optimizer(self, stock) -> None:
        # The Trainer calls optimizer.state_dict() on the saving rank only; with N ranks the
        # engine's state_dict is a gather every rank must enter, so all ranks gather here.
        if self.engine is not None:  # one process: a no-op
            self.engine.consolidate_state_dict()
        return stock()

    def _zo_load_optimizer(self, stock, checkpoint) -> None:
        if self.engine is None or checkpoint is None:
            return stock()
        # The stock path maps optimizer.pt onto each GPU when world_size > 1 (~16 B/param of
        # fp32 state per GPU, the very memory offload saves); the engine copies into host
        # buffers anyway, so read it on the CPU, memory-mapped.
        opt_path = os.path.join(checkpoint, compat.OPTIMIZER_NAME)
        sched_path = os.path.join(checkpoint, compat.SCHEDULER_NAME)
        if not (os.path.isfile(opt_path) and os.path.isfile(sched_path)):
            return None
        # Both read before either is applied: a file that fails to load changes nothing.
        with _loading(checkpoint, compat.OPTIMIZER_NAME):
            opt_state = torch.load(opt_path, map_location="cpu", weights_only=True, mmap=True)
        with warnings.catch_warnings(record=True) as caught, \
                _loading(checkpoint, compat.SCHEDULER_NAME):
            sched_state = torch.load(sched_path, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(opt_state)
        with warnings.catch_warnings(record=True) as caught_too:
            self.lr_scheduler.load_state_dict(sched_state)
        compat.reissue_pt_warnings(caught + caught_too)
        return None

    # ------------------------------------------------- saved weights and the loss scale
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        engine = self.engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        # Every rank gathers (a collective); `_save` runs on the saving rank(s) only.
        self._master_weights = core.saved_state_dict(engine, self.model,
                                                     saves_here=self.args.should_save)
        try:
            return super().save_model(output_dir, _internal_call)
        finally:
            self._master_weights = None

    def _zo_saved_weights(self, state_dict: dict | None) -> dict | None:
        """What `_save` writes: the fp32 masters `save_model` gathered, unless a caller gave
        its own dict."""
        masters = getattr(self, "_master_weights", None)
        return masters if state_dict is None and masters is not None else state_dict

    def _zo_save_scaler(self, stock) -> None:
        if self.engine is None:
            return stock()
        return None  # the loss scaler's state is in optimizer.pt (module docstring)

    def _zo_load_scaler(self, stock, checkpoint) -> None:
        engine = self.engine
        if engine is None or checkpoint is None:
            return stock()
        path = os.path.join(checkpoint, compat.SCALER_NAME)
        if not os.path.isfile(path):
            return None
        with _loading(checkpoint, compat.SCALER_NAME):
            state = torch.load(path, map_location="cpu", weights_only=True)
        if not engine.loss_scaler.is_enabled():
            logger.info("%s: the checkpoint's fp16 loss scale is not used by this %s run",
                        path, engine.plugin.compute_dtype)
        elif state:  # a stock fp16 run's GradScaler, or an older offload checkpoint's own
            engine.loss_scaler.load_state_dict(state)
        return None

    def evaluate(self, *args, **kwargs):
        if self.engine is not None:  # evaluate the params of the last step taken
            self.engine.flush()
        return super().evaluate(*args, **kwargs)

    # ------------------------------------------------- auto_find_batch_size, the best model
    def _zo_before_training_loop(self, batch_size) -> None:
        # A second attempt in one train() is auto_find_batch_size's retry with a smaller batch
        # after an out-of-memory error, which may have come in the middle of a backward or a
        # step. The Trainer keeps its optimizer for the retry (transformers 5.17-5.24:
        # create_optimizer builds one only when there is none) as the stock one keeps its
        # AdamW with its state; here the engine is rebuilt, with the state a checkpoint of
        # that moment would hold, and the old one closed (its hooks and host state gone).
        self._attempts = getattr(self, "_attempts", 0) + 1
        if self._attempts > 1 and self.engine is not None:
            old = self.engine
            stepped = old.applied_steps or old.skipped_steps
            state = old.state_dict() if stepped else None  # none: nothing but the masters
            masters = old.master_state_dict(self.model)
            old.close()
            self.optimizer = None
            engine = self.create_optimizer().optimizer
            if state is not None:
                engine.load_state_dict(state)
            engine.load_master_state_dict(self.model, masters)  # fp32, not the 16-bit params
            logger.info("ZeRO-Offload: the optimizer was rebuilt for the retry with batch "
                        "size %s", batch_size)

    def _zo_load_best_model(self, stock) -> None:
        engine = self.engine
        if engine is None:
            return stock()
        # The stock load puts the checkpoint's weights (the fp32 masters) into the 16-bit
        # params; the masters take them too, before rounding, so that training or saving
        # after it starts from the best checkpoint itself. The pending delayed update lands
        # first, or it would land over the loaded weights.
        engine.flush()
        loading = []

        def before(module, state_dict, prefix, *_):
            loading[:] = [state_dict]

        def after(module, incompatible):
            if loading:
                engine.load_master_state_dict(self.model, loading.pop())

        handles = (self.model.register_load_state_dict_pre_hook(before),
                   self.model.register_load_state_dict_post_hook(after))
        try:
            return stock()
        finally:
            for h in handles:
                h.remove()

    # ------------------------------------------------- logs
    # state.log_history stays the stock Trainer's (the same entries with the same keys): code
    # that reads it (best checkpoint, a resumed run's history against the uninterrupted one,
    # [h["loss"] for h in log_history[:-1]]) runs unchanged. The offload figures (the memory
    # report, the loss scale, the skipped steps, the time split) ride on the entry's
    # ``on_log``: the printed log line and the reporting integrations (TensorBoard, W&B, ...)
    # get them; log_history keeps them only with --zero_offload_log_history_extras.
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        extras = self._log_extras(logs) if self.engine is not None else {}
        extras = {k: v for k, v in extras.items() if k not in logs}  # the caller's own win
        if not extras:
            return super().log(logs, *args, **kwargs)
        logs.update(extras)
        first_new = len(self.state.log_history)
        super().log(logs, *args, **kwargs)  # appends {**logs, "step": ...}, then on_log(logs)
        keep = getattr(self.args, "zero_offload_log_history_extras", False)
        if not keep and len(self.state.log_history) > first_new:
            entry = self.state.log_history[first_new]
            for key in extras:
                entry.pop(key, None)

    def _log_extras(self, logs: dict) -> dict:
        """What an entry carries beyond the stock keys: the memory figures on the first entry
        logged after training began, and on each training-step entry (it has ``loss``) the
        loss scale (fp16), the skipped steps so far and the window's mean time split."""
        out, self._memory_figures = self._memory_figures or {}, None
        if "loss" in logs:
            engine = self.engine
            if engine.loss_scaler.is_enabled():
                out["loss_scale"] = engine.loss_scaler.loss_scale
            out["skipped_steps"] = engine.skipped_steps
            out.update(self.optimizer.take_window())
        return out

    def _log_memory_report(self) -> None:
        """The engine's model-state memory, once: the table to the logger at INFO (where the
        Trainer's own account of a run goes; a warning would say something is wrong; shown
        at the default log level by `core.show_info_logs`), and three figures on the first
        entry logged (`_log_extras`): the printed log line shows them at any log level, and
        the integrations record them. With gradient accumulation its buffers are counted
        from the start, before the second micro-step allocates them."""
        engine = self.engine
        if engine is None or self._memory_logged:
            return
        self._memory_logged = True
        report = engine.memory_report(accumulates=self.args.gradient_accumulation_steps > 1)
        logger.info("ZeRO-Offload memory (model states)\n%s", format_report(report))
        self._memory_figures = {
            "offload_device_mib": round(report["device_total"] / 2**20, 3),
            "offload_host_mib": round(report["host_total"] / 2**20, 3),
            "plain_adamw_device_mib": round(report["plain_adamw_device_total"] / 2**20, 3)}


def _check_given(cls, bound: dict | None) -> None:
    """What ``cls(...)`` is given, checked before any ``__init__`` of ``cls`` runs."""
    if bound is None:
        return  # they do not bind: the class's own __init__ raises its TypeError
    targs = bound.get("args")
    config = _config_class(cls)
    if isinstance(targs, ZeroOffloadArgumentsMixin) and config is not None \
            and not isinstance(targs, config.cls) and (config.before_mixin
                                                       or not config.converts):
        # A trainer that rebuilds other arguments (SFTTrainer: SFTConfig(**args.to_dict()),
        # which knows no zero_offload option) has them rebuilt with the offload fields by the
        # mixin's __init__ (`_converted`), when that runs first; one that takes only its own
        # class (DPOTrainer) would fail on a missing option later.
        raise ValueError(f"{cls.__name__} takes {config.cls.__name__} arguments, not "
                         f"{type(targs).__name__}: build them with hf_zoffload."
                         f"zero_offload_args({config.cls.__name__})(..., zero_offload=True)")
    if not getattr(targs, "zero_offload", False):
        return
    given = [name for name, unset in (("optimizers", (None, None)),
                                      ("optimizer_cls_and_kwargs", None))
             if bound.get(name, unset) not in (unset, None)]
    if given:
        given = "=, ".join(given) + "="
        raise ValueError(f"zero_offload=True builds its own optimizer and scheduler: do not "
                         f"pass {given} to {cls.__name__} (set the learning rate and schedule "
                         "in the arguments instead)")
    if targs.n_gpu > 1:
        raise ValueError(f"zero_offload=True with {targs.n_gpu} GPUs in one process "
                         f"({_MULTI_DEVICE}); launch one process per GPU with "
                         "torchrun, accelerate launch or hf-zoffload launch")
    model = bound.get("model")
    sharded = isinstance(model, torch.nn.Module) and fsdp2.is_sharded(model)
    if targs.auto_find_batch_size and (targs.fsdp or sharded):
        # the retry rebuilds the engine, which FSDP2 refuses after its first forward
        what = "--fsdp" if targs.fsdp else "a model sharded by fully_shard"
        raise ValueError(f"--auto_find_batch_size with --zero_offload and {what}: the "
                         "retry would rebuild the optimizer after FSDP2's first forward."
                         " Find the batch size without FSDP2, then set "
                         "--per_device_train_batch_size")
    if targs.auto_find_batch_size and targs.world_size > 1:
        # An out-of-memory error is one rank's: its retry would leave the other ranks
        # waiting in the engine's collectives (`_inner_training_loop`).
        raise ValueError(f"--auto_find_batch_size with --zero_offload and "
                         f"{targs.world_size} processes: the ranks would retry apart. "
                         "Find the batch size in one process, then set "
                         "--per_device_train_batch_size")


@functools.cache
def _make_trainer(cls):
    return type(f"ZeroOffload{cls.__name__}", (ZeroOffloadTrainerMixin, cls), {
        "__module__": __name__,
        "__doc__": f"`{cls.__name__}` that, with ``args.zero_offload``, trains through the "
                   "ZeRO-Offload engine (`zero_offload_trainer`)."})


def zero_offload_trainer(cls: type) -> type:
    """``cls`` (`transformers.Trainer` or any subclass: TRL's ``SFTTrainer``, ``DPOTrainer``,
    ``GRPOTrainer``, ...) with `ZeroOffloadTrainerMixin` in front: given arguments with
    ``zero_offload=True`` (`zero_offload_args` of the class's own argument class) it trains
    through the ZeRO-Offload engine, taking ``cls``'s own keywords as they are. The same class
    for the same ``cls``; a class that has the mixin already is returned as it is."""
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"zero_offload_trainer takes transformers.Trainer or a subclass of it, "
                        f"got {cls!r}")
    if issubclass(cls, ZeroOffloadTrainerMixin):
        return cls
    return _make_trainer(cls)


ZeroOffloadTrainer = _make_trainer(Trainer)
ZeroOffloadTrainer.__doc__ = ("`Trainer` that, with ``args.zero_offload``, trains through the "
                              "ZeRO-Offload engine: ``zero_offload_trainer(Trainer)``.")
