#!/usr/bin/env python
"""Tokens/s of ZeRO-Offload against plain AMP AdamW on a model that fits both ways, on CUDA.

TinyLlama-1.1B's shape (scripts/bench/_gpu_llama.py, 1.10B params, built from its config with
random weights) trained on one fixed batch (default 8 x 1024 tokens), the ways in turn, each
on a fresh model in this process:
  - torch AdamW (fused) on fp32 params under bf16 autocast, everything on the device;
  - `ZeroOffloadOptimizer`, bf16 compute (fp32 master weights and moments on the host);
  - the same with ``delayed_update=True`` (no warm-up steps: every step's CPU-Adam overlaps
    the next forward and backward);
  - the same with ``overlap_step=True`` (each bucket's CPU-Adam during backward), without
    clipping and with ``max_grad_norm=1.0`` (speculating the norm stays under it); their
    "hit rate" column is the share of steps whose early updates stood (the rest were undone
    and redone at ``step()``);
  - with ``--offload_fractions 0,0.5,auto``: the same (not delayed) at each
    ``offload_fraction`` (the share of the state kept on the host; the rest is updated on
    the device); ``auto`` decides at the end of the first warm-up step;
  - with ``--fsdp2``: FSDP2 parameter offload (``fully_shard`` per layer and the root,
    ``CPUOffloadPolicy``, a one-rank group) with `ZeroOffloadOptimizer` as its optimizer,
    and the same FSDP2 as its users run it, an fp32 model under
    ``MixedPrecisionPolicy(param_dtype=bf16)`` stepped by ``torch.optim.AdamW(fused=True)``
    on the host; their step times against optimizer offload alone and against each other
    (both built on the host, where FSDP2 keeps the params: their peak is FSDP2's own).
Each runs --warmup steps, then --steps timed ones between ``torch.cuda.synchronize()`` calls
(a delayed update's last step is landed inside the timed span); tokens/s = batch x seq x steps
/ seconds; peak device memory is ``torch.cuda.max_memory_allocated()`` over the whole run of
the way, model build included. ``--time_limit`` (under gpu_check.sh its stage's limit less
4 s): a way starts only while 1.1 x the longest way so far is left; the ways left out are
named in a bold line (a figure missing, not a failure). Prints each way's row as it ends,
then the ratios beside the reference quoted in issue 22 (DeepSpeed's study: ZeRO-Offload at
17.6% of no-offload speed, Qwen2.5-1.5B on 2x A100: another model, batch and machine), and
with ``--fsdp2`` the FSDP2 step times against optimizer offload alone and torch's AdamW.

``--json PATH`` writes the figures for gpu_peers.py (the same model and batch).
Needs CUDA (``--device cpu`` runs the same code on a tiny config, for the test suite).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
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
OVERLAP, CLIPPED = ", overlap_step=True", ", max_grad_norm=1.0"
FRACTION = ", offload_fraction="
FSDP2_WAYS = (llama.FSDP2, llama.FSDP2_TORCH)
HEADER = ["way", "tokens/s", "ms/step", "peak device GiB", "vs AMP AdamW", "final loss",
          "hit rate"]


def measure(name: str, make, *, base: dict, dtype: torch.dtype, args, build_on=None,
            deadline: float | None = None) -> dict:
    """One way on a fresh model (built on ``build_on``, default the device): ``make(model) ->
    (step, finish[, engine])``; its figures, with the overlapped schedule's speculation hit
    rate over every step (warm-up included) where the engine has one. ``deadline`` (a
    ``time.perf_counter()`` value): past it no more warm-up step starts after the first, and
    no timed step after the first whose predicted end (the timed steps' mean so far) passes
    it; ``steps`` says how many were timed, so a way short of time still gives its figure
    instead of being killed."""
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
    model = llama.build_model(base, dtype, build_on or device)
    made = make(model)
    step, finish = made[:2]
    engine = made[2] if len(made) > 2 else None
    ids = llama.token_ids(base, args.batch, args.seq, device)
    for i in range(args.warmup):
        if i and deadline is not None and time.perf_counter() >= deadline:
            break
        step(ids)
    finish()
    sync()
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        now = time.perf_counter()
        if losses and deadline is not None and now + (now - t0) / len(losses) > deadline:
            break
        losses.append(step(ids))  # device tensors: no sync inside the timed steps
    finish()
    sync()
    seconds, n = time.perf_counter() - t0, len(losses)
    out = {"way": name, "tokens_per_s": args.batch * args.seq * n / seconds,
           "ms_per_step": 1e3 * seconds / n, "final_loss": float(losses[-1]), "steps": n,
           "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
           "hit_share": getattr(engine, "timings", {}).get("hit_share")}
    del model, step, finish, engine, made, losses
    gc.collect()
    return out


def write_json(args, results: list[dict]) -> None:
    """The figures for gpu_peers.py (``--json``), written whole each time."""
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"overrides": args.overrides, "batch": args.batch, "seq": args.seq,
                   "warmup": args.warmup, "steps": args.steps, "results": results}, f)
    os.replace(tmp, args.json)


def row(r: dict, amp: dict | None) -> list:
    """A table row; ``amp``: the AMP AdamW figures the ratio is against (None: n/a)."""
    vs = f"{r['tokens_per_s'] / amp['tokens_per_s']:.2f}" if amp else "n/a"
    peak = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") is not None else "n/a"
    hit = f"{r['hit_share']:.2f}" if r.get("hit_share") is not None else "n/a"
    return [r["way"], f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step']:.0f}", peak, vs,
            f"{r['final_loss']:.3f}", hit]


def ratio_line(results: list[dict]) -> str:
    named = {r["way"]: r for r in results}
    amp, ours = named.get(llama.AMP), named.get(llama.ZOFFLOAD)
    delayed = named.get(llama.ZOFFLOAD + DELAYED)
    if not (amp and ours and delayed):
        return "ratios: n/a (a way did not finish)"
    return (f"ZeRO-Offload runs at {ours['tokens_per_s'] / amp['tokens_per_s']:.1%} of AMP "
            f"AdamW's tokens/s, {delayed['tokens_per_s'] / amp['tokens_per_s']:.1%} with the "
            f"delayed update; {REFERENCE}")


def fsdp2_line(results: list[dict]) -> str | None:
    """Step time of FSDP2 parameter offload with our CPU step against optimizer offload alone
    and against FSDP2 with torch's fused AdamW; None without the FSDP2 rows."""
    named = {r["way"]: r for r in results}
    ours, torch_way = named.get(llama.FSDP2), named.get(llama.FSDP2_TORCH)
    alone = named.get(llama.ZOFFLOAD)
    if not ours:
        return None
    parts = [f"FSDP2 parameter offload with ZeroOffloadOptimizer: {ours['ms_per_step']:.0f} "
             "ms/step"]
    if alone:
        parts.append(f"{ours['ms_per_step'] / alone['ms_per_step']:.2f}x the step time of "
                     f"optimizer offload alone ({alone['ms_per_step']:.0f} ms)")
    if torch_way:
        parts.append(f"{torch_way['ms_per_step'] / ours['ms_per_step']:.2f}x faster than FSDP2 "
                     f"with torch AdamW(fused) on the host ({torch_way['ms_per_step']:.0f} ms)")
    return ", ".join(parts)


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
    p.add_argument("--fsdp2", action="store_true",
                   help="two more ways: FSDP2 parameter offload with ZeroOffloadOptimizer, "
                        "and with torch AdamW(fused) on the host")
    p.add_argument("--time_limit", type=float, default=None,
                   help="seconds for all the ways (default: GPU_CHECK_STAGE_S - 4 under "
                        "gpu_check.sh, else none); a way starts only while 1.1 x the "
                        "longest so far is left")
    args = p.parse_args(argv)
    if args.time_limit is None and os.environ.get("GPU_CHECK_STAGE_S", "").isdigit():
        args.time_limit = max(1.0, int(os.environ["GPU_CHECK_STAGE_S"]) - 4.0)
    from hf_zoffload.config import ZeroOffloadPlugin

    args.fractions = [f.strip() for f in args.offload_fractions.split(",") if f.strip()]
    for f in args.fractions:
        try:
            ZeroOffloadPlugin(offload_fraction=f)
        except ValueError as err:
            p.error(f"--offload_fractions: {err}")
    if min(args.batch, args.seq, args.steps) < 1 or args.warmup < 0 or (
            args.time_limit is not None and args.time_limit <= 0):
        p.error(f"--batch {args.batch}, --seq {args.seq} and --steps {args.steps} must be >= 1, "
                f"--warmup {args.warmup} >= 0 and --time_limit {args.time_limit} > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    base = llama.with_overrides(llama.LLAMA_1B, args.overrides, what=f"{SCRIPT}: --overrides")
    if args.device == "cuda":
        common.require_cuda(SCRIPT)
    ways = [(llama.AMP, llama.amp_step, torch.float32, None),
            (llama.ZOFFLOAD, llama.zoffload_step, torch.bfloat16, None),
            (llama.ZOFFLOAD + DELAYED,
             lambda m: llama.zoffload_step(m, delayed_update=True,
                                           delayed_update_warmup_steps=0), torch.bfloat16, None)]
    ways += [(llama.ZOFFLOAD + FRACTION + f,
              lambda m, f=f: llama.zoffload_step(m, offload_fraction=f), torch.bfloat16, None)
             for f in args.fractions]
    # the overlapped step, without clipping and with the Trainer's max_grad_norm 1.0
    ways += [(llama.ZOFFLOAD + OVERLAP,
              lambda m: llama.zoffload_step(m, overlap_step=True), torch.bfloat16, None),
             (llama.ZOFFLOAD + OVERLAP + CLIPPED,
              lambda m: llama.zoffload_step(m, overlap_step=True, max_grad_norm=1.0),
              torch.bfloat16, None)]
    if args.fsdp2:  # last: a run short of time leaves out these, the newest rows
        ways += [(llama.FSDP2, lambda m: llama.fsdp2_step(m, args.device), torch.bfloat16,
                  "cpu"),
                 (llama.FSDP2_TORCH, lambda m: llama.fsdp2_torch_step(m, args.device),
                  torch.float32, "cpu")]
    common.summary(f"Llama {base['num_hidden_layers']} layers x {base['hidden_size']} "
                   f"({llama.count(llama.n_params(base))} params), batch {args.batch} x "
                   f"{args.seq} tokens, {args.warmup} warm-up + {args.steps} timed steps")
    common.summary("")
    for line in common.md_table(HEADER, [])[:2]:
        common.summary(line)
    results, failures, left_out = [], [], []
    t0, longest = time.perf_counter(), 0.0
    group = llama.one_rank_group(args.device) if args.fsdp2 else contextlib.nullcontext()
    with group:
        for name, make, dtype, build_on in ways:
            spent = time.perf_counter() - t0
            if args.time_limit and longest and args.time_limit - spent < 1.1 * longest:
                left_out.append(name)
                continue
            t1 = time.perf_counter()
            try:
                r = measure(name, make, base=base, dtype=dtype, args=args, build_on=build_on,
                            deadline=t0 + args.time_limit if args.time_limit else None)
            except Exception as exc:  # noqa: BLE001 -- the other ways still run; it fails
                traceback.print_exc()
                failures.append(f"{name}: {type(exc).__name__}: {exc}"[:400])
                continue
            finally:
                longest = max(longest, time.perf_counter() - t1)
            results.append(r)
            amp = results[0] if results[0]["way"] == llama.AMP else None
            common.summary(common.md_table(HEADER, [row(r, amp)])[2])
            if args.json:  # after each way: a stage killed later keeps what it measured
                write_json(args, results)
    if args.json:
        write_json(args, results)
    lines = ["", ratio_line(results)] + [x for x in [fsdp2_line(results)] if x]
    short = [f"{r['way']} ({r['steps']} of {args.steps})" for r in results
             if r["steps"] < args.steps]
    if short:
        lines.append(f"**timed over fewer steps, the {args.time_limit:.0f} s time limit being "
                     "near: " + "; ".join(short) + "**")
    if left_out:
        lines.append(f"**not run, the {args.time_limit:.0f} s time limit being near: "
                     + "; ".join(left_out) + "**")
    return common.finish(SCRIPT, lines, failures + check(results))


if __name__ == "__main__":
    sys.exit(main())
