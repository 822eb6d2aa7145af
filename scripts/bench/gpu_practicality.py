#!/usr/bin/env python
"""Tokens/s of ZeRO-Offload against plain AMP AdamW on a model that fits both ways, on CUDA.

TinyLlama-1.1B's shape (scripts/bench/_gpu_llama.py, 1.10B params, built from its config with
random weights) trained on one fixed batch (default 8 x 1024 tokens), three ways in turn, each
on a fresh model in this process:
  - torch AdamW (fused) on fp32 params under bf16 autocast, everything on the device;
  - `ZeroOffloadOptimizer`, bf16 compute (fp32 master weights and moments on the host);
  - the same with ``delayed_update=True`` (no warm-up steps: every step's CPU-Adam overlaps
    the next forward and backward);
  - with ``--offload_fractions 0,0.5,auto``: the same (not delayed) at each
    ``offload_fraction`` (the share of the state kept on the host; the rest is updated on
    the device); ``auto`` decides at the end of the first warm-up step.
Each runs --warmup steps, then --steps timed ones between ``torch.cuda.synchronize()`` calls
(a delayed update's last step is landed inside the timed span); tokens/s = batch x seq x steps
/ seconds; peak device memory is ``torch.cuda.max_memory_allocated()`` over the whole run of
the way, model build included. Prints each way's row as it ends, then the ratios beside the
reference quoted in issue 22 (DeepSpeed's study: ZeRO-Offload at 17.6% of no-offload speed,
Qwen2.5-1.5B on 2x A100: another model, batch and machine).

``--json PATH`` writes the figures for gpu_peers.py (the same model and batch).
Needs CUDA (``--device cpu`` runs the same code on a tiny config, for the test suite).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback

import _gpu_llama as llama
import _gpu_script as common
import torch

SCRIPT = "gpu_practicality.py"
REFERENCE = ("reference (issue 22, DeepSpeed's study): ZeRO-Offload at 17.6% of no-offload "
             "speed, Qwen2.5-1.5B on 2x A100 (another model, batch and machine)")
DELAYED = ", delayed_update=True"
FRACTION = ", offload_fraction="
HEADER = ["way", "tokens/s", "ms/step", "peak device GiB", "vs AMP AdamW", "final loss"]


def measure(name: str, make, *, base: dict, dtype: torch.dtype, args) -> dict:
    """One way on a fresh model: ``make(model) -> (step, finish)``; its figures."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    gc.collect()
    if cuda:  # the previous way's blocks go back, so this peak is this way's own
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = llama.build_model(base, dtype, device)
    step, finish = make(model)[:2]
    ids = llama.token_ids(base, args.batch, args.seq, device)
    for _ in range(args.warmup):
        step(ids)
    finish()
    sync()
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        losses.append(step(ids))  # device tensors: no sync inside the timed steps
    finish()
    sync()
    seconds = time.perf_counter() - t0
    out = {"way": name, "tokens_per_s": args.batch * args.seq * args.steps / seconds,
           "ms_per_step": 1e3 * seconds / args.steps, "final_loss": float(losses[-1]),
           "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    del model, step, finish, losses
    gc.collect()
    return out


def row(r: dict, amp: dict | None) -> list:
    """A table row; ``amp``: the AMP AdamW figures the ratio is against (None: n/a)."""
    vs = f"{r['tokens_per_s'] / amp['tokens_per_s']:.2f}" if amp else "n/a"
    peak = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") is not None else "n/a"
    return [r["way"], f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step']:.0f}", peak, vs,
            f"{r['final_loss']:.3f}"]


def ratio_line(results: list[dict]) -> str:
    named = {r["way"]: r for r in results}
    amp, ours = named.get(llama.AMP), named.get(llama.ZOFFLOAD)
    delayed = named.get(llama.ZOFFLOAD + DELAYED)
    if not (amp and ours and delayed):
        return "ratios: n/a (a way did not finish)"
    return (f"ZeRO-Offload runs at {ours['tokens_per_s'] / amp['tokens_per_s']:.1%} of AMP "
            f"AdamW's tokens/s, {delayed['tokens_per_s'] / amp['tokens_per_s']:.1%} with the "
            f"delayed update; {REFERENCE}")


def check(results: list[dict]) -> list[str]:
    """Failures: a loss that is not finite (a way that trained nothing is no figure)."""
    return [f"{r['way']}: final loss {r['final_loss']}" for r in results
            if not math.isfinite(r["final_loss"])]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 8 x 1024 = 8,192 tokens a step: a common per-GPU batch; the ratio grows with it, since
    # the CPU-Adam's time per step does not
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    # 2 warm-up steps: the first allocates the moments, pins the host buffers and starts the
    # CPU-Adam's threads; the delayed update's first overlap is the second. 3 timed steps:
    # about 0.2 s each for AMP AdamW (54 TFLOP at 1.10B params and 8,192 tokens)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--overrides", default="",
                   help="model config changes, k=v,... (a tiny model for --device cpu)")
    p.add_argument("--json", default=None, help="write the figures here (for gpu_peers.py)")
    p.add_argument("--offload_fractions", default="",
                   help="comma-separated offload_fraction values (0 to 1, or auto) to run "
                        "as more ways, e.g. 0,0.5,auto")
    args = p.parse_args(argv)
    from hf_zoffload.config import ZeroOffloadPlugin

    args.fractions = [f.strip() for f in args.offload_fractions.split(",") if f.strip()]
    for f in args.fractions:
        try:
            ZeroOffloadPlugin(offload_fraction=f)
        except ValueError as err:
            p.error(f"--offload_fractions: {err}")
    if min(args.batch, args.seq, args.steps) < 1 or args.warmup < 0:
        p.error(f"--batch {args.batch}, --seq {args.seq} and --steps {args.steps} must be >= 1, "
                f"--warmup {args.warmup} >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    base = llama.with_overrides(llama.LLAMA_1B, args.overrides, what=f"{SCRIPT}: --overrides")
    if args.device == "cuda":
        common.require_cuda(SCRIPT)
    ways = [(llama.AMP, llama.amp_step, torch.float32),
            (llama.ZOFFLOAD, llama.zoffload_step, torch.bfloat16),
            (llama.ZOFFLOAD + DELAYED,
             lambda m: llama.zoffload_step(m, delayed_update=True,
                                           delayed_update_warmup_steps=0), torch.bfloat16)]
    ways += [(llama.ZOFFLOAD + FRACTION + f,
              lambda m, f=f: llama.zoffload_step(m, offload_fraction=f), torch.bfloat16)
             for f in args.fractions]
    common.summary(f"Llama {base['num_hidden_layers']} layers x {base['hidden_size']} "
                   f"({llama.count(llama.n_params(base))} params), batch {args.batch} x "
                   f"{args.seq} tokens, {args.warmup} warm-up + {args.steps} timed steps")
    common.summary("")
    for line in common.md_table(HEADER, [])[:2]:
        common.summary(line)
    results, failures = [], []
    for name, make, dtype in ways:
        try:
            r = measure(name, make, base=base, dtype=dtype, args=args)
        except Exception as exc:  # noqa: BLE001 -- the other ways still run; the stage fails
            traceback.print_exc()
            failures.append(f"{name}: {type(exc).__name__}: {exc}"[:400])
            continue
        results.append(r)
        amp = results[0] if results[0]["way"] == llama.AMP else None
        common.summary(common.md_table(HEADER, [row(r, amp)])[2])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overrides": args.overrides, "batch": args.batch, "seq": args.seq,
                       "warmup": args.warmup, "steps": args.steps, "results": results}, f)
    return common.finish(SCRIPT, ["", ratio_line(results)], failures + check(results))


if __name__ == "__main__":
    sys.exit(main())
