#!/usr/bin/env python
"""Benchmark of the CPU step with FSDP2 parameter offload: ours against torch's AdamW.

One process, a 1-rank gloo group, a stack of Linear(dim, dim) layers (about --params in all),
each its own ``fully_shard`` group with ``CPUOffloadPolicy``, so every sharded param and its
gradient live on the host, as FSDP2 leaves them. Rows, each timing one optimizer step over
the same shapes of sharded host params:

  torch AdamW(default)  FSDP2's usual setup: an fp32 model, MixedPrecisionPolicy(param_dtype=
                        bf16), so the host holds fp32 shards and fp32 gradients; the step
                        reads 4 + 4 + 8 and writes 4 + 8 B/param; torch's default for CPU
                        params, one param after another (foreach kernels are for GPUs)
  torch AdamW(foreach)  the same, in several foreach passes over all params
  torch AdamW(fused)    the same params and grads, torch's one-pass fused CPU kernel (28 B)
  ours <state_dtype>    ZeroOffloadOptimizer on a bf16-sharded model (fsdp2.Fsdp2Exchange):
                        16-bit grads in, fp32 master, moments in fp32 (28 B moved), bf16
                        (20 B) or int8 (about 16 B), 16-bit params written in place

The torch rows keep one backward's grads and time ``step()`` alone; ours runs a backward
first (untimed: the engine takes each window's grads once) and times ``step()``, which also
reads the window's overflow flag and norm. Rows are timed in rounds
(scripts/bench/_interleave.py): each round times every row once, the order rotating; ms is a
row's median over rounds and each ratio the median over rounds of the reference's ms over the
row's (above 1: the row is faster). Host memory: the torch rows share one model (fp32 params
and grads, 8 B/param) and each keeps its moments (8 B/param); each of ours has its own model
and state, 16 / 12 / about 10 B/param.

Usage: python scripts/bench/bench_fsdp2_step.py [--params 100M] [--dim 2048] [--rounds 5]
       [--state_dtypes fp32,bf16,int8] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run with runpy (the tests) rather than as a script
    sys.path.insert(0, HERE)

import _interleave as il  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import (  # noqa: E402
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    fully_shard,
)

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin  # noqa: E402
from hf_zoffload.commands.env import cpu_name  # noqa: E402
from hf_zoffload.config import STATE_DTYPES  # noqa: E402
from hf_zoffload.units import parse_quantity  # noqa: E402

DEFAULT, FOREACH, FUSED = ("torch AdamW(default) fp32", "torch AdamW(foreach) fp32",
                           "torch AdamW(fused) fp32")
COUNTS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def stack(n_params: int, dim: int, *, dtype, mp=None) -> torch.nn.Sequential:
    layers = max(1, round(n_params / (dim * dim + dim)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)]).to(dtype)
    kw = {"mesh": init_device_mesh("cpu", (1,)),
          "offload_policy": CPUOffloadPolicy(pin_memory=False)}
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in model:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def backward(model, dim: int, dtype) -> None:
    x = torch.randn(2, dim, dtype=dtype)
    model(x).float().pow(2).mean().backward()


def rows(n_params: int, dim: int, state_dtypes: list[str], threads: int):
    """(name, row) pairs and the trained element count of each model."""
    out = []
    ref = stack(n_params, dim, dtype=torch.float32, mp=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16))
    backward(ref, dim, torch.bfloat16)  # fp32 grads on the host, kept for every step
    n = sum(p.numel() for p in ref.parameters())
    for name, kw in ((DEFAULT, {}), (FOREACH, {"foreach": True}), (FUSED, {"fused": True})):
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, **kw)
        out.append((name, opt.step))
    for sd in state_dtypes:
        model = stack(n_params, dim, dtype=torch.float32)
        opt = ZeroOffloadOptimizer(model.parameters(), lr=1e-4, model=model,
                                   plugin=ZeroOffloadPlugin(compute_dtype="bf16",
                                                            state_dtype=sd, cpu_threads=threads))

        def timed_step(model=model, opt=opt):
            backward(model, dim, torch.bfloat16)
            t0 = time.perf_counter()
            opt.step()
            return time.perf_counter() - t0

        out.append((f"ours {sd} state, bf16 grads", il.SelfTimed(timed_step)))
    return out, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="100M", help="trained params in all (e.g. 100M)")
    ap.add_argument("--dim", type=int, default=2048, help="each Linear is dim x dim")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--state_dtypes", default="fp32,bf16,int8")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch's threads and the engine's cpu_threads")
    args = ap.parse_args(argv)
    try:
        n_params = parse_quantity(args.params, COUNTS, "--params", "100M")
    except ValueError as exc:
        ap.error(str(exc))
    state_dtypes = [s for s in args.state_dtypes.split(",") if s]
    if any(s not in STATE_DTYPES for s in state_dtypes):
        ap.error(f"--state_dtypes {args.state_dtypes!r}: allowed {', '.join(STATE_DTYPES)}")
    if min(args.rounds, args.threads, args.dim, n_params) < 1:
        ap.error("--params, --dim, --rounds and --threads must be positive")
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        made, n = rows(n_params, args.dim, state_dtypes, args.threads)
        res = il.interleave(made, args.rounds)
    finally:
        torch.set_num_threads(saved)
        if own_group:
            dist.destroy_process_group()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# FSDP2 CPU step benchmark\n\nCPU: {cpu_name()} ({os.cpu_count()} logical CPUs), "
          f"{args.threads} threads; load average before the report {load}; torch "
          f"{torch.__version__}\n{n:,} params in {n // (args.dim * args.dim + args.dim)} "
          f"Linear({args.dim}, {args.dim}) layers, {args.rounds} rounds, each timing every "
          "row once, the order rotating\n")
    print("| row | ms/step | vs torch foreach | vs torch fused |")
    print("|---|---|---|---|")
    for name, _ in made:
        print(f"| {name} | {res.median(name) * 1e3:.1f} | {res.ratio(FOREACH, name):.2f} | "
              f"{res.ratio(FUSED, name):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
