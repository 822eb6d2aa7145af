"""ZeRO-Offload for `transformers.Trainer` users: one argument, ``zero_offload=True``.

`ZeroOffloadTrainingArguments` adds ``--zero_offload`` and one ``--zero_offload_<knob>`` per
`ZeroOffloadPlugin` setting; `ZeroOffloadTrainer` builds the offload engine in place of the
Trainer's AdamW. With ``zero_offload`` off the Trainer is the stock one: every override below
hands straight to `Trainer`.

How the engine is wired into the Trainer's loop (transformers 5.x, accelerate 1.x); the
wiring shared with `prepare_zero_offload` lives in `hf_zoffload.integrations.core`:

- Optimizer: `create_optimizer` (the documented override point) builds the engine over the
  Trainer's decay / no-decay groups and wraps it in `core.OffloadedOptimizer`, an
  `AcceleratedOptimizer` already marked prepared, so ``accelerator.prepare`` registers it as is:
  the stock wrapper would copy the host state to the device (12 B/param, what offload exists to
  avoid) and patch ``step`` for a torch GradScaler we do not use.
- Frozen params: float params without ``requires_grad`` are cast to the compute dtype too
  (`core.prepare_models`), or a partly frozen (LoRA-style) model would mix dtypes in its matmuls.
- Loss scale: the engine's `DynamicLossScaler` becomes ``accelerator.scaler`` (fp16 only), so
  ``accelerator.backward`` scales the loss and the Trainer saves / loads it as ``scaler.pt``.
- Precision: accelerate's autocast is turned off for offload runs (`_build_accelerator_args`):
  the engine already holds the params in the compute dtype; autocast over them would recast
  per op, differ from what the engine computes, and for fp16 on a CPU accelerate refuses to
  start at all.
- Clipping and ``grad_norm``: the Trainer clips through ``accelerator.clip_grad_norm_``, which
  sees no ``.grad`` once the hooks have streamed them to the host. That method is patched on
  this Trainer's accelerator only (`core.install`), to the engine's ``clip_grad_norm_``
  (unscaled global norm).
- Skipped steps: ``accelerator.optimizer_step_was_skipped`` reads our wrapper's
  ``step_was_skipped``, i.e. the engine's overflow skip, so the scheduler holds on those steps.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import warnings
from dataclasses import field, make_dataclass

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

from ..config import ZeroOffloadPlugin, enabled_from_sources, sourced_values
from ..offload.engine import ZeroOffloadOptimizer
from ..offload.memory import format_report
from ..offload.support import check_model
from . import core

logger = logging.getLogger(__name__)

__all__ = ["ZeroOffloadTrainingArguments", "ZeroOffloadTrainer", "ALLOWED_OPTIMS"]

# The engine is AdamW (decoupled weight decay) with torch's hyperparameters and state keys;
# these are the Trainer optimizers with exactly that update rule.
ALLOWED_OPTIMS = ("adamw_torch", "adamw_torch_fused")
_MULTI_DEVICE = "torch.nn.DataParallel is not supported"
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


# --------------------------------------------------------------------------- arguments
def _argument_fields() -> list[tuple]:
    out = [("zero_offload", bool | None, field(default=None, metadata={
        "help": "Keep fp32 master weights and Adam state in host memory and run AdamW there "
                "(ZeRO-Offload); the device keeps the compute-dtype params only. Unset: "
                "HF_ZOFFLOAD_ENABLED, else the zoffload yaml's zero_offload (as `hf-zoffload "
                "launch` passes them), else off.",
        "nargs": "?", "const": True}))]
    for f in dataclasses.fields(ZeroOffloadPlugin):
        kind = _TYPES[f.type if isinstance(f.type, str) else f.type.__name__]
        meta = {"help": "ZeRO-Offload: " + ZeroOffloadPlugin.help(f.name)
                + " Unset: HF_ZOFFLOAD_" + f.name.upper() + ", the zoffload yaml, the default."}
        if f.name == "compute_dtype":
            meta["help"] += " With the Trainer, --fp16 / --bf16 choose it (neither: fp32)."
        if f.name == "max_grad_norm":
            meta["help"] += " With the Trainer, --max_grad_norm sets it."
        if f.metadata["choices"]:
            meta["choices"] = list(f.metadata["choices"])
        if kind is bool:  # `--zero_offload_pin_memory` alone means true, as for --fp16
            meta.update(nargs="?", const=True)
        out.append((f"zero_offload_{f.name}", kind | None, field(default=None, metadata=meta)))
    return out


def _check_args(self) -> None:
    """Conflicts visible in the arguments alone; run before TrainingArguments' own checks,
    whose messages would not name ZeRO-Offload (e.g. --deepspeed tries to import it)."""
    if self.deepspeed:
        raise ValueError("--zero_offload and --deepspeed cannot be combined: both own the "
                         "optimizer state. Drop --deepspeed, or drop --zero_offload and use "
                         "DeepSpeed's own offload_optimizer")
    if self.fsdp:
        raise ValueError(f"--zero_offload and --fsdp {self.fsdp!r} cannot be combined: FSDP "
                         "shards the parameters the engine keeps whole. Drop one of them")
    optim = getattr(self.optim, "value", self.optim)
    if optim not in ALLOWED_OPTIMS:
        raise ValueError(f"--zero_offload runs AdamW on the host, so --optim {optim!r} cannot "
                         f"be used with it; allowed: {', '.join(ALLOWED_OPTIMS)}")


def _zero_offload_plugin(self) -> ZeroOffloadPlugin:
    """The engine settings: ``--zero_offload_*`` over HF_ZOFFLOAD_* over the yaml over the
    defaults, with the compute dtype and the clip norm taken from the Trainer's own options."""
    given = {n: getattr(self, f"zero_offload_{n}") for n in ZeroOffloadPlugin.names()
             if getattr(self, f"zero_offload_{n}") is not None}
    sourced, where = sourced_values()

    flag = "fp16" if self.fp16 else "bf16" if self.bf16 else None
    if "compute_dtype" in given:
        dtype, origin = given["compute_dtype"], "--zero_offload_compute_dtype"
    else:
        dtype, origin = sourced.get("compute_dtype"), f"compute_dtype in {where}"
    dtype = None if dtype is None else str(dtype).strip().lower()
    if flag and dtype is not None and dtype != flag:
        raise ValueError(f"--{flag} conflicts with {origin} = {dtype!r}: the compute dtype is "
                         f"set once; drop one of them")
    # No flag and nothing explicit: fp32, as the stock Trainer without --fp16/--bf16 (the
    # plugin's own default, bf16, is for callers that ask for nothing).
    given["compute_dtype"] = flag or dtype or "fp32"

    if "max_grad_norm" in given and float(given["max_grad_norm"]) != float(self.max_grad_norm):
        raise ValueError(f"--zero_offload_max_grad_norm {given['max_grad_norm']} conflicts with "
                         f"--max_grad_norm {self.max_grad_norm}: the Trainer clips through "
                         "--max_grad_norm; set that one")
    if "max_grad_norm" in sourced and not math.isclose(float(sourced["max_grad_norm"]),
                                                       float(self.max_grad_norm)):
        logger.warning("max_grad_norm %s from %s is replaced by the Trainer's --max_grad_norm %s",
                       sourced["max_grad_norm"], where, self.max_grad_norm)
    given["max_grad_norm"] = self.max_grad_norm
    return ZeroOffloadPlugin.from_sources(**given)


