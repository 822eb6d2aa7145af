"""Benchmark the offload engine.

One process: ``ZeroOffloadOptimizer.step()`` over a GPT-2-124M-shaped set of bf16 params (--layers,
--hidden) against the bare CPU-Adam kernel over the same bytes, in one run (the engine's
overhead): --repeats rounds, each timing one step and one kernel call in alternating order
(scripts/bench/_interleave.py); ms is each one's median, "vs kernel" the median per-round ratio.
(On a GPU, the ways of training against each other: scripts/bench/gpu_practicality.py and
gpu_peers.py, the practicality and peers stages of scripts/gpu_check.sh.)
``--world_size N`` (CPU, gloo, N processes on this machine): the bytes each rank hands to the
collectives and writes to its sockets per step, against the theory (N-1)/N x 4 B/param.
``--world_size N --tp_size T``: a Llama-shaped model sharded with its transformers
tensor-parallel plan over T ranks, data parallel over N/T: per rank per step, the host bytes
held and the bytes of each of the engine's collectives, per param of the whole model, against
the theory (the model's own tensor-parallel all-reduces of activations are not run: the loss
is a sum over each rank's local tensors, so what is measured is the offload's traffic).

Prints a markdown table headed by the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported by the tests rather than run as a script
    sys.path.insert(0, HERE)

import _interleave as il  # noqa: E402

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin  # noqa: E402
from hf_zoffload.commands.env import cpu_name  # noqa: E402
from hf_zoffload.ops.adam_kernels import adam_update  # noqa: E402


def gpt2_shapes(n_layer=12, d=768, vocab=50257, ctx=1024):
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,),
                   (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def bench_cpu(args) -> list[str]:
    torch.set_num_threads(args.threads)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02)
              for s in gpt2_shapes(args.layers, args.hidden)]
    n = sum(p.numel() for p in params)
    opt = ZeroOffloadOptimizer(params, lr=1e-4, plugin=ZeroOffloadPlugin(
        compute_dtype="bf16", bucket_size_mb=args.bucket_size_mb, cpu_threads=args.threads))
    coefs = [torch.tensor(1e-3 * (i + 1), dtype=torch.bfloat16) for i in range(len(params))]

    def engine_step():
        # A backward whose grads are constants: cheap, and it drives the real hooks.
        loss = sum((p * c).sum() for p, c in zip(params, coefs))
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    master = torch.randn(n) * 0.02
    m, v = torch.zeros(n), torch.zeros(n)
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    state = {"step": 0}

    def kernel():
        state["step"] += 1
        adam_update(master, grad, m, v, step=state["step"], lr=1e-4, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.0, out16=out, num_threads=args.threads)

    # the engine's first step (the warm-up) re-lays its host state out; only the step counts
    timed = il.interleave([("kernel", kernel), ("engine", il.SelfTimed(engine_step))],
                          args.repeats)
    kernel_s, step_s = timed.median("kernel"), timed.median("engine")
    buckets = sum(opt.memory_report()["buckets"].values())
    gb = n * 28 / 1e9  # bytes the one pass moves per param: read 2+4+4+4, write 4+4+4+2
    return [
        f"| bare CPU-Adam kernel, bf16 grad in / bf16 param out | {n/1e6:.1f}M | "
        f"{kernel_s*1e3:.1f} | {gb/kernel_s:.1f} | 1.00 |",
        f"| `ZeroOffloadOptimizer.step()` ({buckets} buckets of "
        f"{args.bucket_size_mb:g} MiB) | {n/1e6:.1f}M | {step_s*1e3:.1f} | {gb/step_s:.1f} | "
        f"{timed.ratio('engine', 'kernel'):.2f} |",
    ]


def _wchar() -> int:
    """Bytes this process has passed to write-type system calls (/proc/self/io), sockets
    included: gloo's TCP transport writes with writev/sendmsg, which count here."""
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("wchar")).split()[1])


