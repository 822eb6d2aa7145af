"""`ZeroOffloadPlugin`: every offload setting, under one name end to end.

A setting named ``x`` is the wizard's question ``x``, the key ``x`` under ``zoffload:`` in the
sidecar yaml, the environment variable ``HF_ZOFFLOAD_<X>``, the field ``ZeroOffloadPlugin.x`` and
the Trainer argument ``--zero_offload_x``.  Unknown keys and bad values raise ``ValueError``
naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .sidecar import TOP_LEVEL_KEYS, YAML_SECTION, load_sidecar
from .units import SIZE_UNITS, parse_quantity, parse_size  # noqa: F401 (re-exported)

ENV_PREFIX = "HF_ZOFFLOAD_"
CONFIG_ENV = "HF_ZOFFLOAD_CONFIG"
ENABLED_ENV = "HF_ZOFFLOAD_ENABLED"
TRACEBACK_ENV = "HF_ZOFFLOAD_TRACEBACK"

COMPUTE_DTYPES = ("fp16", "bf16", "fp32")
KERNEL_BACKENDS = ("auto", "triton", "torch")
STATE_DTYPES = ("fp32", "bf16", "int8", "int4")
MASTER_DTYPES = ("fp32", "bf16")
SAVE_DTYPES = ("fp32", "compute")
# Variables with the prefix that are not engine settings, and who reads them; every
# HF_ZOFFLOAD_ name the package, its scripts and docs mention is a setting or one of these
# (tests/test_env_names.py greps them).
NOT_SETTINGS = {
    "ENABLED": "the on/off switch (enabled_from_sources)",
    "CONFIG": "the sidecar yaml's path (sourced_values)",
    "TRACEBACK": "a bad setting raised with its traceback (commands/errors.py)",
    "PORTABLE_BUILD": "setup.py: no -march=native",
    "NO_OPENMP": "setup.py: the kernel built without OpenMP",
    "REQUIRE_GPU": "the test suite: a skipped gpu test fails (tests/conftest.py)",
    "CACHE": "scripts/gpu/setup_stack.sh: where the GPU check's environment lives",
}


def _knob(default, help, *, choices=None, minimum=None, exclusive_min=False, maximum=None,
          exclusive_max=False, size=False, fraction=False):
    meta = {"help": help, "choices": choices, "minimum": minimum, "exclusive_min": exclusive_min,
            "maximum": maximum, "exclusive_max": exclusive_max, "size": size,
            "fraction": fraction}
    return field(default=default, metadata=meta)


# The loss scale is kept and applied as an fp32 number: above this it is inf, and every
# step would overflow.
FP32_MAX = 3.4028234663852886e38


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
    overlap_step: bool = _knob(
        False,
        "start each bucket's CPU update during the backward that ends the step, as soon as "
        "its gradient is on the host, and publish the new parameters once the step is "
        "validated (exact: an fp16 overflow or a clipped norm undoes and redoes the early "
        "updates). Needs fp32 state_dtype and master_dtype; not with delayed_update.",
    )
    # The kernel takes the count as a C int (2**31 overflowed it at the first step, after the
    # host state was allocated); 2**15 is far above any host's hardware threads.
    cpu_threads: int = _knob(
        0, "threads for the CPU-Adam and the engine's other host work; 0 uses the cores this "
        "process may run on, divided by the processes on this node (LOCAL_WORLD_SIZE) unless "
        "bind_cores gave it its own.", minimum=0, maximum=2**15
    )
    bind_cores: bool = _knob(
        True, "with several processes on a node (LOCAL_WORLD_SIZE > 1), bind each to its "
        "local rank's share of whole physical cores, unless its CPU affinity was narrowed "
        "already (numactl, taskset, a launcher)."
    )
    state_dtype: str = _knob(
        "fp32",
        "dtype in which the host keeps the Adam moments: fp32 (exact), or bf16 / int8 / int4 "
        "(less host memory, rounded).",
        choices=STATE_DTYPES,
    )
    master_dtype: str = _knob(
        "fp32",
        "dtype of the master weights in host memory: fp32, or bf16 (the bf16 params "
        "themselves, updated with stochastic rounding; 2 B/param less, needs compute_dtype "
        "bf16).",
        choices=MASTER_DTYPES,
    )
    save_dtype: str = _knob(
        "fp32",
        "weights the Trainer and Accelerate paths save as the model's: fp32 (the master "
        "weights, as a stock mixed-precision run saves) or compute (the device copy in "
        "compute_dtype, half the size with fp16/bf16).",
        choices=SAVE_DTYPES,
    )
    host_memory_limit: str = _knob(
        "0",
        "host memory this process may use for the optimizer state, with a unit (48GiB, "
        "64GB); the engine refuses to start when its state needs more. 0: what the machine "
        "has available (MemAvailable, or the cgroup limit when lower) divided by the "
        "processes on this node.",
        size=True,
    )
    offload_fraction: str = _knob(
        "1",
        "share of this process's optimizer state kept on the host, a number in [0, 1]; the "
        "rest (the buckets of the first layers in forward order) keeps its fp32 master and "
        "moments on the device and is updated there. auto: all on the host for the first "
        "step, then as many buckets on the device as the memory that step left free holds "
        "(the device's total or device_memory_limit, less a 10% margin).",
        fraction=True,
    )
    device_memory_limit: str = _knob(
        "0",
        "device memory offload_fraction auto may plan with, with a unit (40GiB); 0: the "
        "device's total. Only with offload_fraction auto.",
        size=True,
    )
    max_grad_norm: float = _knob(
        0.0, "clip the global gradient norm to this value; 0 disables clipping.", minimum=0.0
    )
    # 3: in bf16/fp32 the masters are non-finite from the first bad step on, so the stop
    # comes 2 steps later with nothing saved in between; in fp16 a batch whose loss alone was
    # non-finite is skipped, and the clean ones after it end the streak.
    max_nonfinite_steps: int = _knob(
        3, "consecutive optimizer steps with a non-finite loss or gradient norm after which "
        "the run stops with an error naming the first (an fp16 overflow skip counts only "
        "once the loss scale is at min_scale); the Trainer saves no checkpoint while such a "
        "streak lasts. 0: never stop.", minimum=0
    )
    kernels: str = _knob(
        "auto",
        "device kernels for unscale/inf-check/norm: auto (Triton on CUDA, torch on CPU), "
        "triton or torch.",
        choices=KERNEL_BACKENDS,
    )
    init_scale: float = _knob(
        2.0**16, "initial fp16 loss scale (at least min_scale).", minimum=0.0,
        exclusive_min=True, maximum=FP32_MAX,
    )
    growth_factor: float = _knob(
        2.0, "fp16 loss scale multiplier after growth_interval clean steps (> 1).", minimum=1.0,
        exclusive_min=True,
    )
    backoff_factor: float = _knob(
        0.5, "fp16 loss scale multiplier on back-off, in (0, 1).", minimum=0.0, exclusive_min=True,
        maximum=1.0, exclusive_max=True,
    )
    growth_interval: int = _knob(
        2000, "consecutive clean steps before the fp16 loss scale grows.", minimum=1
    )
    hysteresis: int = _knob(
        2, "overflowing steps accumulated before the fp16 loss scale backs off.", minimum=1
    )
    min_scale: float = _knob(
        1.0, "floor of the fp16 loss scale.", minimum=0.0, exclusive_min=True, maximum=FP32_MAX
    )

    def __new__(cls, *args, **kwargs):
        # The dataclass's own __init__ would say only "unexpected keyword argument": the
        # closest name too, as every other route (yaml, variables, arguments) says.
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(f"ZeroOffloadPlugin() got an unexpected keyword argument "
                            f"{unknown[0]!r}; allowed: {', '.join(names)}"
                            f"{closest(unknown[0], names)}")
        return super().__new__(cls)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f, getattr(self, f.name)))
        # Checked here, not first by the loss scaler when the engine is built (inside the
        # Trainer's train(), after the model was loaded and moved).
        if self.min_scale > self.init_scale:
            raise ValueError(f"ZeRO-Offload settings 'init_scale' {self.init_scale!r} and "
                             f"'min_scale' {self.min_scale!r}: init_scale must be >= min_scale")
        self.check_master()
        self.check_schedule()
        if self.device_memory_limit_bytes and self.offload_fraction != "auto":
            raise ValueError(
                f"ZeRO-Offload setting 'device_memory_limit' {self.device_memory_limit!r} "
                f"applies only with offload_fraction auto, and offload_fraction is "
                f"{self.offload_fraction}: set offload_fraction to auto, or unset "
                "device_memory_limit")

    def check_master(self) -> None:
        """A bf16 master only with bf16 compute: the master is the device's param
        (`ops.masters`). Also checked when the engine is built, as an integration may set
        compute_dtype after this plugin was made."""
        if self.master_dtype == "bf16" and self.compute_dtype != "bf16":
            raise ValueError(
                f"ZeRO-Offload settings 'master_dtype': 'bf16' needs compute_dtype bf16 (the "
                f"bf16 master is the device's param), got compute_dtype "
                f"{self.compute_dtype!r}; allowed with it: master_dtype fp32")

    def check_schedule(self) -> None:
        """overlap_step: one schedule at a time, and the state its correction can invert
        (an fp32 step undone from its gradient: offload/schedules/inverse.py)."""
        if not self.overlap_step:
            return
        if self.delayed_update:
            raise ValueError("ZeRO-Offload settings 'overlap_step' and 'delayed_update' are "
                             "two step schedules; allowed: one of them")
        compact = [f"{k} {getattr(self, k)!r}" for k in ("state_dtype", "master_dtype")
                   if getattr(self, k) != "fp32"]
        if compact:
            raise ValueError(f"ZeRO-Offload setting 'overlap_step' with {', '.join(compact)}: "
                             "its correction inverts an fp32 update; allowed with "
                             "overlap_step: state_dtype fp32 and master_dtype fp32")

    @property
    def offload_fraction_value(self) -> float | None:
        """``offload_fraction`` as a number in [0, 1]; None for ``auto``."""
        return None if self.offload_fraction == "auto" else float(self.offload_fraction)

    @property
    def device_memory_limit_bytes(self) -> int:
        """``device_memory_limit`` in bytes; 0 when not set."""
        return parse_size(self.device_memory_limit, "device_memory_limit", zero_ok=True)

    @property
    def host_memory_limit_bytes(self) -> int:
        """``host_memory_limit`` in bytes; 0 when not set."""
        return parse_size(self.host_memory_limit, "host_memory_limit", zero_ok=True)

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

    def to_dict(self, names=None) -> dict[str, Any]:
        """The settings named in ``names`` (default: all), in field order."""
        out = dataclasses.asdict(self)
        if names is None:
            return out
        names = set(names)
        _check_keys(dict.fromkeys(names), "setting")
        return {k: v for k, v in out.items() if k in names}

    def changed(self) -> list[str]:
        """The settings whose value differs from the default."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]

    def to_env(self, names=None) -> dict[str, str]:
        """The settings named in ``names`` (default: all) as ``HF_ZOFFLOAD_*`` variables."""
        return {ENV_PREFIX + k.upper(): _env_str(v) for k, v in self.to_dict(names).items()}

    def save_yaml(self, path: str, *, enabled: bool = True, names=None) -> None:
        """Write the sidecar: the on/off switch and the settings named in ``names`` (default:
        those that differ from their defaults). Settings left out keep following their
        defaults, and ``compute_dtype`` accelerate's / the Trainer's mixed precision, so a
        sidecar never pins a value nobody chose."""
        import yaml

        names = self.changed() if names is None else names
        with open(path, "w") as fh:
            yaml.safe_dump({"zero_offload": bool(enabled), YAML_SECTION: self.to_dict(names)},
                           fh, sort_keys=False)

    def check_device(self, device_type: str) -> None:
        """Refuse settings this machine cannot run, before any work: ``kernels=triton``
        without a CUDA device (the Triton kernels compile for CUDA; on a CPU they run only in
        Triton's interpreter, ``TRITON_INTERPRET=1``, which is for tests)."""
        interpreted = os.environ.get("TRITON_INTERPRET", "") == "1"
        if self.kernels == "triton" and device_type != "cuda" and not interpreted:
            raise ValueError(
                f"ZeRO-Offload setting 'kernels': 'triton' needs a CUDA device, and this run's "
                f"device is {device_type}; allowed here: auto, torch (or set TRITON_INTERPRET=1 "
                "for Triton's interpreter)")

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