def _post_init(self) -> None:
    # Checked with or without offload: TrainingArguments rejects the pair too, but on a
    # machine without a bf16 GPU its first message is "doesn't support bf16/gpu" instead.
    if self.fp16 and self.bf16:
        raise ValueError("--fp16 and --bf16 are both set: choose one (with --zero_offload it "
                         "becomes the compute dtype), or neither for fp32")
    if self.zero_offload is None:
        self.zero_offload = enabled_from_sources(default=False)
    if self.zero_offload:
        _check_args(self)
    TrainingArguments.__post_init__(self)
    if self.zero_offload:
        self.zero_offload_plugin()  # bad values fail here, before any model work


# Generated from the plugin's fields so that a new knob is a new argument with no edit here;
# module-level so that training_args.bin (a pickle) loads wherever hf_zoffload is installed.
ZeroOffloadTrainingArguments = make_dataclass(
    "ZeroOffloadTrainingArguments",
    _argument_fields(),
    bases=(TrainingArguments,),
    namespace={
        "__post_init__": _post_init,
        "zero_offload_plugin": _zero_offload_plugin,
        "__doc__": "TrainingArguments plus `zero_offload` and one `zero_offload_<knob>` per "
                   "ZeroOffloadPlugin setting (None: taken from HF_ZOFFLOAD_*, the yaml, the "
                   "default). --fp16 / --bf16 choose the compute dtype, --max_grad_norm the "
                   "clip norm.",
    },
)
ZeroOffloadTrainingArguments.__module__ = __name__  # make_dataclass(module=) is 3.12+


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


