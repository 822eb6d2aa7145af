"""`hf-zoffload launch [accelerate launch args] script.py [script args]`.

Runs `accelerate launch` unchanged, with the ZeRO-Offload settings carried as environment
variables (accelerate passes the caller's environment through to every process):
``HF_ZOFFLOAD_<NAME>`` for every setting, ``HF_ZOFFLOAD_ENABLED`` and ``HF_ZOFFLOAD_CONFIG``.

The settings are merged here with the plugin's own precedence (sidecar yaml < variables
already set in the caller's environment) and validated before any process starts, so a typo
fails once, here, rather than once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys

from hf_zoffload.config import CONFIG_ENV, ENABLED_ENV, ZeroOffloadPlugin

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
    parser.description = description
    parser.add_argument("--zoffload_config", default=None,
                        help="hf-zoffload: the sidecar yaml to use (default: the file named by "
                             "HF_ZOFFLOAD_CONFIG, else <config_file stem>_zoffload.yaml beside "
                             "accelerate's config).")
    return parser


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
    from hf_zoffload.commands.config import default_accelerate_config, sidecar_path

    if zoffload_config:
        if not os.path.isfile(zoffload_config):
            raise FileNotFoundError(f"--zoffload_config {zoffload_config}: no such file")
        return os.path.abspath(zoffload_config)
    if environ.get(CONFIG_ENV):
        return os.path.abspath(environ[CONFIG_ENV])
    path = sidecar_path(config_file or default_accelerate_config())
    return path if os.path.isfile(path) else None


def launch_env(sidecar: str | None, environ=None) -> dict[str, str]:
    """The environment for `accelerate launch`: the caller's plus every offload setting."""
    from hf_zoffload.integrations.accelerate import zero_offload_enabled

    env = dict(os.environ if environ is None else environ)
    if sidecar:
        env[CONFIG_ENV] = sidecar
    plugin = ZeroOffloadPlugin.from_sources(environ=env)  # raises on a bad key or value
    env[ENABLED_ENV] = "true" if zero_offload_enabled(environ=env) else "false"
    env.update(plugin.to_env())
    return env


def run_argv(argv: list[str]) -> int:
    args = _accelerate_parser().parse_args(argv)
    n_script = 1 + len(args.training_script_args)
    sidecar = find_sidecar(zoffload_config=args.zoffload_config, config_file=args.config_file,
                           environ=os.environ)
    try:
        env = launch_env(sidecar)
    except (ValueError, OSError) as err:
        print(f"hf-zoffload launch: {err}", file=sys.stderr)
        return 2
    where = sidecar or "defaults and HF_ZOFFLOAD_* variables (no sidecar yaml found)"
    state = "enabled" if env[ENABLED_ENV] == "true" else "disabled"
    print(f"hf-zoffload launch: ZeRO-Offload {state}; settings from {where}", file=sys.stderr)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *_strip_own(argv, n_script)]
    return subprocess.run(cmd, env=env).returncode
