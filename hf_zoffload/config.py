"""`ZeroOffloadPlugin`: every offload setting, under one name end to end.

A setting named ``x`` is the wizard's question ``x``, the key ``x`` under ``zoffload:`` in the
sidecar yaml, the environment variable ``HF_ZOFFLOAD_X``, the field ``ZeroOffloadPlugin.x`` and
the Trainer argument ``--zero_offload_x``.  Unknown keys and bad values raise ``ValueError``
naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "HF_ZOFFLOAD_"
CONFIG_ENV = "HF_ZOFFLOAD_CONFIG"
ENABLED_ENV = "HF_ZOFFLOAD_ENABLED"
YAML_SECTION = "zoffload"

COMPUTE_DTYPES = ("fp16", "bf16", "fp32")
KERNEL_BACKENDS = ("auto", "triton", "torch")


def _knob(default, help, *, choices=None, minimum=None, exclusive_min=False):
    meta = {"help": help, "choices": choices, "minimum": minimum, "exclusive_min": exclusive_min}
    return field(default=default, metadata=meta)


@dataclass
class ZeroOffloadPlugin:
    """Settings of the ZeRO-Offload engine.

    Build it directly (values are validated), or with :meth:`from_sources` to also read the
    sidecar yaml named by ``HF_ZOFFLOAD_CONFIG`` and ``HF_ZOFFLOAD_*`` environment variables.
    """

    compute_dtype: str = _knob(
        "bf16",
        "dtype of the parameters on the device during forward/backward "
        "(fp32 disables mixed precision).",
        choices=COMPUTE_DTYPES,
    )
    bucket_size_mb: float = _knob(
        32.0,
        "size of one gradient bucket in MiB of 16-bit gradient; a bucket is checked and copied "
        "to the host as soon as all its gradients are ready. Fractions are allowed.",
        minimum=0.0,
        exclusive_min=True,
    )
    pin_memory: bool = _knob(
        True, "use page-locked host buffers for device<->host copies (CUDA only)."
    )
    delayed_update: bool = _knob(
        False,
        "after the warm-up, run step i's CPU update while the device computes step i+1 on "
        "parameters one step stale (ZeRO-Offload's delayed parameter update).",
    )
    delayed_update_warmup_steps: int = _knob(
        40, "optimizer steps taken without delay before the delayed update starts.", minimum=0
    )
    cpu_threads: int = _knob(
        0, "threads for the CPU-Adam; 0 uses the cores this process may run on divided by "
        "the processes on this node (LOCAL_WORLD_SIZE).", minimum=0
    )
    max_grad_norm: float = _knob(
        0.0, "clip the global gradient norm to this value; 0 disables clipping.", minimum=0.0
    )
    kernels: str = _knob(
        "auto",
        "device kernels for unscale/inf-check/norm: auto (Triton on CUDA, torch on CPU), "
        "triton or torch.",
        choices=KERNEL_BACKENDS,
    )
    init_scale: float = _knob(
        2.0**16, "initial fp16 loss scale.", minimum=0.0, exclusive_min=True
    )
    growth_factor: float = _knob(
        2.0, "fp16 loss scale multiplier after growth_interval clean steps (> 1).", minimum=1.0,
        exclusive_min=True,
    )
    backoff_factor: float = _knob(
        0.5, "fp16 loss scale multiplier on back-off, in (0, 1).", minimum=0.0, exclusive_min=True
    )
    growth_interval: int = _knob(
        2000, "consecutive clean steps before the fp16 loss scale grows.", minimum=1
    )
    hysteresis: int = _knob(
        2, "overflowing steps accumulated before the fp16 loss scale backs off.", minimum=1
    )
    min_scale: float = _knob(
        1.0, "floor of the fp16 loss scale.", minimum=0.0, exclusive_min=True
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f, getattr(self, f.name)))
        if not self.backoff_factor < 1.0:
            raise ValueError(
                f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}"
            )

    # ------------------------------------------------------------------ sources
    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def help(cls, name: str) -> str:
        f = _field(name)
        choices = f.metadata["choices"]
        suffix = f" One of {', '.join(choices)}." if choices else ""
        return f"{f.metadata['help']}{suffix} Default: {f.default}."

    @classmethod
    def from_sources(cls, *, config_file: str | None = None, environ=None, **overrides):
        """Merge, lowest precedence first: the sidecar yaml (``config_file``, else the file
        named by ``HF_ZOFFLOAD_CONFIG``), ``HF_ZOFFLOAD_*`` variables, then ``overrides``."""
        values, _ = sourced_values(environ=environ, config_file=config_file)
        _check_keys(overrides, "argument")
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_env(self) -> dict[str, str]:
        """The settings as ``HF_ZOFFLOAD_*`` variables (what `hf-zoffload launch` exports)."""
        return {ENV_PREFIX + k.upper(): _env_str(v) for k, v in self.to_dict().items()}

    def save_yaml(self, path: str, *, enabled: bool = True) -> None:
        import yaml

        with open(path, "w") as fh:
            yaml.safe_dump({"zero_offload": bool(enabled), YAML_SECTION: self.to_dict()}, fh,
                           sort_keys=False)

    @property
    def torch_dtype(self):
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[
            self.compute_dtype
        ]


# ---------------------------------------------------------------------- helpers
def _field(name: str) -> dataclasses.Field:
    for f in dataclasses.fields(ZeroOffloadPlugin):
        if f.name == name:
            return f
    raise ValueError(
        f"unknown ZeRO-Offload setting {name!r}; allowed: {', '.join(ZeroOffloadPlugin.names())}"
    )


def _check_keys(values: dict, where: str) -> None:
    unknown = sorted(set(values) - set(ZeroOffloadPlugin.names()))
    if unknown:
        raise ValueError(
            f"unknown ZeRO-Offload {where} {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(ZeroOffloadPlugin.names())}"
        )


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Convert ``value`` (possibly a string from env/yaml/CLI) to the field's type, or raise."""
    name, kind = f.name, f.type if isinstance(f.type, str) else f.type.__name__
    meta = f.metadata
    try:
        if kind == "bool":
            if isinstance(value, bool):
                out = value
            elif isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
                out = value.strip().lower() in _TRUE
            else:
                raise TypeError
        elif kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            out = int(value)
        elif kind == "float":
            if isinstance(value, bool):
                raise TypeError
            out = float(value)
            if not math.isfinite(out):
                raise TypeError
        else:
            out = str(value).strip().lower()
    except (TypeError, ValueError):
        raise ValueError(
            f"ZeRO-Offload setting {name!r}: {value!r} is not a valid {kind}"
            + (" (true/false)" if kind == "bool" else "")
        ) from None
    if meta["choices"] and out not in meta["choices"]:
        raise ValueError(
            f"ZeRO-Offload setting {name!r}: {value!r} is not allowed; "
            f"allowed: {', '.join(meta['choices'])}"
        )
    low = meta["minimum"]
    if low is not None and (out < low or (meta["exclusive_min"] and out == low)):
        bound = f"> {low}" if meta["exclusive_min"] else f">= {low}"
        raise ValueError(
            f"ZeRO-Offload setting {name!r}: {value!r} is not allowed; must be {bound}"
        )
    return out