# --------------------------------------------------------------------------- trainer
class ZeroOffloadTrainer(Trainer):
    """`Trainer` that, with ``args.zero_offload``, trains through the ZeRO-Offload engine."""

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(Trainer.__init__).bind(None, *args, **kwargs).arguments
        targs = bound.get("args")
        if getattr(targs, "zero_offload", False):
            given = [name for name, unset in (("optimizers", (None, None)),
                                              ("optimizer_cls_and_kwargs", None))
                     if bound.get(name, unset) not in (unset, None)]
            if given:
                given = "=, ".join(given) + "="
                raise ValueError(f"zero_offload=True builds its own optimizer and scheduler: "
                                 f"do not pass {given} to ZeroOffloadTrainer (set the "
                                 "learning rate and schedule in the arguments instead)")
            if targs.n_gpu > 1:
                raise ValueError(f"zero_offload=True with {targs.n_gpu} GPUs in one process "
                                 f"({_MULTI_DEVICE}); launch one process per GPU with "
                                 "torchrun, accelerate launch or hf-zoffload launch")
        super().__init__(*args, **kwargs)
        if not self.zero_offload:
            return
        # With several processes the engine reduce-scatters the gradients itself; a DDP
        # wrapper would all-reduce them a second time and keep a full gradient copy on the
        # device. evaluation_mode=True is accelerate's way to prepare a model unwrapped.
        prepare_model = self.accelerator.prepare_model
        self.accelerator.prepare_model = (
            lambda model, device_placement=None, evaluation_mode=False: prepare_model(
                model, device_placement=device_placement, evaluation_mode=True))
        if self.is_deepspeed_enabled:
            raise ValueError("zero_offload=True and a DeepSpeed accelerate config cannot be "
                             "combined; launch without DeepSpeed")
        if self.is_fsdp_enabled:
            raise ValueError("zero_offload=True and an FSDP accelerate config cannot be "
                             "combined; launch without FSDP")
        self._memory_logged = False
        self.add_callback(_MemoryReport(self))

    @property
    def zero_offload(self) -> bool:
        return bool(getattr(self.args, "zero_offload", False))

    def _build_accelerator_args(self, **kwargs):
        out = super()._build_accelerator_args(**kwargs)
        if self.zero_offload:
            out["mixed_precision"] = "no"  # the engine does mixed precision (module docstring)
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
                weight_decay=self.args.weight_decay, plugin=self.args.zero_offload_plugin(),
                param_order=opt_model.parameters())  # buckets by layer, not by group
            # The fp16 loss scaler and the clip route, on this accelerator only: the Trainer
            # clips (and reads grad_norm) through accelerator.clip_grad_norm_(
            # model.parameters(), ...); the grads are on the host by then. replace: with
            # model_init, each train() re-creates the optimizer on the same accelerator.
            core.install(self.accelerator, engine, replace=True)
            # Frozen float params join the compute dtype; reading the weights (saving,
            # evaluating, the end of training) first lands a pending delayed update.
            core.prepare_models(engine, [opt_model])
            self.optimizer = core.OffloadedOptimizer(engine)
        return self.optimizer

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The Trainer calls optimizer.state_dict() on the saving rank only; with N ranks the
        # engine's state_dict is a gather every rank must enter, so all ranks gather here.
        if self.engine is not None:  # one process: a no-op
            self.engine.consolidate_state_dict()
        super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if self.engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        # The stock path maps optimizer.pt onto each GPU when world_size > 1 (~16 B/param of
        # fp32 state per GPU, the very memory offload saves); the engine copies into host
        # buffers anyway, so read it on the CPU, memory-mapped.
        opt_path = os.path.join(checkpoint, OPTIMIZER_NAME)
        sched_path = os.path.join(checkpoint, SCHEDULER_NAME)
        if not (os.path.isfile(opt_path) and os.path.isfile(sched_path)):
            return None
        self.optimizer.load_state_dict(
            torch.load(opt_path, map_location="cpu", weights_only=True, mmap=True))
        with warnings.catch_warnings(record=True) as caught:
            self.lr_scheduler.load_state_dict(
                torch.load(sched_path, map_location="cpu", weights_only=True))
        reissue_pt_warnings(caught)
        return None

    def evaluate(self, *args, **kwargs):
        if self.engine is not None:  # evaluate the params of the last step taken
            self.engine.flush()
        return super().evaluate(*args, **kwargs)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        engine = self.engine
        if engine is not None and "loss" in logs:  # a training-step entry
            if engine.loss_scaler.is_enabled():
                logs["loss_scale"] = engine.loss_scaler.loss_scale
            logs["skipped_steps"] = engine.skipped_steps
            logs.update(self.optimizer.take_window())
        super().log(logs, *args, **kwargs)

    def _log_memory_report(self) -> None:
        engine = self.engine
        if engine is None or self._memory_logged:
            return
        self._memory_logged = True
        report = engine.memory_report()
        logger.info("ZeRO-Offload memory (model states)\n%s", format_report(report))
        self.log({"offload_device_mib": round(report["device_total"] / 2**20, 3),
                  "offload_host_mib": round(report["host_total"] / 2**20, 3),
                  "plain_adamw_device_mib": round(report["plain_adamw_device_total"] / 2**20, 3)})
