#!/usr/bin/env python
"""The bf16 master (stochastic rounding) against the fp32 one, in one process and bf16 compute:
a small Llama from a config (2 layers, width 128, the quickstart's corpus and tokenizer, 8 x 64
tokens a step), trained ``--steps`` from scratch at lr 2e-3 (cosine, 30 warm-up steps), then
fine-tuned ``--finetune_steps`` more at ``--finetune_lr`` from the fp32-master run's weights,
once per (master_dtype, state_dtype) mode, same seed and data. Prints the final loss of each
mode (mean of the last 20 steps) relative to fp32 master + fp32 state.

``--nearest fp32,...`` adds, for each state_dtype listed, a bf16 master rounded to nearest
instead of stochastically (what stochastic rounding buys): the engine with an fp32 master
whose every element is rounded to the nearest bf16 after each step (through
``host_views``), so the master holds bf16 values and each update is computed from them in
fp32, as with ``master_dtype: bf16``, and only the rounding differs.

With ``--jobs N`` the runs of a phase go N at a time, each in its own process on its share of
the cores (torch's threads and the engine's ``cpu_threads``).

The quickstart itself (fidelity_state_dtype.py) computes in fp32 on a CPU, where bf16 matmuls
run ~25x slower, and a bf16 master needs bf16 compute: hence this smaller model.
Usage: python scripts/bench/fidelity_master_dtype.py [--steps 300] [--finetune_steps 200]
[--jobs 2] [--nearest fp32]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

MASTERS = ("fp32", "bf16", "bf16-nearest")
STATES = ("fp32", "bf16", "int8", "int4")
MODES = [("fp32", "fp32"), ("fp32", "int8"), ("fp32", "int4"), ("bf16", "fp32"),
         ("bf16", "int8"), ("bf16", "int4")]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def train(model, ids, *, master, state, steps, lr, start, schedule, threads):
    import torch

    from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin

    nearest = master == "bf16-nearest"
    opt = ZeroOffloadOptimizer(model.parameters(), lr=lr, weight_decay=0.01, model=model,
                               plugin=ZeroOffloadPlugin(
                                   compute_dtype="bf16", master_dtype="fp32" if nearest
                                   else master, state_dtype=state, pin_memory=False,
                                   cpu_threads=threads))
    params = list(model.parameters())
    losses = []
    for t in range(steps):
        if schedule:
            warm = min(1.0, (t + 1) / 30)
            cos = 0.5 * (1 + math.cos(math.pi * max(0, t + 1 - 30) / max(1, steps - 30)))
            opt.param_groups[0]["lr"] = lr * warm * cos
        x = ids[(start + t) % (len(ids) // 512) * 512:][:512].view(8, 64)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if nearest:  # the fp32 master holds bf16 values: each update rounded to nearest
            with torch.no_grad():
                for p in params:
                    master32 = opt.host_views(p)["master"]
                    master32.copy_(master32.to(torch.bfloat16))
        losses.append(loss.item())
    return sum(losses[-20:]) / min(20, len(losses))


def one_run(spec: dict) -> dict:
    """One training run in this process: spec holds master, state, phase (scratch or
    finetune), steps, lr, start, threads, base (the weights a fine-tune starts from) and
    save (where a scratch run writes its weights, or None)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

    torch.set_num_threads(spec["threads"])
    texts = stdlib_corpus(max_mb=1.0)
    tok = train_tokenizer(texts)
    ids = torch.tensor(tok("\n".join(texts))["input_ids"])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=352,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if spec["base"]:
        model.load_state_dict(torch.load(spec["base"], weights_only=True))
    loss = train(model, ids, master=spec["master"], state=spec["state"], steps=spec["steps"],
                 lr=spec["lr"], start=spec["start"], schedule=spec["phase"] == "scratch",
                 threads=spec["threads"])
    if spec["save"]:
        torch.save(model.state_dict(), spec["save"])
    return {"loss": loss}


