"""`ZeroOffloadTrainingArguments`: `TrainingArguments` plus ``--zero_offload`` and one
``--zero_offload_<setting>`` per `ZeroOffloadPlugin` field, generated from the fields so that a
new setting is a new argument with no edit here; and `check_argv`, which names the closest
setting for an unknown ``--zero_offload_<name>``.

The compute dtype comes from the Trainer's own ``--fp16`` / ``--bf16`` (else accelerate's
mixed_precision as `accelerate launch` exports it, else fp32), the clip norm from
``--max_grad_norm``; every other setting from ``--zero_offload_<name>`` > ``HF_ZOFFLOAD_*`` >
the sidecar yaml > the default.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import field, make_dataclass

import torch
from transformers import TrainingArguments

from ..config import ZeroOffloadPlugin, closest, enabled_from_sources, sourced_values

logger = logging.getLogger(__name__)

__all__ = ["ZeroOffloadTrainingArguments", "ALLOWED_OPTIMS", "check_argv"]

# The engine is AdamW (decoupled weight decay) with torch's hyperparameters and state keys;
# these are the Trainer optimizers with exactly that update rule.
ALLOWED_OPTIMS = ("adamw_torch", "adamw_torch_fused")
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


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


def check_argv(argv: list[str]) -> None:
    """Refuse an unknown ``--zero_offload_<name>`` on a command line before parsing, naming
    the closest setting (HfArgumentParser would list it among unused arguments, or take a
    prefix of a real one for it)."""
    options = {f"--zero_offload_{n}" for n in ZeroOffloadPlugin.names()} | {"--zero_offload"}
    for token in argv:
        option = token.split("=", 1)[0].replace("-", "_")
        if option.startswith("__zero_offload_") and "--" + option[2:] not in options:
            option = "--" + option[2:]
            raise ValueError(f"unknown option {option}; the --zero_offload_<setting> options "
                             f"are: {', '.join(sorted(options))}{closest(option, options)}")


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
        plugin = self.zero_offload_plugin()  # bad values fail here, before any model work
        # The device the Trainer will pick, without setting up devices (that would start
        # the distributed state from inside the arguments).
        cuda = torch.cuda.is_available() and not self.use_cpu
        plugin.check_device("cuda" if cuda else "cpu")


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
# make_dataclass(module=) is 3.12+. Named by the module it is imported from, so that
# training_args.bin files pickled before the arguments moved here still load.
ZeroOffloadTrainingArguments.__module__ = "hf_zoffload.integrations.trainer"
