"""The `hf-zoffload` console script: config, launch, env, estimate.

Each command imports what it needs when it runs, so `hf-zoffload --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from hf_zoffload import __version__
from hf_zoffload.commands import config, env, estimate, launch


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations, here and in every subcommand's parser: with them `estimate --config x`
    # was silently read as --config_overrides; an unknown option must be an error naming it.
    parser = argparse.ArgumentParser(
        "hf-zoffload", description="ZeRO-Offload for the Hugging Face stack.",
        allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"hf-zoffload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{config,launch,env,estimate}")
    for module in (config, launch, env, estimate):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "launch":
        # Everything after `launch` is accelerate launch's command line: its parser reads it.
        return launch.run_argv(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
