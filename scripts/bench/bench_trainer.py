#!/usr/bin/env python
"""The Trainer with --zero_offload against the stock Trainer, on the quickstart's model.

Runs `scripts/run_clm.py` on its built-in default (the small GPT-2 on the stdlib sources,
fp32 on the CPU) in pairs, same seed and arguments, --pairs times, all in this one process
(time here is noisy; pairs in one process compare under the same load). The pairs are the
rounds of scripts/bench/_interleave.py: which run goes first alternates (stock first in even pairs),
so a machine slowing or speeding up within a pair counts against each side alike. Reports
each pair's train_runtime (the Trainer's own metric: training steps only, no tokenizer or
model build) and the median over pairs of the ratio offload / stock.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))  # scripts/bench: _interleave
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # scripts/: run_clm
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the checkout

import _interleave as il  # noqa: E402
import run_clm  # noqa: E402

from hf_zoffload.commands.env import cpu_name  # noqa: E402


def one(steps: int, offload: bool, out: str) -> float:
    argv = ["--do_train", "--output_dir", out, "--max_steps", str(steps),
            "--per_device_train_batch_size", "8", "--learning_rate", "2e-3",
            "--weight_decay", "0.01", "--lr_scheduler_type", "cosine", "--warmup_steps", "8",
            "--logging_steps", str(steps), "--save_strategy", "no", "--report_to", "none",
            "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--use_cpu", "true",
            "--corpus_mb", "0.3", "--seed", "0"] + (["--zero_offload"] if offload else [])
    with contextlib.redirect_stdout(io.StringIO()):
        return run_clm.main(argv)["train_runtime"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--pairs", type=int, default=4)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(10**9))  # one output folder per run

        def run(offload):
            return lambda: one(args.steps, offload, os.path.join(tmp, f"r{next(runs)}"))

        for offload in (False, True):  # imports, kernel load, first allocations: 4 steps each
            one(4, offload, os.path.join(tmp, f"warm{int(offload)}"))
        timed = il.interleave([("stock", il.SelfTimed(run(False))),
                               ("offload", il.SelfTimed(run(True)))], args.pairs, warmup=False)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; torch {torch.__version__}; "
          "stock first in even pairs, --zero_offload first in odd ones\n")
    print(f"| pair | stock Trainer (s, {args.steps} steps) | --zero_offload (s) | ratio |")
    print("|---|---|---|---|")
    for i, (s, o) in enumerate(zip(timed.seconds["stock"], timed.seconds["offload"])):
        print(f"| {i} | {s:.2f} | {o:.2f} | {o / s:.3f} |")
    print(f"\nmedian ratio --zero_offload / stock: {timed.ratio('offload', 'stock'):.3f}")


if __name__ == "__main__":
    main()
