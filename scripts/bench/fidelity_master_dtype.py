#!/usr/bin/env python
"""The bf16 master (stochastic rounding) against the fp32 one, in one process and bf16 compute:
a small Llama from a config (2 layers, width 128, the quickstart's corpus and tokenizer, 8 x 64
tokens a step), trained ``--steps`` from scratch at lr 2e-3 (cosine, 30 warm-up steps), then
fine-tuned ``--finetune_steps`` more at ``--finetune_lr`` from the fp32-master run's weights,
once per (master_dtype, state_dtype) mode, same seed and data. Prints the final loss of each
mode (mean of the last 20 steps) relative to fp32 master + fp32 state.

The quickstart itself (fidelity_state_dtype.py) computes in fp32 on a CPU, where bf16 matmuls
run ~25x slower, and a bf16 master needs bf16 compute: hence this smaller model.
Usage: python scripts/bench/fidelity_master_dtype.py [--steps 300] [--finetune_steps 200]
"""

from __future__ import annotations

import argparse
import copy
import math
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

MODES = [("fp32", "fp32"), ("fp32", "int8"), ("fp32", "int4"), ("bf16", "fp32"),
         ("bf16", "int8"), ("bf16", "int4")]


def train(model, ids, *, master, state, steps, lr, start, schedule):
    opt = ZeroOffloadOptimizer(model.parameters(), lr=lr, weight_decay=0.01, model=model,
                               plugin=ZeroOffloadPlugin(compute_dtype="bf16",
                                                        master_dtype=master, state_dtype=state,
                                                        pin_memory=False))
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
        losses.append(loss.item())
    return sum(losses[-20:]) / min(20, len(losses))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--finetune_steps", type=int, default=200)
    ap.add_argument("--finetune_lr", type=float, default=2e-4)
    args = ap.parse_args(argv)
    if args.steps < 30 or args.finetune_steps < 1 or not args.finetune_lr > 0:
        ap.error("--steps >= 30 (the warm-up), --finetune_steps >= 1, --finetune_lr > 0")
    texts = stdlib_corpus(max_mb=1.0)
    tok = train_tokenizer(texts)
    ids = torch.tensor(tok("\n".join(texts))["input_ids"])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=352,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64, tie_word_embeddings=False)
    final, tuned, base = {}, {}, None
    for master, state in MODES:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        final[master, state] = train(model, ids, master=master, state=state, steps=args.steps,
                                     lr=2e-3, start=0, schedule=True)
        if (master, state) == ("fp32", "fp32"):
            base = copy.deepcopy(model.state_dict())
        print(f"scratch {master} master, {state} state: {final[master, state]:.4f}", flush=True)
    for master, state in MODES:
        model = LlamaForCausalLM(cfg)
        model.load_state_dict(base)
        tuned[master, state] = train(model, ids, master=master, state=state,
                                     steps=args.finetune_steps, lr=args.finetune_lr,
                                     start=args.steps, schedule=False)
        print(f"fine-tune {master} master, {state} state: {tuned[master, state]:.4f}",
              flush=True)
    print(f"\n| master_dtype | state_dtype | loss after {args.steps} steps | vs fp32 | "
          f"loss after {args.finetune_steps} fine-tune steps | vs fp32 |")
    print("|---|---|---:|---:|---:|---:|")
    for mode in MODES:
        a, b = final[mode], tuned[mode]
        ra = (a - final["fp32", "fp32"]) / final["fp32", "fp32"]
        rb = (b - tuned["fp32", "fp32"]) / tuned["fp32", "fp32"]
        print(f"| {mode[0]} | {mode[1]} | {a:.4f} | {ra:+.2%} | {b:.4f} | {rb:+.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