def _env_str(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def env_values(environ=None) -> dict[str, str]:
    """The ``HF_ZOFFLOAD_<NAME>`` settings present in ``environ``; unknown names raise.

    ``HF_ZOFFLOAD_CONFIG``, ``HF_ZOFFLOAD_ENABLED`` and build/kernel switches that are not
    engine settings are not read here."""
    environ = os.environ if environ is None else environ
    not_settings = {"CONFIG", "ENABLED", "PORTABLE_BUILD", "NO_OPENMP"}
    out = {}
    for key, value in environ.items():
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):] not in not_settings:
            name = key[len(ENV_PREFIX):].lower()
            if name not in ZeroOffloadPlugin.names():
                raise ValueError(
                    f"unknown environment variable {key}; allowed: "
                    + ", ".join(ENV_PREFIX + n.upper() for n in ZeroOffloadPlugin.names())
                )
            out[name] = value
    return out


def read_yaml(path: str) -> dict[str, Any]:
    """The ``zoffload:`` section of a sidecar yaml; unknown keys raise ``ValueError``."""
    import yaml

    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with a '{YAML_SECTION}:' section")
    extra = sorted(set(data) - {YAML_SECTION, "zero_offload"})
    if extra:
        raise ValueError(
            f"{path}: unknown top-level key(s) {', '.join(map(repr, extra))}; "
            f"allowed: zero_offload, {YAML_SECTION}"
        )
    section = data.get(YAML_SECTION) or {}
    if not isinstance(section, dict):
        raise ValueError(f"{path}: '{YAML_SECTION}' must be a mapping")
    _check_keys(section, f"key in {path}")
    return dict(section)


def sourced_values(environ=None, config_file: str | None = None) -> tuple[dict[str, Any], str]:
    """The settings the sources give, before any argument: the sidecar yaml (``config_file``,
    else the file named by ``HF_ZOFFLOAD_CONFIG``) overlaid by ``HF_ZOFFLOAD_*`` variables,
    as raw values; and where they came from, for messages (e.g. ``"x_zoffload.yaml /
    HF_ZOFFLOAD_* variables"``). Unknown keys raise, as in `read_yaml` and `env_values`."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    where = []
    path = config_file or environ.get(CONFIG_ENV)
    if path:
        values.update(read_yaml(path))
        where.append(path)
    values.update(env_values(environ))
    return values, " / ".join(where + ["HF_ZOFFLOAD_* variables"])


def enabled_from_sources(*, default: bool, environ=None) -> bool:
    """The on/off switch: ``HF_ZOFFLOAD_ENABLED`` if set, else the sidecar's top-level
    ``zero_offload:`` (file named by ``HF_ZOFFLOAD_CONFIG``), else ``default`` (True for
    `prepare_zero_offload`, whose caller asked for offload; False for the Trainer's
    ``--zero_offload``, off unless asked)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENABLED_ENV)
    if raw is not None:
        value = str(raw).strip().lower()
        if value not in _TRUE | _FALSE:
            raise ValueError(f"{ENABLED_ENV}={raw!r} is not allowed; allowed: "
                             f"{', '.join(sorted(_TRUE | _FALSE))}")
        return value in _TRUE
    path = environ.get(CONFIG_ENV)
    if not path:
        return default
    import yaml

    read_yaml(path)  # unknown keys and a missing file fail here, with the file named
    with open(path) as fh:
        flag = (yaml.safe_load(fh) or {}).get("zero_offload", default)
    if not isinstance(flag, bool):
        raise ValueError(f"{path}: 'zero_offload' must be true or false, got {flag!r}")
    return flag