def launch(spec: dict, timeout: float) -> float:
    """``one_run(spec)`` in a child process of this script; its final loss."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--run", json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or len(lines) != 1:
        raise SystemExit(f"{spec['master']} master, {spec['state']} state ({spec['phase']}) "
                         f"failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])["loss"]


def parse_modes(text: str) -> list[tuple[str, str]]:
    modes = []
    for item in text.split(","):
        master, _, state = item.partition("/")
        if master not in MASTERS[:2] or state not in STATES:
            raise ValueError(f"a mode is master/state with master one of fp32, bf16 and state "
                             f"one of {', '.join(STATES)}; got {item!r}")
        modes.append((master, state))
    if modes[0] != ("fp32", "fp32") or len(set(modes)) != len(modes):
        raise ValueError(f"--modes: fp32/fp32 first (the reference), each mode once; got {text}")
    return modes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--finetune_steps", type=int, default=200)
    ap.add_argument("--finetune_lr", type=float, default=2e-4)
    ap.add_argument("--modes", default=",".join(f"{m}/{s}" for m, s in MODES),
                    help="comma list of master/state modes, fp32/fp32 first")
    ap.add_argument("--nearest", default="",
                    help="comma list of state_dtypes to run with a bf16 master rounded to "
                         "nearest too (what stochastic rounding buys)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at a time, each with cores / jobs threads (at least 1)")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per run")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # internal: one run, from launch()
    args = ap.parse_args(argv)
    if args.run:
        print("RESULT " + json.dumps(one_run(json.loads(args.run))), flush=True)
        return 0
    if args.steps < 30 or args.finetune_steps < 20 or not args.finetune_lr > 0:
        ap.error("--steps >= 30 (the warm-up), --finetune_steps >= 20 (the loss is the last "
                 "20's mean), --finetune_lr > 0")
    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        ap.error(str(exc))
    nearest = [s for s in args.nearest.split(",") if s]
    if not set(nearest) <= set(STATES) or len(set(nearest)) != len(nearest):
        ap.error(f"--nearest: a comma list of {', '.join(STATES)}, each once; got "
                 f"{args.nearest!r}")
    modes += [("bf16-nearest", s) for s in nearest]
    if not 1 <= args.jobs <= len(modes):
        ap.error(f"--jobs must be between 1 and {len(modes)} (one run per mode), "
                 f"got {args.jobs}")
    threads = max(1, cores() // args.jobs)
    final, tuned = {}, {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        base = os.path.join(tmp, "fp32_fp32.pt")

        def each(phase, steps, lr, start, out):
            runs = {mode: pool.submit(launch, dict(
                master=mode[0], state=mode[1], phase=phase, steps=steps, lr=lr, start=start,
                threads=threads, base=None if phase == "scratch" else base,
                save=base if phase == "scratch" and mode == ("fp32", "fp32") else None),
                args.timeout) for mode in modes}
            for mode, run in runs.items():
                out[mode] = run.result()
                print(f"{phase} {mode[0]} master, {mode[1]} state: {out[mode]:.4f}", flush=True)

        each("scratch", args.steps, 2e-3, 0, final)
        each("finetune", args.finetune_steps, args.finetune_lr, args.steps, tuned)
    print(f"\n| master_dtype | state_dtype | loss after {args.steps} steps | vs fp32 | "
          f"loss after {args.finetune_steps} fine-tune steps | vs fp32 |")
    print("|---|---|---:|---:|---:|---:|")
    for mode in modes:
        a, b = final[mode], tuned[mode]
        ra = (a - final["fp32", "fp32"]) / final["fp32", "fp32"]
        rb = (b - tuned["fp32", "fp32"]) / tuned["fp32", "fp32"]
        print(f"| {mode[0]} | {mode[1]} | {a:.4f} | {ra:+.2%} | {b:.4f} | {rb:+.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
