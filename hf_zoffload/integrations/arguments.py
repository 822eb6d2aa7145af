"""`zero_offload_args`: an argument class (`TrainingArguments`, TRL's ``SFTConfig``, ...) plus
``--zero_offload`` and one ``--zero_offload_<setting>`` per `ZeroOffloadPlugin` field, generated
from the fields so that a new setting is a new argument with no edit here, and the Trainer's
own options (`TRAINER_OPTIONS`: ``--zero_offload_log_history_extras``), which are not engine
settings; and
`check_argv`, which names the closest option for an unknown ``--zero_offload_<name>``.
``ZeroOffloadTrainingArguments`` is ``zero_offload_args(TrainingArguments)``; the checks are
`ZeroOffloadArgumentsMixin`'s, around the base class's own ``__post_init__``.

The compute dtype comes from the Trainer's own ``--fp16`` / ``--bf16`` (else accelerate's
mixed_precision as `accelerate launch` exports it, else fp32), the clip norm from
``--max_grad_norm``; every other setting from ``--zero_offload_<name>`` > ``HF_ZOFFLOAD_*`` >
the sidecar yaml > the default.

Nothing given is ignored: with offload on, Trainer options the offload path has no use for
raise (`UNUSED`, `_check_args`), and a Trainer without the offload mixin refuses these
arguments (`ZeroOffloadArgumentsMixin.get_process_log_level`); with offload off,
``--zero_offload_<name>`` is refused or, when offload was turned off on purpose, logged as
unused (`_check_off`). ``--fsdp`` / ``fsdp_config`` go with ``--zero_offload`` for FSDP2 with
CPU offload only (`_check_fsdp`); the model then stays on the host until it is sharded
(``place_model_on_device``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import field, make_dataclass

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import TrainingArguments

from ..config import (
    ZeroOffloadPlugin,
    check_values,
    closest,
    enabled_from_sources,
    sourced_values,
)
from ..ops.adam_kernels import check_hyper
from ..ops.moments import moment_format
from . import compat, fsdp2

logger = logging.getLogger(__name__)

__all__ = ["ZeroOffloadTrainingArguments", "ZeroOffloadArgumentsMixin", "zero_offload_args",
           "ALLOWED_OPTIMS", "TRAINER_OPTIONS", "check_argv"]

# The engine is AdamW (decoupled weight decay) with torch's hyperparameters and state keys;
# these are the Trainer optimizers with exactly that update rule.
ALLOWED_OPTIMS = ("adamw_torch", "adamw_torch_fused")
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
# A Trainer class that builds the offload engine from these arguments says so with this class
# attribute (ZeroOffloadTrainer); any other Trainer would train with them and no offload.
OFFLOADS_ATTR = "builds_zero_offload_engine"
# Arguments the offload path has no use for, each with why; set to anything, they raise
# (the stock Trainer reads them, so a user who sets one expects an effect).
UNUSED = {
    "optim_args": "the offloaded AdamW takes its hyperparameters from --learning_rate, "
                  "--adam_beta1, --adam_beta2, --adam_epsilon and --weight_decay",
    "optim_target_modules": "it selects modules for GaLore / APOLLO optimizers; the offloaded "
                            "AdamW trains every param with requires_grad",
    **{name: "the model is not wrapped in DDP (the engine reduces the gradients itself, in "
             "buckets of --zero_offload_bucket_size_mb)" for name in (
        "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
        "ddp_static_graph")},
}


# Options of the Trainer's own, not engine settings: no ZeroOffloadPlugin field, so no
# HF_ZOFFLOAD_* variable or yaml key either (env_values and read_yaml refuse those names).
# Each is a bool, off by default: --zero_offload_<name> alone turns it on.
TRAINER_OPTIONS = {
    "log_history_extras": "Also keep in state.log_history (and trainer_state.json) the figures "
                          "the offload Trainer logs: the memory report on the first entry, "
                          "loss_scale (fp16), skipped_steps and the step's time split "
                          "(fwd_bwd_ms, ...) on each training-step entry. Off: log_history "
                          "has the stock Trainer's entries and keys only; the printed log lines "
                          "and the report_to integrations get the figures either way. "
                          "Default: False.",
}


def _argument_fields() -> list[tuple]:
    out = [("zero_offload", bool | None, field(default=None, metadata={
        "help": "Keep fp32 master weights and Adam state in host memory and run AdamW there "
                "(ZeRO-Offload); the device keeps the compute-dtype params only. Unset: "
                "HF_ZOFFLOAD_ENABLED, else the zoffload yaml's zero_offload (as `hf-zoffload "
                "launch` passes them), else off.",
        "nargs": "?", "const": True}))]
    out += [(f"zero_offload_{name}", bool, field(default=False, metadata={
        "help": "ZeRO-Offload Trainer: " + why, "nargs": "?", "const": True}))
        for name, why in TRAINER_OPTIONS.items()]
    for f in dataclasses.fields(ZeroOffloadPlugin):
        kind = _TYPES[f.type if isinstance(f.type, str) else f.type.__name__]
        meta = {"help": "ZeRO-Offload: " + ZeroOffloadPlugin.help(f.name)
                + " Unset: HF_ZOFFLOAD_" + f.name.upper() + ", the zoffload yaml, the default."}
        if f.name == "compute_dtype":
            meta["help"] += " With the Trainer, --fp16 / --bf16 choose it (neither: fp32)."
        if f.name == "max_grad_norm":
            meta["help"] += " With the Trainer, --max_grad_norm sets it."
        # argparse %-formats help strings (HfArgumentParser hands these to it): "10%" must
        # reach it as "10%%"
        meta["help"] = meta["help"].replace("%", "%%")
        if f.metadata["choices"]:
            meta["choices"] = list(f.metadata["choices"])
        if kind is bool:  # `--zero_offload_pin_memory` alone means true, as for --fp16
            meta.update(nargs="?", const=True)
        out.append((f"zero_offload_{f.name}", kind | None, field(default=None, metadata=meta)))
    return out


def check_argv(argv: list[str]) -> None:
    """Refuse an unknown ``--zero_offload_<name>`` on a command line before parsing, naming
    the closest setting (HfArgumentParser would list it among unused arguments, or take a
    prefix of a real one for it)."""
    options = {f"--zero_offload_{n}" for n in [*ZeroOffloadPlugin.names(), *TRAINER_OPTIONS]}
    options.add("--zero_offload")
    for token in argv:
        option = token.split("=", 1)[0].replace("-", "_")
        if option.startswith("__zero_offload_") and "--" + option[2:] not in options:
            option = "--" + option[2:]
            raise ValueError(f"unknown option {option}; the --zero_offload_<name> options "
                             f"are: {', '.join(sorted(options))}{closest(option, options)}")


def _check_args(self) -> None:
    """Conflicts visible in the arguments alone; run before TrainingArguments' own checks,
    whose messages would not name ZeRO-Offload (e.g. --deepspeed tries to import it)."""
    if self.deepspeed:
        raise ValueError("--zero_offload and --deepspeed cannot be combined: both own the "
                         "optimizer state. Drop --deepspeed, or drop --zero_offload and use "
                         "DeepSpeed's own offload_optimizer")
    optim = getattr(self.optim, "value", self.optim)
    if optim not in ALLOWED_OPTIMS:
        raise ValueError(f"--zero_offload runs AdamW on the host, so --optim {optim!r} cannot "
                         f"be used with it; allowed: {', '.join(ALLOWED_OPTIMS)}")
    for name, why in UNUSED.items():
        if getattr(self, name) is not None:
            raise ValueError(f"--{name} {getattr(self, name)!r} has no effect with "
                             f"--zero_offload: {why}. Drop it")
    # The stock Trainer clips only when max_grad_norm > 0, so a negative or missing value
    # turned clipping off without a word; the engine's own setting allows 0 (off) and up.
    if self.max_grad_norm is None or not self.max_grad_norm >= 0:
        raise ValueError(f"--max_grad_norm {self.max_grad_norm!r} is not allowed with "
                         "--zero_offload; allowed: a number >= 0 (0 turns clipping off)")
    # The engine checks these again when it is built, inside train(); here they fail before
    # the model is loaded, naming the options.
    try:
        check_hyper(self.learning_rate, (self.adam_beta1, self.adam_beta2), self.adam_epsilon,
                    self.weight_decay, where="--zero_offload's AdamW",
                    beta_names=("--adam_beta1", "--adam_beta2"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{err} (lr: --learning_rate, eps: --adam_epsilon, weight_decay: "
                         "--weight_decay)") from None


def _check_fsdp(self, given, config, dtype) -> None:
    """``--fsdp`` / ``fsdp_config`` with ``--zero_offload``: FSDP2 with CPU offload only
    (integrations/fsdp2.py), refused otherwise before the model is loaded."""
    where = f"--zero_offload with --fsdp {given!r}" + (" and fsdp_config" if config else "")
    args = self.fsdp_plugin_args
    if args is None:  # TrainingArguments builds no plugin for XLA's FSDP
        raise ValueError(f"{where}: XLA's FSDP is not supported; allowed: FSDP2 with CPU "
                         "offload (--fsdp \"full_shard offload\")")
    if args["fsdp_version"] != 2:  # checked first: an FSDP1 plugin needs a device to build
        raise ValueError(f"{where}: FSDP{args['fsdp_version']} (fsdp_config version "
                         f"{args['fsdp_version']}) is not supported; allowed: FSDP2 (version 2, "
                         "the default) with CPU offload (--fsdp \"full_shard offload\")")
    pc = self.parallelism_config
    why = fsdp2.why_not(FullyShardedDataParallelPlugin(**args), dtype=dtype,
                        tp=pc.tp_size if pc is not None else 1,
                        replicas=pc.dp_replicate_size if pc is not None else 1)
    if why:
        raise ValueError(f"{where}: {why}")


def _given(self) -> dict:
    """The ``--zero_offload_<name>`` arguments that were set."""
    return {n: getattr(self, f"zero_offload_{n}") for n in ZeroOffloadPlugin.names()
            if getattr(self, f"zero_offload_{n}") is not None}


def _check_off(self, said_off: bool) -> None:
    """``--zero_offload_<name>`` with offload off: a bad value fails anyway; with offload off
    by default (nobody turned it on or off) the settings would be ignored without a word, most
    likely a forgotten --zero_offload: refused. Turned off on purpose (--zero_offload false,
    HF_ZOFFLOAD_ENABLED=false, the sidecar's zero_offload: false: a script that sets its
    offload settings in code, launched with offload off), they are unused: said once."""
    given = _given(self)
    turned_on = [n for n in TRAINER_OPTIONS if getattr(self, f"zero_offload_{n}")]
    if not given and not turned_on:
        return
    check_values(given, lambda name: f"--zero_offload_{name}")
    names = ", ".join(f"--zero_offload_{n}" for n in [*given, *turned_on])
    if not said_off:
        raise ValueError(f"{names} set, but ZeRO-Offload is off: add --zero_offload (or "
                         "zero_offload=True) to use it, or drop the setting")
    logger.warning("ZeRO-Offload is off (--zero_offload false, HF_ZOFFLOAD_ENABLED or the "
                   "sidecar's zero_offload: false): %s not used", names)


def _check_trainer_options(self) -> None:
    """The Trainer-only options are bools: a string such as "false" would read as on."""
    for name in TRAINER_OPTIONS:
        value = getattr(self, f"zero_offload_{name}")
        if not isinstance(value, bool):
            raise ValueError(f"--zero_offload_{name}: {value!r} is not allowed; allowed: "
                             "True, False")



def _zero_offload_plugin(self, model=None) -> ZeroOffloadPlugin:
    """`ZeroOffloadArgumentsMixin.zero_offload_plugin`."""
    given = _given(self)
    check_values(given, lambda name: f"--zero_offload_{name}")  # naming the option
    sourced, where = sourced_values()

    flag = "fp16" if self.fp16 else "bf16" if self.bf16 else None
    flag_name = f"--{flag}"
    if flag is None and getattr(self, "mixed_precision", "no") in ("fp16", "bf16"):
        # TrainingArguments took it from ACCELERATE_MIXED_PRECISION (`accelerate launch`
        # with a config whose mixed_precision is fp16/bf16): the stock Trainer trains in it.
        flag = self.mixed_precision
        flag_name = f"accelerate's mixed_precision {flag} (ACCELERATE_MIXED_PRECISION)"
    if "compute_dtype" in given:
        dtype, origin = given["compute_dtype"], "--zero_offload_compute_dtype"
    else:
        dtype, origin = sourced.get("compute_dtype"), f"compute_dtype in {where}"
    dtype = None if dtype is None else str(dtype).strip().lower()
    if flag and dtype is not None and dtype != flag:
        raise ValueError(f"{flag_name} conflicts with {origin} = {dtype!r}: the compute dtype "
                         f"is set once; drop one of them")
    # No flag and nothing explicit: the model's dtype, as the stock Trainer without --fp16 /
    # --bf16 trains a model in the dtype it was loaded in: fp32, or a 16-bit one (the
    # plugin's own default, bf16, is for callers that ask for nothing).
    given["compute_dtype"] = flag or dtype or _trained_dtype(model) or "fp32"

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


def _trained_dtype(model) -> str | None:
    """The compute dtype of a model loaded in 16-bit: the 16-bit dtype that most of its float
    param elements have (a LoRA model over a bf16 base, its adapters in fp32 as peft makes
    them: bf16, so that the base stays bf16 on the device), else None (fp32)."""
    if model is None:
        return None
    sizes: dict = {}
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if not sizes:
        return None
    most = max(sizes, key=sizes.get)
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(most)


def _check_composed(cls) -> None:
    """A class that combines these arguments with another argument class must be a dataclass
    itself, or its ``__init__`` (the first base's) would not take the other's fields."""
    init_owner = next(k for k in cls.__mro__ if "__init__" in vars(k))
    own = set(getattr(init_owner, "__dataclass_fields__", {}))
    every = {name for k in cls.__mro__ for name in getattr(k, "__dataclass_fields__", {})}
    missing = every - own
    if missing:
        others = [k.__name__ for k in cls.__mro__[1:] if "__dataclass_fields__" in vars(k)
                  and set(vars(k)["__dataclass_fields__"]) & missing]
        raise TypeError(f"{cls.__name__} combines ZeRO-Offload's arguments with "
                        f"{', '.join(others[:2])} but is not a dataclass, so it takes none of "
                        f"{others[0]}'s options: decorate it with @dataclasses.dataclass, or "
                        f"use hf_zoffload.zero_offload_args({others[0]})")


class ZeroOffloadArgumentsMixin:
    """What `zero_offload_args` adds to an argument class besides the fields: the checks, which
    run before and after the base class's own ``__post_init__`` (reached through ``super()``,
    so a TRL config's set-up runs too, in either order of the bases), the engine settings, and
    the placement rule for FSDP2."""

    def __new__(cls, *args, **kwargs):  # before the generated __init__ refuses any option
        _composed_ok(cls)
        return super().__new__(cls)

    def __post_init__(self):
        _check_trainer_options(self)
        # Checked with or without offload: TrainingArguments rejects the pair too, but on a
        # machine without a bf16 GPU its first message is "doesn't support bf16/gpu" instead.
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are both set: choose one (with --zero_offload it "
                             "becomes the compute dtype), or neither for fp32")
        said_off = self.zero_offload is False
        fsdp_given = (self.fsdp, self.fsdp_config)  # TrainingArguments rewrites both
        if self.zero_offload is None:
            enabled = enabled_from_sources(default=None)  # None: no source says on or off
            said_off, self.zero_offload = enabled is False, bool(enabled)
        if self.zero_offload:
            _check_args(self)
        else:
            _check_off(self, said_off)
        super().__post_init__()
        if self.zero_offload:
            plugin = self.zero_offload_plugin()  # bad values fail here, before any model work
            # The device the Trainer will pick, without setting up devices (that would start
            # the distributed state from inside the arguments).
            cuda = torch.cuda.is_available() and not self.use_cpu
            plugin.check_device("cuda" if cuda else "cpu")
            if self.fsdp:
                _check_fsdp(self, *fsdp_given, plugin.torch_dtype)
            try:  # the engine would refuse them inside train()
                moment_format(plugin.state_dtype).check_betas(self.adam_beta1, self.adam_beta2)
            except ValueError as err:
                raise ValueError(f"--adam_beta1 {self.adam_beta1} / --adam_beta2 "
                                 f"{self.adam_beta2} with --zero_offload_state_dtype "
                                 f"{plugin.state_dtype}: {err}") from None

    def get_process_log_level(self) -> int:
        # transformers.Trainer.__init__ calls this before it touches the model; for everyone
        # else (scripts set up their logging with it) it is the ordinary method.
        trainer = compat.trainer_being_built() if self.zero_offload else None
        if trainer is not None and not getattr(trainer, OFFLOADS_ATTR, False):
            # Refused, not offloaded: offload is more than an optimizer swap (the clip route,
            # the fp16 scaler, the master weights saved, mixed precision done by the engine,
            # no DDP wrapper: ZeroOffloadTrainerMixin's overrides). Patching a stock Trainer
            # from its arguments would do part of that, and a partial offload saves wrong
            # weights.
            name = type(trainer).__name__
            raise ValueError(
                f"{name} was given {type(self).__name__} with zero_offload=True, but {name} is "
                f"not a ZeRO-Offload trainer and would train without offload. Use "
                f"hf_zoffload.zero_offload_trainer({name}) (hf_zoffload.ZeroOffloadTrainer for "
                "transformers.Trainer), or zero_offload=False")
        return super().get_process_log_level()

    @property
    def place_model_on_device(self) -> bool:
        # FSDP2 parameter offload: the params stay on the host, where fully_shard keeps each
        # rank's shard; FSDP2 copies a layer's to the device for its forward and backward.
        if self.zero_offload and (self.fsdp or fsdp2.requested(None) is not None):
            return False
        return super().place_model_on_device

    def zero_offload_plugin(self, model=None) -> ZeroOffloadPlugin:
        """The engine settings: ``--zero_offload_*`` over HF_ZOFFLOAD_* over the yaml over the
        defaults, with the compute dtype and the clip norm taken from the Trainer's own
        options. Given the ``model`` to train, with no precision asked for anywhere, the
        compute dtype is that of a model loaded in 16-bit (the stock Trainer trains it in its
        dtype; `_trained_dtype`), else fp32."""
        return _zero_offload_plugin(self, model)

    def __reduce_ex__(self, protocol):
        # A class made by zero_offload_args at run time has no importable name: pickled
        # (training_args.bin, deepcopy) as its base class, which is, and remade from it.
        base = _MADE.get(type(self))
        if base is None:
            return super().__reduce_ex__(protocol)
        return _remake, (base, self.__dict__.copy())


@functools.cache
def _composed_ok(cls) -> None:
    _check_composed(cls)


def _remake(base, state):
    obj = object.__new__(zero_offload_args(base))
    obj.__dict__.update(state)
    return obj


_MADE: dict = {}  # class made by zero_offload_args -> its base, for those pickled by base


@functools.cache
def _make_args(cls):
    made = make_dataclass(f"ZeroOffload{cls.__name__}", _argument_fields(),
                          bases=(ZeroOffloadArgumentsMixin, cls),
                          namespace={"__doc__": f"`{cls.__name__}` plus `zero_offload` and the "
                                                "`zero_offload_<setting>` fields "
                                                "(`zero_offload_args`)."})
    made.__module__ = __name__
    _MADE[made] = cls
    return made


def zero_offload_args(cls: type) -> type:
    """``cls`` (`TrainingArguments` or a subclass, e.g. TRL's ``SFTConfig``) plus
    ``zero_offload``, one ``zero_offload_<setting>`` per `ZeroOffloadPlugin` setting and the
    Trainer's own options, as a dataclass whose ``__post_init__`` runs ``cls``'s through
    ``super()``. `HfArgumentParser` parses it (``--zero_offload``, ``--zero_offload_<setting>``)
    beside ``cls``'s own options. The same class for the same ``cls``; a class that has them
    already is returned as it is. ``ZeroOffloadTrainingArguments`` is
    ``zero_offload_args(TrainingArguments)``."""
    if not (isinstance(cls, type) and issubclass(cls, TrainingArguments)):
        raise TypeError(f"zero_offload_args takes TrainingArguments or a subclass of it (TRL's "
                        f"SFTConfig, DPOConfig, ...), got {cls!r}")
    if issubclass(cls, ZeroOffloadArgumentsMixin):
        return cls
    return _make_args(cls)


# The one made here for transformers' own class: a module-level name, so that
# training_args.bin (a pickle) loads wherever hf_zoffload is installed.
ZeroOffloadTrainingArguments = _make_args(TrainingArguments)
del _MADE[ZeroOffloadTrainingArguments]  # pickled by its name
ZeroOffloadTrainingArguments.__doc__ = (
    "TrainingArguments plus `zero_offload`, one `zero_offload_<knob>` per ZeroOffloadPlugin "
    "setting (None: taken from HF_ZOFFLOAD_*, the yaml, the default) and the Trainer's own "
    "`zero_offload_log_history_extras`. --fp16 / --bf16 choose the compute dtype, "
    "--max_grad_norm the clip norm.")
# Named by the module it is imported from, so that training_args.bin files pickled before
# the arguments moved here still load.
ZeroOffloadTrainingArguments.__module__ = "hf_zoffload.integrations.trainer"
