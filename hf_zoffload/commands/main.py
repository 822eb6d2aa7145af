"""The `hf-zoffload` console script: config, launch, env, estimate.

Each command imports what it needs when it runs, so `hf-zoffload --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from hf_zoffload import __version__
from hf_zoffload.commands import config, env, estimate, launch
from hf_zoffload.commands.errors import TRACEBACK_ENV, run_command


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: no abbreviations (with them `estimate --config x` was silently
    read as --config_overrides), and an unknown option is refused by name before anything
    else is parsed: otherwise its value could land in a positional (`estimate --config
    n_layer=2` read n_layer=2 as the model) and the error would name the wrong thing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def parse_known_args(self, args=None, namespace=None):
        for tok in (sys.argv[1:] if args is None else args):
            if tok == "--":  # what follows is not options
                break
            if tok.startswith("--") and tok.split("=", 1)[0] not in self._option_string_actions:
                self.error(f"unrecognized arguments: {tok}")
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "hf-zoffload", description="ZeRO-Offload for the Hugging Face stack.",
        epilog=f"A bad setting or path is one line and exit status 2; {TRACEBACK_ENV}=1 shows "
               "its traceback.",
        allow_abbrev=False)  # as SubcommandParser: `--vers` is not --version
    parser.add_argument("--version", action="version", version=f"hf-zoffload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser,
                                metavar="{config,launch,env,estimate}")
    for module in (config, launch, env, estimate):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "launch":
        # Everything after `launch` is accelerate launch's command line: its parser reads it.
        return run_command("hf-zoffload launch", lambda: launch.run_argv(argv[1:]))
    args = build_parser().parse_args(argv)
    return run_command(f"hf-zoffload {args.command}", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
