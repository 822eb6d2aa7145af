#!/usr/bin/env python
"""Benchmark of the one-pass CPU-Adam against its references, in one run.

Rows per (size, threads):
  ceiling            measured memory ceiling for Adam's traffic: a compiled pass with the
                     kernel's flags and chunking that reads 4 fp32 arrays and writes 3 in place
                     (a += d; b += d; c += d), i.e. the 28 B/param of one Adam pass and no math
  torch fused fp32   torch.optim.AdamW(fused=True), fp32 grads (28 B/param)
  torch composed     the offload path in torch: 16-bit grad copy_ into a preallocated fp32 grad,
                     fused AdamW step, copy_ of the param to 16 bit (40 B/param)
  deepspeed fp32     DeepSpeedCPUAdam, fp32 grads (only when deepspeed imports)
  deepspeed composed the same three steps around DeepSpeedCPUAdam (40 B/param)
  ours fp32          hf_zoffload adam_update, fp32 grads (28 B/param)
  ours 16-bit        hf_zoffload adam_update, 16-bit grads in, 16-bit params out (28 B/param)
  ours ... over grads  the engine's call: the new 16-bit params written over the 16-bit grads
                     just read, moments by state_dtype: fp32 (28 B/param moved), bf16 (20),
                     int8 (16 + 8 B per block of scales; one row per --qblocks block size)
  int8 ceiling       the memory ceiling of that int8 call: a compiled pass that reads and
                     writes in place the fp32 params, the 16-bit grads and the two code bytes
                     (16 B/param, no math); its "vs fp32 state" is the most bytes allow int8

ms/step is the median of --repeats timed calls after one warm-up; GB/s counts the nominal bytes
above; "of ceiling" is the row's GB/s over the ceiling's, the fraction of the measured memory
bandwidth it uses; "vs fp32 state" is the fp32-state engine row's ms over the row's ms.
Usage: python scripts/bench_cpu_adam.py [--sizes 10M,50M,100M] [--threads 1,2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

import hf_zoffload
from hf_zoffload.commands.env import cpu_name
from hf_zoffload.ops import cpu_adam as ca
from hf_zoffload.ops import moments as mo

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def _time(fn, repeats: int) -> float:
    fn()  # warm-up: first touch of every page, thread pool start, DeepSpeed/torch lazy init
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _deepspeed():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its JIT build failed
        return None
    return DeepSpeedCPUAdam


def bench(n: int, threads: int, repeats: int, grad16: torch.dtype, out16: torch.dtype,
          qblocks: list[int]):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    g32 = torch.randn(n, generator=gen) * 1e-2
    g16 = g32.to(grad16)
    o16 = torch.empty(n, dtype=out16)
    ext = ca._ext()
    rows = []

    def add(name, ms, nbytes):
        rows.append((name, ms, nbytes))

    add("ceiling (read 4, write 3)", _time(lambda: ext.traffic_pass(
        p.data_ptr(), m.data_ptr(), v.data_ptr(), g32.data_ptr(), n, threads), repeats), 28)
    m.zero_(), v.zero_()  # the ceiling pass wrote into them; keep Adam's moments sane

    param = torch.nn.Parameter(p.clone())
    param.grad = g32.clone()
    opt = torch.optim.AdamW([param], lr=HP["lr"], weight_decay=HP["weight_decay"], fused=True)
    add("torch AdamW(fused) fp32", _time(opt.step, repeats), 28)

    def composed(step):
        def run():
            param.grad.copy_(g16)
            step()
            o16.copy_(param.detach())
        return run

    add("torch composed 16-bit", _time(composed(opt.step), repeats), 40)
    del opt

    ds_cls = _deepspeed()
    if ds_cls is not None:
        ds = ds_cls([param], lr=HP["lr"], weight_decay=HP["weight_decay"], adamw_mode=True)
        add("DeepSpeedCPUAdam fp32", _time(ds.step, repeats), 28)
        add("DeepSpeedCPUAdam composed 16-bit", _time(composed(ds.step), repeats), 40)
        del ds
    param.grad = None  # frees the fp32 grad copy before our rows run

    step = [0]

    def ours(grad, out):
        def run():
            step[0] += 1
            ca.adam_update(p, grad, m, v, step=step[0], out16=out, num_threads=threads, **HP)
        return run

    add("ours fp32", _time(ours(g32, None), repeats), 28)
    add("ours 16-bit grad in + 16-bit out", _time(ours(g16, o16), repeats), 28)
    g = g16.to(out16)  # the engine's buffer: grads in, new params out, one dtype
    add("ours fp32 state, out over grads", _time(ours(g, g), repeats), 28)
    mb, vb = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)

    def compact(mm, vv, scales=None, qblock=mo.QBLOCK):
        def run():
            step[0] += 1
            ca.adam_update_unchecked(p, g, mm, vv, step=step[0], out16=g, num_threads=threads,
                                     scales=scales, qblock=qblock, **HP)
        return run

    add("ours bf16 state, out over grads", _time(compact(mb, vb), repeats), 20)
    del mb, vb
    mc, vc = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    for qb in qblocks:
        scales = (torch.zeros(-(-n // qb)), torch.zeros(-(-n // qb)))
        add(f"ours int8 state (block {qb}), out over grads",
            _time(compact(mc, vc, scales, qb), repeats), 16 + 16 / qb)
    add("int8 ceiling (read 8, write 8)", _time(lambda: ext.traffic_pass_q8(  # last: adds 1s
        p.data_ptr(), g.data_ptr(), mc.data_ptr(), vc.data_ptr(), n, threads), repeats), 16)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10M,50M,100M", help="comma list, K/M/G suffixes")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per row (median)")
    ap.add_argument("--grad_dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--out_dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--qblocks", default=str(mo.QBLOCK),
                    help="comma list of int8 block sizes (powers of two, 16..4096) to time")
    args = ap.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    qblocks = [int(b) for b in args.qblocks.split(",")]
    if args.repeats < 1 or min(threads) < 1 or min(sizes) < 1:
        ap.error("--repeats, --threads and --sizes must be positive")
    if any(b < 16 or b > 4096 or b & (b - 1) for b in qblocks):
        ap.error(f"--qblocks: powers of two from 16 to 4096, got {args.qblocks}")

    ds = _deepspeed()
    feats = ca.compiled_features()
    isa = ", ".join(k for k in ("avx2", "f16c", "avx512f", "avx512_bf16") if feats[k]) or "none"
    print(f"# CPU-Adam benchmark\n\nCPU: {cpu_name()} ({os.cpu_count()} logical CPUs); "
          f"Python {platform.python_version()}; torch {torch.__version__}; "
          f"hf_zoffload {hf_zoffload.__version__} (kernel {ca._ext().auto_variant()}: {isa}; "
          f"OpenMP {'on' if feats['openmp'] else 'off'}); deepspeed "
          f"{__import__('deepspeed').__version__ if ds else 'not installed'}.  "
          f"16-bit rows: {args.grad_dtype} grads, {args.out_dtype} params out.\n")
    print("| params | threads | path | B/param | ms/step | Mparams/s | GB/s | of ceiling | "
          "vs fp32 state |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        for t in threads:
            rows = bench(n, t, args.repeats, DTYPES[args.grad_dtype], DTYPES[args.out_dtype],
                         qblocks)
            ceiling = n * 28 / rows[0][1]  # bytes per ms
            fp32_state = next(ms for name, ms, _ in rows if name.startswith("ours fp32 state"))
            for name, ms, nbytes in rows:
                print(f"| {n / 1e6:g}M | {t} | {name} | {nbytes:g} | {ms:.2f} | "
                      f"{n / ms / 1e3:.0f} | {n * nbytes / ms / 1e6:.1f} | "
                      f"{n * nbytes / ms / ceiling:.2f} | {fp32_state / ms:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