def _join(rank: int, world: int, port: int, args) -> int:
    """Join the benchmark's gloo group as ``rank``; returns this rank's CPU-Adam threads."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    threads = max(1, args.threads // world)  # the ranks share this machine's cores
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    return threads


def _dp_rank(rank: int, world: int, port: int, args, out_path: str) -> None:
    threads = _join(rank, world, port, args)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in gpt2_shapes(args.layers)]
    n = sum(p.numel() for p in params)
    opt = ZeroOffloadOptimizer(params, lr=1e-4, plugin=ZeroOffloadPlugin(
        compute_dtype="bf16", bucket_size_mb=args.bucket_size_mb, cpu_threads=threads))
    coefs = [torch.tensor(1e-3 * (i + 1), dtype=torch.bfloat16) for i in range(len(params))]

    def step():
        sum((p * c).sum() for p, c in zip(params, coefs)).backward()
        opt.step()

    report = opt.memory_report()
    torch.save({"n": n, **_counted(opt, step, args.repeats),
                "buckets": sum(report["buckets"].values())}, out_path)
    dist.destroy_process_group()


def _counted(opt, step, repeats: int) -> dict:
    """Per step of ``repeats`` after a warm-up one (the first touch of every buffer, and the
    re-layout): the bytes handed to each of the engine's collectives, those written to the
    sockets, the ms, and the host model states this rank holds."""
    step()
    dist.barrier()
    sent0, w0, t0 = opt.collective_bytes, _wchar(), time.perf_counter()
    for _ in range(repeats):
        step()
    dt, wrote = time.perf_counter() - t0, _wchar() - w0
    sent = {k: (v - sent0.get(k, 0)) / repeats for k, v in opt.collective_bytes.items()}
    return {"sent": sent, "wchar": wrote / repeats, "ms": dt / repeats * 1e3,
            "host": opt.memory_report()["host_total"]}


def bench_world(args) -> list[str]:
    # bytes counted, not timed (the step's ms is a note, compared with nothing): no rounds
    n_ranks = args.world_size
    res = _spawn(_dp_rank, args)
    n, frac = res[0]["n"], (n_ranks - 1) / n_ranks
    rows = []

    def row(what, nbytes, theory=""):
        rows.append(f"| {what} | {nbytes / 2**20:.1f} | {nbytes / n:.3f} | {theory} |")

    rs, ag = res[0]["sent"]["reduce_scatter"], res[0]["sent"]["all_gather"]
    row("handed to reduce-scatter (the full 16-bit bucket)", rs, "2")
    row("handed to all-gather (the rank's 16-bit shard)", ag, f"2/N = {2 / n_ranks:.3f}")
    row("handed to all-reduce (flag, norm, per-param counts)", res[0]["sent"]["all_reduce"], "~0")
    row("sent with ring collectives: RS x (N-1)/N + AG x (N-1)", rs * frac + ag * (n_ranks - 1),
        f"(N-1)/N x 4 = {4 * frac:.3f}")
    for r, x in enumerate(res):
        row(f"rank {r}: written to its sockets (measured, /proc/self/io wchar)", x["wchar"],
            f"{4 * frac:.3f} (gloo's reduce-scatter is an all-reduce: {6 * frac:.3f})")
    rows.append(f"\n{n / 1e6:.1f}M bf16 params in {res[0]['buckets']} buckets; step "
                f"{statistics.mean(x['ms'] for x in res):.0f} ms; host model states per rank "
                + ", ".join(f"{x['host'] / 2**20:.0f} MiB" for x in res))
    return rows


def _spawn(target, args) -> list[dict]:
    """``target(rank, world, port, args, out_path)`` on ``args.world_size`` processes; each
    rank's saved dict, in rank order."""
    n_ranks = args.world_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(n_ranks)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=target, args=(r, n_ranks, port, args, outs[r]))
                 for r in range(n_ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return [torch.load(o) for o in outs]


def _tp_rank(rank: int, world: int, port: int, args, out_path: str) -> None:
    # here, not at the top: transformers (the model and its plan) costs the other modes a few
    # seconds of import they do not use
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_zoffload.integrations.parallel import shard_model

    threads = _join(rank, world, port, args)
    tp, dp = args.tp_size, world // args.tp_size
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # every rank the same weights; each keeps its part
    h = args.hidden
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=h, intermediate_size=h * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=h // 64,
        num_key_value_heads=h // 64, tie_word_embeddings=False))
    shard_model(model, mesh["tp"])
    params = list(model.parameters())
    whole = sum(p.numel() for p in params)  # DTensor numel: the whole param
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    n_local = sum(t.numel() for t in local)
    replicated = sum(p.numel() for p in params if not isinstance(p, DTensor)
                     or p.to_local().shape == p.shape)
    opt = ZeroOffloadOptimizer(params, lr=1e-4, process_group=mesh["dp"].get_group()
                               if dp > 1 else None, plugin=ZeroOffloadPlugin(
                                   compute_dtype="bf16", bucket_size_mb=args.bucket_size_mb,
                                   cpu_threads=threads))
    coefs = [torch.tensor(1e-3 * (i + 1), dtype=torch.bfloat16) for i in range(len(params))]

    def step():
        # grads of each rank's local tensors, in the params' placements, without the
        # activation collectives of a real forward (the model's, not the offload's)
        sum(((p.to_local() if isinstance(p, DTensor) else p) * c).sum()
            for p, c in zip(params, coefs)).backward()
        opt.step()

    torch.save({"whole": whole, "local": n_local, "replicated": replicated,
                "tensors": len(params), **_counted(opt, step, args.repeats)}, out_path)
    dist.destroy_process_group()


def bench_tp(args) -> list[str]:
    """Per rank per step, per param of the whole model P: measured against the theory with
    T = tp_size, D = world / T, L = the rank's local elements (P_sharded / T + P_replicated)."""
    tp, dp = args.tp_size, args.world_size // args.tp_size
    res = _spawn(_tp_rank, args)
    r0 = res[0]
    big_p, loc, frac = r0["whole"], r0["local"], (dp - 1) / dp
    rows = []

    def row(what, nbytes, theory):
        rows.append(f"| {what} | {nbytes:,.0f} | {nbytes / big_p:.4f} | {theory / big_p:.4f} |")

    for r, x in enumerate(res):
        row(f"rank {r}: host model states (master 4 + moments 8 + bf16 grad 2 B per owned "
            "element, 14 L / D)", x["host"], 14 * x["local"] / dp)
    sent = r0["sent"]
    row("handed to reduce-scatter over D (the rank's 16-bit local bucket, 2 L)",
        sent.get("reduce_scatter", 0), 2 * loc if dp > 1 else 0)
    row("handed to all-gather over D (its 16-bit shard, 2 L / D)", sent.get("all_gather", 0),
        2 * loc / dp if dp > 1 else 0)
    row("handed to all-reduce over T x D (flag, norm, one per param: 8 x (2 + tensors))",
        sent.get("all_reduce", 0), 8 * (2 + r0["tensors"]))
    ring = sent.get("reduce_scatter", 0) * frac + sent.get("all_gather", 0) * (dp - 1)
    row("sent with ring collectives: RS x (D-1)/D + AG x (D-1)", ring, 4 * loc * frac)
    stats = 8 * (2 + r0["tensors"]) * 2 * (tp * dp - 1) / (tp * dp)  # a ring all-reduce
    for r, x in enumerate(res):
        # gloo's reduce-scatter is an all-reduce: 2 x (D-1)/D x 2 L, then the all-gather
        row(f"rank {r}: written to its sockets (measured, /proc/self/io wchar; gloo: "
            "6 L (D-1)/D)", x["wchar"], 6 * x["local"] * frac + stats)
    rows.append(f"\nLlama {args.layers} layers x {args.hidden}, vocab 32000: P = "
                f"{big_p / 1e6:.1f}M params ({r0['replicated'] / 1e6:.3f}M replicated: the "
                f"norms), L = {loc / 1e6:.1f}M local elements on rank 0; tp {tp} x dp {dp}; "
                f"step {statistics.mean(x['ms'] for x in res):.0f} ms")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket_size_mb", type=float, default=32.0)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--world_size", type=int, default=1,
                    help="N > 1: N gloo processes on the CPU; reports bytes sent per step")
    ap.add_argument("--tp_size", type=int, default=1,
                    help="T > 1 (with --world_size N, a multiple of T): tensor parallel over T "
                         "ranks, data parallel over N/T; reports host bytes and the engine's "
                         "collectives per rank per step, per param of the whole model")
    args = ap.parse_args(argv)
    if args.tp_size < 1 or args.world_size % args.tp_size:
        ap.error(f"--tp_size {args.tp_size} must be >= 1 and divide --world_size "
                 f"{args.world_size}")
    if args.tp_size > 1:
        if args.hidden % 64:
            ap.error(f"--hidden {args.hidden}: a multiple of 64 (heads of 64)")
        print(f"Machine: {cpu_name()}, {args.threads} threads shared by {args.world_size} "
              f"ranks; torch {torch.__version__}, gloo\n")
        print("| per rank, per step | bytes | B per whole-model param | theory |\n"
              "|---|---|---|---|")
        print("\n".join(bench_tp(args)))
        return
    if args.world_size > 1:
        print(f"Machine: {cpu_name()}, {args.threads} threads shared by {args.world_size} "
              f"ranks; torch {torch.__version__}, gloo\n")
        print("| per rank, per step | MiB | B/param | theory B/param |\n|---|---|---|---|")
        print("\n".join(bench_world(args)))
        return
    print(f"Machine: {cpu_name()}, {args.threads} threads; torch {torch.__version__}\n")
    print("| what | params | ms | GB/s (28 B/param) | vs kernel |\n|---|---|---|---|---|")
    print("\n".join(bench_cpu(args)))

if __name__ == "__main__":
    main()
