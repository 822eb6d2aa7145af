#!/usr/bin/env python
"""offload_fraction on the CPU: the quickstart model (integrations/defaults.py's GPT-2, 1.06M
params with 2048 tokens) trained in fp32 for --steps steps at each fraction, one process and 2
gloo ranks, against torch.optim.AdamW on the same data; prints a markdown table of the largest
param difference from AdamW's, the host and device bytes of the optimizer state
(memory_report) and the seconds. Exits 1 when a difference is above --tolerance.

Batches are random token blocks (8 x 64, as the quickstart's), the same for every run; the 2
ranks take 4 rows each, so their averaged gradient is the one-process gradient (dropout
off). Buckets are --bucket_size_mb (0.25: 10 buckets; the default 32 would put the model in
one).
Usage: python scripts/bench/fraction_check.py [--steps 50] [--fractions 0,0.5,1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.integrations.defaults import default_config

LR, MAX_NORM, WD = 1e-3, 1.0, 0.01
BATCH, SEQ, VOCAB = 8, 64, 2048


def model():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = default_config(vocab_size=VOCAB, block_size=SEQ)
    # dropout off: 2 ranks of 4 rows draw other masks than 1 process of 8, and the check is
    # of the optimizer, not of the masks
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def data(steps: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


def train(m, opt, batches, *, rows=slice(None), engine: bool):
    for ids in batches:
        ids = ids[rows]
        m(input_ids=ids, labels=ids).loss.backward()
        if engine:
            opt.clip_grad_norm_(MAX_NORM)
        else:
            torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


def engine_run(fraction: str, batches, *, bucket_mb: float, rows=slice(None)):
    m = model()
    opt = ZeroOffloadOptimizer(m.parameters(), lr=LR, weight_decay=WD, model=m,
                               plugin=ZeroOffloadPlugin(compute_dtype="fp32",
                                                        bucket_size_mb=bucket_mb,
                                                        offload_fraction=fraction))
    t0 = time.perf_counter()
    params = train(m, opt, batches, rows=rows, engine=True)
    seconds = time.perf_counter() - t0
    rep = opt.memory_report()
    host = sum(rep["host"][k] for k in ("master", "exp_avg", "exp_avg_sq"))
    on_dev, buckets = rep["buckets"]["device"], sum(rep["buckets"].values())
    return params, {"host": host, "device": rep["device"].get("optimizer_state", 0),
                    "seconds": seconds, "buckets": f"{on_dev}/{buckets}"}


def _rank(rank: int, world: int, store: str, args, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    k = BATCH // world
    results = {}
    for f in args.fractions:
        params, figures = engine_run(f, data(args.steps), bucket_mb=args.bucket_size_mb,
                                     rows=slice(rank * k, (rank + 1) * k))
        results[f] = (params, figures)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--fractions", default="0,0.5,1")
    p.add_argument("--bucket_size_mb", type=float, default=0.25)
    # fp32 compute, 50 steps: the engine's kernels and torch's foreach AdamW differ by a
    # rounding or two per step, fed back through training (tests/offload/test_engine.py:
    # 1e-5 over 20 steps); a lost gradient or a wrong update is off by > 1e-3
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--no_ranks", action="store_true", help="skip the 2-rank runs")
    args = p.parse_args(argv)
    args.fractions = [f.strip() for f in args.fractions.split(",") if f.strip()]
    batches = data(args.steps)
    ref = model()
    adamw = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    t0 = time.perf_counter()
    want = train(ref, adamw, batches, engine=False)
    print(f"torch.optim.AdamW, {args.steps} steps: {time.perf_counter() - t0:.1f} s")
    rows = []
    for f in args.fractions:
        got, fig = engine_run(f, batches, bucket_mb=args.bucket_size_mb)
        rows.append(("1 process", f, got, fig))
    if not args.no_ranks:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "ranks")
            mp.spawn(_rank, args=(2, os.path.join(d, "store"), args, out), nprocs=2)
            per_rank = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
        for f in args.fractions:
            (p0, fig0), (p1, _) = per_rank[0][f], per_rank[1][f]
            if not all(torch.equal(a, b) for a, b in zip(p0, p1)):
                print(f"fraction {f}: the 2 ranks ended with different params")
                return 1
            rows.append(("2 gloo ranks (rank 0)", f, p0, fig0))
    print("\n| run | offload_fraction | device buckets | max abs diff vs AdamW | host state B "
          "| device state B | s |\n|---|---|---|---|---|---|---|")
    worst = 0.0
    for run, f, got, fig in rows:
        diff = max((a - b).abs().max().item() for a, b in zip(got, want))
        worst = max(worst, diff)
        print(f"| {run} | {f} | {fig['buckets']} | {diff:.2e} | {fig['host']:,} | "
              f"{fig['device']:,} | {fig['seconds']:.1f} |")
    ok = worst <= args.tolerance
    print(f"\nlargest difference {worst:.2e} ({'within' if ok else 'ABOVE'} {args.tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
