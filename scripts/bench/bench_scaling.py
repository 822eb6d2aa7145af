"""Unscale + inf/nan check + sum of squares over fp16 grad buckets, on a CUDA device.

Compares, over --elements elements in buckets of --bucket (default 1B in 25M buckets):
  ours       hf_zoffload.ops.scaling.unscale_check_, one read (2 B/elem for fp16)
  ours+out   the same, also writing fp32 unscaled values (2 + 4 B/elem)
  torch pair torch._amp_foreach_non_finite_check_and_unscale_ (in place: 2 + 2 B/elem)
             plus torch._foreach_norm (2 B/elem) and the norm of the norms
against a device-to-device copy of the whole buffer (2 + 2 B/elem), whose bytes/s is the
measured copy bandwidth. Each method runs eagerly and replayed from a CUDA graph: the graph
removes Python launch cost (~10 us per Triton launch, about a 25M-fp16 bucket's read time
on an H200), leaving the device throughput. The eight (method, launch) rows are timed in
--samples rounds (scripts/bench/_interleave.py), each timing one sample of --passes passes of every
row, the order rotating: ms / pass is a row's median over rounds, "of copy GB/s" and "speedup
vs torch pair" the medians of the per-round ratios to the copy and the torch pair of the same
launch. Prints a markdown table.

    python scripts/bench/bench_scaling.py [--elements N] [--bucket N] [--dtype fp16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported by the tests rather than run as a script
    sys.path.insert(0, HERE)

import _interleave as il  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elements", type=int, default=1_000_000_000)
    p.add_argument("--bucket", type=int, default=25_000_000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--passes", type=int, default=10, help="passes per timed sample")
    p.add_argument("--samples", type=int, default=5,
                   help="rounds, each timing one sample of every row; medians over rounds")
    return p.parse_args(argv)


def sample(fn, passes):
    """Seconds for one call of fn, the mean over ``passes`` calls timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(passes):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / passes


def graphed(fn):
    """fn captured once in a CUDA graph; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton compiles) off the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def foreach_norm_fp32(tensors):
    try:  # fp32 norms: an fp16 norm of 25M values near 1 overflows fp16
        return torch._foreach_norm(tensors, 2, dtype=torch.float32)
    except TypeError:  # older torch without the dtype argument
        return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]


def report(methods, timed: il.Rounds, elements: int) -> list[str]:
    """The table and the targets, from ``timed``'s rows named "<method>, <launch>"."""
    lines = ["| method | launch | ms / pass | B/elem | GB/s | of copy GB/s | speedup vs torch "
             "pair |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    copy_bytes = methods[0][2]
    for name, _, bytes_per_elem in methods:
        for mode in ("eager", "graph"):
            row = f"{name}, {mode}"
            sec = timed.median(row)
            # the row's GB/s over the copy's in each round: its bytes over the copy's, times
            # the copy's seconds over its own
            of_copy = bytes_per_elem / copy_bytes * timed.ratio(f"D2D copy, {mode}", row)
            speedup = timed.ratio(f"torch pair, {mode}", row)
            lines.append(f"| {name} | {mode} | {sec * 1e3:.3f} | {bytes_per_elem} | "
                         f"{bytes_per_elem * elements / sec / 1e9:,.0f} | {of_copy:.2f} | "
                         f"{speedup:.2f}x |")
    ours_bytes = methods[1][2]
    for mode in ("eager", "graph"):
        row = f"ours, {mode}"
        lines.append(f"\ntargets ({mode}): ours {timed.ratio(f'torch pair, {mode}', row):.2f}x "
                     f"the torch pair (want >= 1.5x), "
                     f"{ours_bytes / copy_bytes * timed.ratio(f'D2D copy, {mode}', row):.2f} "
                     "of copy GB/s (want >= 0.8)")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_scaling.py needs a CUDA GPU; none here, nothing measured.")
        return 0
    import triton

    from hf_zoffload.ops.scaling import unscale_check_

    dev = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    data = torch.randn(args.elements, device=dev).to(dtype)
    buckets = list(data.split(args.bucket))
    esize = data.element_size()
    one = torch.ones(1, device=dev)  # inv_scale 1: the in-place torch unscale stays stable
    found, sumsq = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    out = torch.empty(min(args.bucket, args.elements), device=dev)
    copy_dst = torch.empty_like(data)

    def ours():
        for b in buckets:
            unscale_check_(b, one, found, sumsq, backend="triton")

    def ours_out():
        for b in buckets:
            unscale_check_(b, one, found, sumsq, out=out[: b.numel()], backend="triton")

    def torch_pair():
        torch._amp_foreach_non_finite_check_and_unscale_(buckets, found, one)
        return torch.linalg.vector_norm(torch.stack(foreach_norm_fp32(buckets)))

    def copy():
        copy_dst.copy_(data)

    # Agreement check before timing: both sums of squares of the same data.
    sumsq.zero_()
    ours()
    ref = torch_pair().double() ** 2
    rel = abs(sumsq.double() - ref).item() / ref.item()

    methods = [("D2D copy", copy, 2 * esize), ("ours", ours, esize),
               ("ours+out", ours_out, esize + 4), ("torch pair", torch_pair, 3 * esize)]
    rows = []
    for name, fn, _ in methods:
        for mode, run in (("eager", fn), ("graph", graphed(fn))):
            rows.append((f"{name}, {mode}", il.SelfTimed(
                lambda run=run: sample(run, args.passes))))
    torch.cuda.synchronize()  # the graphs' warm-ups ran on a side stream
    timed = il.interleave(rows, args.samples)

    props = torch.cuda.get_device_properties(dev)
    print(f"## bench_scaling: {props.name} ({props.multi_processor_count} SMs), torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}\n")
    print(f"{args.elements:,} {args.dtype} elements in {len(buckets)} buckets of "
          f"{args.bucket:,}; {args.samples} rounds, each timing one sample of {args.passes} "
          "passes of every row, the order rotating: medians over rounds, of per-round ratios. "
          f"GB/s counts bytes read + written; sum-of-squares agreement ours vs torch: "
          f"{rel:.1e} relative.\n")
    print("\n".join(report(methods, timed, args.elements)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
