"""`hf-zoffload env`: the block to paste into bug reports.

Every probe is guarded on its own: a missing compiled kernel, a broken triton or a bad
HF_ZOFFLOAD_* variable shows up as one line saying so, and the rest still prints.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys

from hf_zoffload.commands.launch import SIDECAR_HELP, find_sidecar

description = "Print versions, CPU SIMD features, kernel build facts and the effective config."

# cpuinfo flag -> name shown; the four the CPU-Adam kernel's SIMD paths care about.
SIMD_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512F", "f16c": "F16C", "avx512_bf16": "AVX512-BF16"}


def add_parser(subparsers):
    p = subparsers.add_parser("env", help=description, description=description)
    p.add_argument("--config_file", default=None,
                   help="accelerate's config, found as `hf-zoffload launch` finds it (default: "
                        "accelerate's default config file).")
    p.add_argument("--zoffload_config", default=None, help=SIDECAR_HELP)
    p.set_defaults(func=run)
    return p


def _guard(fn):
    try:
        return fn()
    except Exception as err:  # the report must print whatever breaks
        return f"unavailable ({type(err).__name__}: {err})"


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "not installed"


def _torch() -> str:
    import torch

    cuda = "no CUDA"
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {', '.join(names)}"
    return f"{torch.__version__} ({cuda}; {torch.get_num_threads()} threads)"


def _cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (benchmarks head their tables with it)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def simd_features() -> dict[str, bool]:
    """{cpuinfo flag: present}; from the kernel module when importable (it asks the CPU
    itself), else from /proc/cpuinfo."""
    try:
        from hf_zoffload.ops.adam_kernels import cpu_features

        found = cpu_features()
        return {flag: bool(found.get(flag, False)) for flag in SIMD_FLAGS}
    except Exception:  # fall back rather than hide the line
        flags = _cpuinfo_flags()
        return {flag: flag in flags for flag in SIMD_FLAGS}


def _simd() -> str:
    found = simd_features()
    return ", ".join(f"{SIMD_FLAGS[f]} {'yes' if v else 'no'}" for f, v in found.items())


def _kernel() -> str:
    try:
        kernels = importlib.import_module("hf_zoffload.ops.adam_kernels")
    except Exception as err:  # a broken install must not hide the rest of the report
        return (f"MISSING: hf_zoffload.ops.adam_kernels does not import "
                f"({type(err).__name__}: {err})")
    try:
        omp = kernels.openmp_available()
    except Exception as err:  # e.g. the compiled extension is not built
        return f"MISSING: compiled CPU-Adam not available ({type(err).__name__}: {err})"
    text = f"present, OpenMP {'yes' if omp else 'NO (runs on one thread)'}"
    try:
        feats = kernels.compiled_features()
        used = [SIMD_FLAGS[f] for f in SIMD_FLAGS if feats.get(f)]
        text += (f"; variant in use: {', '.join(used) or 'scalar'}; portable build: "
                 f"{'yes' if feats.get('portable_build') else 'no'}")
    except Exception as err:  # e.g. a -march=native build on another CPU
        text += f"; variant: unavailable ({type(err).__name__}: {err})"
    return text


def _switch_source(environ) -> str | None:
    """What decides the on/off switch in ``environ`` (as `enabled_from_sources` reads it:
    HF_ZOFFLOAD_ENABLED, else the top-level ``zero_offload:`` of the file HF_ZOFFLOAD_CONFIG
    names), or None when nothing does and each path keeps its own default."""
    from hf_zoffload.config import CONFIG_ENV, ENABLED_ENV
    from hf_zoffload.sidecar import load_sidecar

    if environ.get(ENABLED_ENV) is not None:
        return f"{ENABLED_ENV}={environ[ENABLED_ENV]}"
    path = environ.get(CONFIG_ENV)
    if path and "zero_offload" in load_sidecar(path, named_by=CONFIG_ENV):
        return f"zero_offload: {load_sidecar(path, named_by=CONFIG_ENV)['zero_offload']} in {path}"
    return None


def _trainer(enabled: bool | None) -> str:
    # An unset --zero_offload follows the sources; a given one wins either way (arguments.py).
    if enabled is None:
        return "only with --zero_offload"
    return "on unless --zero_offload false" if enabled else "off unless --zero_offload"


def _switch_lines(launch_env: dict, environ: dict) -> list[str]:
    """Where offload is on, read from the code paths' own switch: `prepare_zero_offload`
    defaults to on, the Trainer's --zero_offload to off; `hf-zoffload launch` always exports
    HF_ZOFFLOAD_ENABLED (from the sidecar it finds, default true), so under it both follow
    that; under `python` / `accelerate launch` the sidecar beside accelerate's config is not
    read unless HF_ZOFFLOAD_CONFIG names it."""
    from hf_zoffload.config import enabled_from_sources

    on = enabled_from_sources(default=True, environ=launch_env)
    why = _switch_source(launch_env) or "the default"
    plain_why = _switch_source(environ) or "no HF_ZOFFLOAD_ENABLED, no HF_ZOFFLOAD_CONFIG"
    prepare = enabled_from_sources(default=True, environ=environ)
    return [
        f"    on/off under `hf-zoffload launch` (it exports HF_ZOFFLOAD_ENABLED="
        f"{'true' if on else 'false'}, from {why}): prepare_zero_offload {'on' if on else 'off'} "
        f"unless the script passes enabled=; the Trainer {_trainer(on)}",
        f"    on/off under `python` / `accelerate launch` here ({plain_why}): "
        f"prepare_zero_offload {'on' if prepare else 'off'} unless the script passes enabled=; "
        f"the Trainer {_trainer(enabled_from_sources(default=None, environ=environ))}",
    ]


def _shown_value(name: str, value) -> str:
    """A size as typed and in GiB: `16g` alone does not say GB or GiB (it is GiB)."""
    import dataclasses

    from hf_zoffload.config import ZeroOffloadPlugin, parse_size

    field = {f.name: f for f in dataclasses.fields(ZeroOffloadPlugin)}[name]
    if not field.metadata.get("size"):
        return str(value)
    n = parse_size(str(value), name, zero_ok=True)
    return f"{value} (= {n / 2**30:.2f} GiB)" if n else f"{value} (none set)"


def _offload_config(config_file: str | None, zoffload_config: str | None) -> str:
    from hf_zoffload.config import CONFIG_ENV, ZeroOffloadPlugin, sourced_values

    # The sidecar `hf-zoffload launch` would use with the same options, so the two agree.
    env = dict(os.environ)
    sidecar = find_sidecar(zoffload_config=zoffload_config, config_file=config_file,
                           environ=env)
    if sidecar:
        env[CONFIG_ENV] = sidecar
    source = sidecar or "no sidecar yaml (none named, none beside accelerate's config)"
    plugin = ZeroOffloadPlugin.from_sources(environ=env)
    chosen = set(sourced_values(environ=env)[0])
    lines = [source, *_switch_lines(env, dict(os.environ))]
    for k, v in plugin.to_dict().items():
        if k == "compute_dtype" and k not in chosen:
            v = (f"not set: the Trainer follows --fp16/--bf16, prepare_zero_offload accelerate's "
                 f"mixed_precision (fp32 for neither); a plain ZeroOffloadOptimizer uses {v}")
        else:
            v = _shown_value(k, v)
        lines.append(f"    {k}: {v}" + ("" if k in chosen or k == "compute_dtype"
                                         else " (default)"))
    return "\n".join(lines)


def report(*, config_file: str | None = None, zoffload_config: str | None = None) -> str:
    import hf_zoffload

    rows = [
        ("hf_zoffload version", lambda: hf_zoffload.__version__),
        ("Platform", platform.platform),
        ("Python version", lambda: sys.version.split()[0]),
        ("torch version", _torch),
        ("transformers version", lambda: _version("transformers")),
        ("accelerate version", lambda: _version("accelerate")),
        ("triton version", lambda: _version("triton")),
        ("CPU", lambda: f"{cpu_name()} ({os.cpu_count()} logical cores)"),
        ("CPU SIMD", _simd),
        ("CPU-Adam kernel", _kernel),
        ("ZeRO-Offload config", lambda: _offload_config(config_file, zoffload_config)),
    ]
    return "\n".join(f"- {name}: {_guard(fn)}" for name, fn in rows)


def run(args) -> int:
    print("Copy-and-paste the text below in your GitHub issue\n")
    print(report(config_file=args.config_file, zoffload_config=args.zoffload_config))
    return 0
