"""`hf-zoffload launch [accelerate launch args] script.py [script args]`.

Runs `accelerate launch` unchanged, with the ZeRO-Offload settings carried as environment
variables (accelerate passes the caller's environment through to every process):
``HF_ZOFFLOAD_<NAME>`` for each setting the sidecar or the caller's environment sets (a
setting set nowhere keeps its default, and the compute dtype follows accelerate's
mixed_precision or the Trainer's --fp16/--bf16), ``HF_ZOFFLOAD_ENABLED`` and
``HF_ZOFFLOAD_CONFIG``.

The settings are merged here with the plugin's own precedence (sidecar yaml < variables
already set in the caller's environment) and validated before any process starts, so a typo
fails once, here, rather than once per process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from hf_zoffload.config import CONFIG_ENV, ENABLED_ENV, ZeroOffloadPlugin, sourced_values
from hf_zoffload.sidecar import check_path

description = (
    "Run `accelerate launch` with the ZeRO-Offload settings of the sidecar yaml (beside "
    "accelerate's --config_file, or --zoffload_config PATH) exported as HF_ZOFFLOAD_* variables."
)


def add_parser(subparsers):
    # Registered for `hf-zoffload --help`; main() hands launch's argv to run_argv untouched,
    # because accelerate's own parser must see it.
    return subparsers.add_parser("launch", help=description, add_help=False)


def _accelerate_parser():
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.prog, parser.description = "hf-zoffload launch", description
    # accelerate's own help formatter hides every option not already on sys.argv[1:] when
    # that holds two tokens or more, which `hf-zoffload launch --help` always does (it hid
    # --config_file, --cpu and --multi_gpu): show them all.
    parser.formatter_class = argparse.HelpFormatter
    # No abbreviations (as every hf-zoffload parser): `--zoffload x` would parse here as
    # --zoffload_config, yet _strip_own only removes the full name, so accelerate would get it.
    parser.allow_abbrev = False
    ours = parser.add_argument_group("hf-zoffload")
    ours.add_argument("--zoffload_config", default=None, help=SIDECAR_HELP)
    return parser


SIDECAR_HELP = ("the ZeRO-Offload sidecar yaml (default: the file named by HF_ZOFFLOAD_CONFIG, "
                "else <stem>_zoffload.yaml beside accelerate's --config_file, which defaults to "
                "accelerate's default config file).")


def _strip_own(argv: list[str], n_script_tokens: int) -> list[str]:
    """``argv`` without ``--zoffload_config X`` before the script (the script's own args,
    the last ``n_script_tokens`` tokens, are never touched)."""
    head, tail = argv[: len(argv) - n_script_tokens], argv[len(argv) - n_script_tokens:]
    out, skip = [], False
    for tok in head:
        if skip:
            skip = False
        elif tok == "--zoffload_config":
            skip = True
        elif not tok.startswith("--zoffload_config="):
            out.append(tok)
    return out + tail


def find_sidecar(*, zoffload_config: str | None, config_file: str | None, environ) -> str | None:
    """The sidecar `launch` and `env` use: ``--zoffload_config``, else HF_ZOFFLOAD_CONFIG, else
    the one beside accelerate's config (``--config_file``, else accelerate's default file)
    when it exists. A named file that is missing, a directory or unreadable is a ValueError
    naming who named it."""
    from hf_zoffload.commands.config import default_accelerate_config, sidecar_path

    for named_by, path in (("--zoffload_config", zoffload_config),
                           (CONFIG_ENV, environ.get(CONFIG_ENV))):
        if path:
            check_path(path, named_by=named_by)  # missing, a directory, unreadable: one line
            return os.path.abspath(path)
    path = sidecar_path(config_file or default_accelerate_config())
    return path if os.path.isfile(path) else None


def launch_env(sidecar: str | None, environ=None, *, device_type: str | None = None
               ) -> dict[str, str]:
    """The environment for `accelerate launch`: the caller's, the sidecar's path, the on/off
    switch, and the settings the sidecar or the caller's environment set (validated here).
    ``device_type``: the device the processes will use, to refuse settings it cannot run."""
    from hf_zoffload.integrations.accelerate import zero_offload_enabled

    env = dict(os.environ if environ is None else environ)
    if sidecar:
        env[CONFIG_ENV] = sidecar
    plugin = ZeroOffloadPlugin.from_sources(environ=env)  # raises on a bad key or value
    if device_type is not None:
        plugin.check_device(device_type)
    env[ENABLED_ENV] = "true" if zero_offload_enabled(environ=env) else "false"
    # Only what was set: exporting every default would pin the compute dtype to bf16 under
    # launch while the same script follows --fp16/--bf16 or accelerate's mixed_precision
    # under `python`.
    env.update(plugin.to_env(sourced_values(environ=env)[0]))
    return env


def _device_type(args) -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"


def run_argv(argv: list[str]) -> int:
    args = _accelerate_parser().parse_args(argv)
    n_script = 1 + len(args.training_script_args)
    # accelerate would start and fail with 15 lines of traceback: one line here instead
    if args.config_file and not os.path.isfile(args.config_file):
        raise FileNotFoundError(f"--config_file {args.config_file}: no such file (accelerate's "
                                "config; `hf-zoffload config --config_file "
                                f"{args.config_file}` writes one)")
    # a bad sidecar or setting: one line before anything starts (commands/errors.py)
    sidecar = find_sidecar(zoffload_config=args.zoffload_config,
                           config_file=args.config_file, environ=os.environ)
    env = launch_env(sidecar, device_type=_device_type(args))
    if not (args.module or args.no_python) and not os.path.isfile(args.training_script):
        raise FileNotFoundError(f"the training script {args.training_script}: no such file "
                                "(-m runs a module, --no_python a command)")
    where = sidecar or "defaults and HF_ZOFFLOAD_* variables (no sidecar yaml found)"
    state = "enabled" if env[ENABLED_ENV] == "true" else "disabled"
    print(f"hf-zoffload launch: ZeRO-Offload {state}; settings from {where}", file=sys.stderr)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *_strip_own(argv, n_script)]
    return subprocess.run(cmd, env=env).returncode
