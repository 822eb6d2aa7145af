#!/usr/bin/env python
"""The Trainer with --zero_offload against the stock Trainer, on the quickstart's model.

Runs `scripts/run_clm.py` on its built-in default (the small GPT-2 on the stdlib sources,
fp32 on the CPU) in pairs: stock, then --zero_offload, same seed and arguments, --pairs
times, all in this one process (time here is noisy; pairs in one process compare under the
same load). Reports each pair's train_runtime (the Trainer's own metric: training steps
only, no tokenizer or model build) and the median ratio offload / stock.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--pairs", type=int, default=4)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        one(4, True, os.path.join(tmp, "warm"))  # imports, kernel load, first allocations
        for i in range(args.pairs):
            stock = one(args.steps, False, os.path.join(tmp, f"s{i}"))
            ours = one(args.steps, True, os.path.join(tmp, f"o{i}"))
            rows.append((stock, ours))
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; torch {torch.__version__}\n")
    print(f"| pair | stock Trainer (s, {args.steps} steps) | --zero_offload (s) | ratio |")
    print("|---|---|---|---|")
    for i, (s, o) in enumerate(rows):
        print(f"| {i} | {s:.2f} | {o:.2f} | {o / s:.3f} |")
    med = statistics.median(o / s for s, o in rows)
    print(f"\nmedian ratio --zero_offload / stock: {med:.3f}")


if __name__ == "__main__":
    main()
