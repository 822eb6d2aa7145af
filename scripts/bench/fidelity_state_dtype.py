#!/usr/bin/env python
"""Train the quickstart model once per ``state_dtype`` (same seed, same data) and compare the
train loss curves: the fidelity of compact Adam moments.

Two scenarios (``--scenario``, default both):
- quickstart: `scripts/quickstart.sh` (its venv setup skipped) from scratch for
  ``--max_steps``, once per mode with ``--zero_offload_state_dtype``;
- finetune: the quickstart model trained ``--max_steps`` with fp32 state and saved, then
  ``--finetune_steps`` more from those weights at ``--finetune_lr`` (constant, fresh
  optimizer, another data order: ``--seed 1``) once per mode, where small updates matter most.

The loss is logged every ``--every`` steps. Prints a markdown table of the losses per scenario
and the final logged loss of each mode relative to fp32; exits 1 when a mode is off by more
than its tolerance (bf16 ``--bf16_tolerance``, int8 and int4 ``--int8_tolerance`` /
``--int4_tolerance``).
With ``--jobs N`` the runs of a scenario go N at a time, each on its share of the cores (torch's
threads and the engine's host threads).
Each run is run_clm.py with the arguments quickstart.sh gives it on this machine (read once: the
script runs with PYTHON set to a stub that writes them down), forked from this process, which
imported run_clm once (a run started afresh spends ~10 CPU-s importing and checking the
device: a fifth of a 300-step run on one core).
Usage: python scripts/bench/fidelity_state_dtype.py [--max_steps 300] [--every 50] [--jobs 4]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("fp32", "bf16", "int8", "int4")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def quickstart_argv(tmp: str) -> list[str]:
    """run_clm.py's arguments as scripts/quickstart.sh gives them here: quickstart.sh runs with
    PYTHON set to a stub that runs the real interpreter for its device check (``-c``) and
    writes the rest down instead of starting run_clm."""
    stub, found = Path(tmp) / "python_stub", Path(tmp) / "quickstart_argv"
    stub.write_text('#!/bin/sh\n'
                    f'if [ "$1" = "-c" ]; then exec {shlex.quote(sys.executable)} "$@"; fi\n'
                    f'printf "%s\\0" "$@" > {shlex.quote(str(found))}\n')
    stub.chmod(0o755)
    subprocess.run(["bash", str(ROOT / "scripts" / "quickstart.sh")], check=True,
                   env=dict(os.environ, QUICKSTART_SKIP_SETUP="1", PYTHON=str(stub)))
    script, *argv = found.read_text().split("\0")[:-1]
    if script != "scripts/run_clm.py":
        raise SystemExit(f"quickstart.sh ran {script}, not scripts/run_clm.py")
    return argv


def fork_run(cli, argv: list[str], log: Path) -> int:
    """A child of this process that runs ``cli(argv)`` in the repository root (where
    quickstart.sh runs it), its stdout and stderr in ``log``; its pid. No thread runs here
    when it forks (a fork copies only the calling thread)."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(ROOT)
        sys.argv = ["scripts/run_clm.py", *argv]
        code = cli(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def run_modes(cli, base_argv, runs, args) -> dict[str, list[float]]:
    """``runs``: {mode: (output dir, steps, extra run_clm arguments)}, ``args.jobs`` at a time;
    {mode: its logged losses}. A run that fails or outlives ``args.timeout`` ends the script."""
    share = []
    if args.jobs > 1:  # side by side: each on its share, none oversubscribing the cores
        share = ["--zero_offload_cpu_threads", str(max(1, cores() // args.jobs))]
    todo, live, found = list(runs), {}, {}
    while todo or live:
        while todo and len(live) < args.jobs:
            mode = todo.pop(0)
            out_dir, steps, extra = runs[mode]
            argv = [*base_argv, "--zero_offload_state_dtype", mode, "--max_steps", str(steps),
                    "--logging_steps", str(args.every), "--do_eval", "false", "--output_dir",
                    out_dir, *share, *extra, *args.extra]
            log = Path(f"{out_dir}.log")
            live[fork_run(cli, argv, log)] = (mode, log, steps, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            late = [p for p, (_, _, _, t) in live.items()
                    if time.monotonic() - t > args.timeout]
            for p in late:
                os.kill(p, signal.SIGKILL)
            time.sleep(0.2)
            continue
        mode, log, steps, _ = live.pop(pid)
        text = log.read_text()
        if os.waitstatus_to_exitcode(status) != 0:
            for p in live:
                os.kill(p, signal.SIGKILL)
            raise SystemExit(f"state_dtype={mode}: run_clm failed "
                             f"({os.waitstatus_to_exitcode(status)})\n{text[-3000:]}")
        found[mode] = logged_losses(mode, text, steps, args.every)
    return {m: found[m] for m in runs}


def logged_losses(mode: str, text: str, steps: int, every: int) -> list[float]:
    found = []
    for line in text.splitlines():  # the Trainer prints each log as a dict
        line = line.strip()
        if line.startswith("{") and "'loss'" in line:
            found.append(float(ast.literal_eval(line)["loss"]))
    if len(found) != steps // every:
        raise SystemExit(f"state_dtype={mode}: expected {steps // every} logged "
                         f"losses, found {len(found)}\n{text[-3000:]}")
    return found


def report(title: str, curves: dict, every: int, tolerance: dict) -> bool:
    modes = list(curves)
    print(f"\n{title}\n")
    print("| step | " + " | ".join(f"loss, {m} state" for m in modes) + " |")
    print("|---:|" + "---:|" * len(modes))
    for i in range(len(curves["fp32"])):
        print(f"| {(i + 1) * every} | " + " | ".join(f"{curves[m][i]:.4f}" for m in modes)
              + " |")
    ref, ok = curves["fp32"][-1], True
    for mode in modes[1:]:
        rel, tol = (curves[mode][-1] - ref) / ref, tolerance[mode]
        ok &= abs(rel) <= tol
        print(f"final loss {mode} vs fp32: {rel:+.2%} (tolerance {tol:.0%}) "
              f"{'ok' if abs(rel) <= tol else 'FAILED'}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max_steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="logging interval in steps")
    ap.add_argument("--scenario", choices=("quickstart", "finetune", "both"), default="both")
    ap.add_argument("--finetune_steps", type=int, default=200)
    ap.add_argument("--finetune_lr", type=float, default=2e-4)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma list of state_dtype modes, fp32 first ({', '.join(MODES)})")
    ap.add_argument("--bf16_tolerance", type=float, default=0.01)
    ap.add_argument("--int8_tolerance", type=float, default=0.02)
    ap.add_argument("--int4_tolerance", type=float, default=0.02)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at a time, each with cores / jobs threads (at least 1)")
    ap.add_argument("--out_dir", help="keep every run's output here (default: a temporary "
                    "folder); the fp32 run's model is OUT_DIR/fp32")
    ap.add_argument("--base", help="fine-tune from this saved model (an earlier run's "
                    "OUT_DIR/fp32) instead of training one")
    ap.add_argument("extra", nargs="*", help="more run_clm.py arguments (after --)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if modes[0] != "fp32" or not set(modes) <= set(MODES) or len(set(modes)) != len(modes):
        ap.error(f"--modes: fp32 first, then any of {', '.join(MODES[1:])}; got {args.modes}")
    for name in ("max_steps", "finetune_steps"):
        if args.every < 1 or getattr(args, name) < args.every:
            ap.error(f"--every must be >= 1 and <= --{name}")
    if not 1 <= args.jobs <= len(modes):
        ap.error(f"--jobs must be between 1 and {len(modes)} (one run per mode), "
                 f"got {args.jobs}")
    if not args.finetune_lr > 0:
        ap.error(f"--finetune_lr must be > 0, got {args.finetune_lr}")
    tolerance = {"bf16": args.bf16_tolerance, "int8": args.int8_tolerance,
                 "int4": args.int4_tolerance}
    if args.base and args.scenario != "finetune":
        ap.error("--base is the fine-tune's starting model: use it with --scenario finetune")
    if args.base and not (Path(args.base) / "config.json").is_file():
        ap.error(f"--base {args.base}: no saved model there (config.json)")
    ok = True
    keep = contextlib.nullcontext(args.out_dir) if args.out_dir else tempfile.TemporaryDirectory()
    with keep as tmp:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        base_argv = quickstart_argv(tmp)
        # read while importing, so set first: the runs inherit them
        os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if args.jobs > 1:
            os.environ["OMP_NUM_THREADS"] = str(max(1, cores() // args.jobs))
        sys.path.insert(0, str(ROOT / "scripts"))
        import run_clm

        def each(folder, steps, extra=()):  # one run per mode, args.jobs at a time
            return run_modes(run_clm.cli, base_argv, {
                m: (str(Path(tmp) / f"{folder}{m}"), steps, list(extra)) for m in modes}, args)

        base = args.base
        if args.scenario in ("quickstart", "both"):
            curves = each("", args.max_steps)
            base = str(Path(tmp) / "fp32")  # the fp32 run's saved model
            ok &= report(f"quickstart, {args.max_steps} steps from scratch", curves,
                         args.every, tolerance)
        if args.scenario in ("finetune", "both"):
            if base is None:
                base = str(Path(tmp) / "base")
                run_modes(run_clm.cli, base_argv, {"fp32": (base, args.max_steps, [])}, args)
            tune = ["--model_name_or_path", base, "--learning_rate", str(args.finetune_lr),
                    "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--seed", "1"]
            curves = each("ft_", args.finetune_steps, tune)
            ok &= report(f"fine-tune: {args.finetune_steps} steps at lr {args.finetune_lr:g} "
                         f"from the fp32 run's {args.max_steps}", curves, args.every, tolerance)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