def closest(name: str, names) -> str:
    """"; did you mean 'x'?" for the closest of ``names``, or "" when none is close."""
    import difflib

    match = difflib.get_close_matches(str(name), list(names), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _check_keys(values: dict, where: str) -> None:
    names = ZeroOffloadPlugin.names()
    unknown = sorted(set(values) - set(names), key=str)
    if unknown:
        raise ValueError(
            f"unknown ZeRO-Offload {where} {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(names)}{closest(unknown[0], names)}"
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
                raise TypeError  # inf and nan: no setting means anything by them
        else:
            out = str(value).strip().lower()
            if meta["fraction"]:
                out = _fraction(name, value)
            if meta["size"]:  # the message shows the value as given, not lowercased
                parse_size(str(value).strip(), f"ZeRO-Offload setting {name!r}:", zero_ok=True)
    except (TypeError, ValueError) as err:
        if meta["size"] or meta["fraction"]:
            raise ValueError(str(err)) from None
        raise ValueError(
            f"ZeRO-Offload setting {name!r}: {value!r} is not a valid {kind}"
            + {"bool": " (true/false)", "float": " (a finite number)"}.get(kind, "")
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
    high = meta["maximum"]
    if high is not None and (out > high or (meta["exclusive_max"] and out == high)):
        bound = f"< {high}" if meta["exclusive_max"] else f"<= {high}"
        raise ValueError(
            f"ZeRO-Offload setting {name!r}: {value!r} is not allowed; must be {bound}"
        )
    return out


def _fraction(name: str, value: Any) -> str:
    """``auto``, or a number in [0, 1] written as Python's shortest form ("0.5", "1")."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    try:
        x = float(text) if not isinstance(value, bool) else math.nan
    except ValueError:
        x = math.nan
    if not 0.0 <= x <= 1.0:  # nan fails too
        raise ValueError(f"ZeRO-Offload setting {name!r}: {value!r} is not allowed; allowed: "
                         "a number from 0 to 1 (the share of the optimizer state kept on the "
                         "host), or auto") from None
    return format(x, "g")


def check_values(values: dict, where) -> None:
    """Each of ``values`` valid for its setting, or one ValueError that starts with
    ``where(name)`` (the variable, the file or the option that gave it): a merged plugin
    could only say which setting is wrong, not who set it."""
    _check_keys(values, "argument")  # the env's and the yaml's names are checked as read
    for name, value in values.items():
        try:
            _coerce(_field(name), value)
        except ValueError as err:
            raise ValueError(f"{where(name)}: {err}") from None


def _env_str(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def env_values(environ=None) -> dict[str, str]:
    """The ``HF_ZOFFLOAD_<NAME>`` settings present in ``environ``; unknown names raise.

    ``HF_ZOFFLOAD_CONFIG``, ``HF_ZOFFLOAD_ENABLED``, ``HF_ZOFFLOAD_TRACEBACK``, the build
    and test-suite switches (`NOT_SETTINGS`) are not settings and are not read here."""
    environ = os.environ if environ is None else environ
    out = {}
    for key, value in environ.items():
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):] not in NOT_SETTINGS:
            name = key[len(ENV_PREFIX):].lower()
            if name not in ZeroOffloadPlugin.names():
                known = [ENV_PREFIX + n.upper() for n in ZeroOffloadPlugin.names()]
                known += [ENV_PREFIX + n for n in NOT_SETTINGS]
                raise ValueError(f"unknown environment variable {key}; allowed: "
                                 f"{', '.join(known)}{closest(key, known)}")
            out[name] = value
    return out


def read_yaml(path: str, *, named_by: str = "config_file") -> dict[str, Any]:
    """The ``zoffload:`` section of a sidecar yaml; unknown keys and bad values raise
    ``ValueError`` naming the file."""
    data = load_sidecar(path, named_by=named_by)
    extra = sorted(set(data) - set(TOP_LEVEL_KEYS), key=str)
    if extra:
        raise ValueError(
            f"{path}: unknown top-level key(s) {', '.join(map(repr, extra))}; "
            f"allowed: {', '.join(TOP_LEVEL_KEYS)}{closest(extra[0], TOP_LEVEL_KEYS)}"
        )
    section = data.get(YAML_SECTION)
    section = {} if section is None else section  # `zoffload:` with nothing under it
    if not isinstance(section, dict):
        raise ValueError(f"{path}: '{YAML_SECTION}' must be a mapping")
    _check_keys(section, f"key in {path}")
    # Values too, whoever reads the file: also when offload is off or only the switch is read.
    check_values(section, lambda name: f"{path}: {name}")
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
        values.update(read_yaml(path, named_by="config_file" if config_file else CONFIG_ENV))
        where.append(path)
    from_env = env_values(environ)
    check_values(from_env, lambda name: f"{ENV_PREFIX}{name.upper()}={from_env[name]!r}")
    values.update(from_env)
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
    read_yaml(path, named_by=CONFIG_ENV)  # unknown keys, a missing file, bad YAML: one line
    return load_sidecar(path, named_by=CONFIG_ENV).get("zero_offload", default)
