#!/usr/bin/env python
"""Train the quickstart model once per ``state_dtype`` (same seed, same data) and compare the
train loss curves: the fidelity of compact Adam moments.

Each run is `scripts/quickstart.sh` (its venv setup skipped) with ``--zero_offload_state_dtype``
and the loss logged every ``--every`` steps. Prints a markdown table of the losses and the
final loss of each mode relative to fp32; exits 1 when bf16 is off by more than
``--bf16_tolerance`` or int8 by more than ``--int8_tolerance`` (relative, final logged loss).
With ``--jobs N`` the runs go N at a time, each on its share of the cores (torch's threads and
the engine's host threads).
Usage: python scripts/bench/fidelity_state_dtype.py [--max_steps 300] [--every 50] [--jobs 3]
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("fp32", "bf16", "int8")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def losses(mode: str, args, out_dir: str) -> list[float]:
    env = dict(os.environ, QUICKSTART_SKIP_SETUP="1", PYTHON=sys.executable,
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    share = []
    if args.jobs > 1:  # runs side by side: each on its share, none oversubscribing the cores
        threads = max(1, cores() // args.jobs)
        env["OMP_NUM_THREADS"] = str(threads)
        share = ["--zero_offload_cpu_threads", str(threads)]
    cmd = ["bash", str(ROOT / "scripts" / "quickstart.sh"), "--zero_offload_state_dtype", mode,
           "--max_steps", str(args.max_steps), "--logging_steps", str(args.every),
           "--do_eval", "false", "--output_dir", out_dir, *share, *args.extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"state_dtype={mode}: run_clm failed\n{text[-3000:]}")
    found = []
    for line in text.splitlines():  # the Trainer prints each log as a dict
        line = line.strip()
        if line.startswith("{") and "'loss'" in line:
            found.append(float(ast.literal_eval(line)["loss"]))
    if len(found) != args.max_steps // args.every:
        raise SystemExit(f"state_dtype={mode}: expected {args.max_steps // args.every} logged "
                         f"losses, found {len(found)}\n{text[-3000:]}")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max_steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="logging interval in steps")
    ap.add_argument("--bf16_tolerance", type=float, default=0.01)
    ap.add_argument("--int8_tolerance", type=float, default=0.02)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at a time, each with cores / jobs threads (at least 1)")
    ap.add_argument("extra", nargs="*", help="more run_clm.py arguments (after --)")
    args = ap.parse_args(argv)
    if args.every < 1 or args.max_steps < args.every:
        ap.error("--every must be >= 1 and <= --max_steps")
    if not 1 <= args.jobs <= len(MODES):
        ap.error(f"--jobs must be between 1 and {len(MODES)} (one run per mode), "
                 f"got {args.jobs}")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        runs = {mode: pool.submit(losses, mode, args, str(Path(tmp) / mode)) for mode in MODES}
        curves = {mode: run.result() for mode, run in runs.items()}
    print("| step | " + " | ".join(f"loss, {m} state" for m in MODES) + " |")
    print("|---:|" + "---:|" * len(MODES))
    for i in range(len(curves["fp32"])):
        print(f"| {(i + 1) * args.every} | "
              + " | ".join(f"{curves[m][i]:.4f}" for m in MODES) + " |")
    ref = curves["fp32"][-1]
    ok = True
    for mode, tol in (("bf16", args.bf16_tolerance), ("int8", args.int8_tolerance)):
        rel = abs(curves[mode][-1] - ref) / ref
        ok &= rel <= tol
        print(f"final loss {mode} vs fp32: {rel:+.2%} (tolerance {tol:.0%}) "
              f"{'ok' if rel <= tol else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
