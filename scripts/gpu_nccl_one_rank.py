#!/usr/bin/env python
"""A one-rank NCCL process group against the plain engine on CUDA, bitwise.

An explicit ``process_group=`` runs the data-parallel code even with one rank
(hf_zoffload/offload/partitioned.py: reduce-scatter, the one all-reduce of the step's flags,
all-gather, the unreduced micro-steps summed on the host and uploaded back, NCCL's
stream-ordered waits). With one rank it must change nothing: for fp16 / bf16 / fp32 x delayed
update off / on, 3 micro-steps per step with ``no_sync()`` on some (the first two on even
steps, the first on odd ones), an fp16 overflow inside a ``no_sync`` micro-step, params with
no gradient in some micro-steps, every step's params and host state, the gathered
``state_dict()``, and two more steps after loading it into fresh engines must be bitwise those
of the plain engine. The side stream is delayed before every copy, as in gpu_race.py.
(tests/offload/test_partition.py has the same check for one bf16 configuration of a model.)

``--backend gloo --device cpu`` runs the same on the CPU (the test suite does).
Needs CUDA otherwise; exits 1 on any difference. Prints ``summary:`` lines.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import time

import _gpu_common as common
import torch
import torch.distributed as dist
from _gpu_common import Config

from hf_zoffload.offload.exchange import LocalExchange
from hf_zoffload.offload.partitioned import PartitionedExchange

SCRIPT = "gpu_nccl_one_rank.py"


def configs(steps: int = 6) -> list[Config]:
    out = [Config(dtype, delayed, 3, steps, overflow_at=2 if dtype == "fp16" else None)
           for dtype in ("fp16", "bf16", "fp32") for delayed in (False, True)]
    return out + [Config("bf16", False, 1, steps)]


def no_sync(step: int, micro: int, accum: int) -> bool:
    """Micro-steps that do not reduce: all but the last on even steps, the first on odd ones
    (so an odd step has two synchronizing backwards in one window)."""
    return micro < accum - 1 if step % 2 == 0 else micro == 0 and accum > 1


@contextlib.contextmanager
def one_rank_group(backend: str):
    """A one-rank process group over an in-process store (no port, no file)."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def run_config(cfg: Config, group, *, device: str, sleep_cycles: int) -> dict:
    consts = common.constants(cfg)
    more = common.constants(cfg, seed=2, steps=2)  # after the state_dict round trip

    def sync(step: int, micro: int) -> bool:
        return no_sync(step, micro, cfg.accum)

    sleep = sleep_cycles if device == "cuda" else 0
    traces, opts, finals = [], [], []
    t0 = time.perf_counter()
    for pg in (None, group):
        params = common.make_params(device)
        opt = common.make_engine(params, cfg, process_group=pg)
        traces.append(common.train(opt, params, consts, device=device, no_sync=sync,
                                   compute_sleep=sleep))
        opts.append(opt)
        finals.append(params)
    bad = []
    kinds = (type(opts[0].exchange), type(opts[1].exchange))
    if kinds != (LocalExchange, PartitionedExchange):
        bad.append(f"exchanges {kinds[0].__name__}, {kinds[1].__name__}: expected "
                   f"LocalExchange, PartitionedExchange")
    if not opts[1].exchange.sent["reduce_scatter"]:
        bad.append("the partitioned engine reduce-scattered nothing")
    bad += common.compare(traces[0], traces[1])
    sds = [opt.state_dict() for opt in opts]  # the partitioned one gathers (a collective)
    bad += [f"state_dict: {m}" for m in common.same_state_dicts(sds[0], sds[1])]
    # Resume both kinds of engine from the partitioned run's checkpoint: 2 more steps.
    resumed = []
    for pg in (None, group):
        params = [torch.nn.Parameter(p.detach().float().clone()) for p in finals[1]]
        opt = common.make_engine(params, cfg, process_group=pg)
        opt.load_state_dict(sds[1])
        resumed.append(common.train(opt, params, more, device=device, no_sync=sync,
                                    compute_sleep=sleep, first_step=cfg.steps))
    bad += [f"after load_state_dict: {m}" for m in common.compare(*resumed)]
    if device == "cuda":
        torch.cuda.synchronize()
    return {"cfg": cfg, "bad": bad, "skipped": sum(s["skipped"] for s in traces[1][:-1]),
            "sent": dict(opts[1].exchange.sent), "seconds": time.perf_counter() - t0,
            "norm": common.norm_rel_diff(traces[0], traces[1])}


def report(results: list[dict], *, backend: str) -> list[str]:
    rows = [[r["cfg"].name, r["cfg"].steps, r["skipped"],
             common.human_bytes(r["sent"]["reduce_scatter"]),
             common.human_bytes(r["sent"]["all_gather"]), f"{r['norm']:.1e}",
             f"{r['seconds']:.1f}",
             "bitwise equal" if not r["bad"] else f"**{len(r['bad'])} differences**"]
            for r in results]
    lines = common.md_table(["config", "steps", "skipped", "reduce-scatter in",
                             "all-gather in", "norm rel. diff", "s", "vs plain engine"], rows)
    equal = sum(not r["bad"] for r in results)
    lines += ["", f"{equal}/{len(results)} configurations of a one-rank {backend} group "
                  f"bitwise equal to the plain engine (each step, the gathered state_dict, "
                  f"2 steps after loading it)"]
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", default=None,
                   help="run only the configurations whose name contains this, e.g. fp16")
    p.add_argument("--sleep_cycles", type=int, default=common.SLEEP_CYCLES,
                   help="GPU cycles the side stream waits before each copy (CUDA)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        common.require_cuda(SCRIPT)
    if (args.backend == "nccl") != (args.device == "cuda"):
        print(f"{SCRIPT}: nccl goes with --device cuda, gloo with --device cpu",
              file=sys.stderr)
        return 2
    chosen = [c for c in configs(args.steps) if args.only is None or args.only in c.name]
    results = []
    with one_rank_group(args.backend) as group, common.delayed_side(args.sleep_cycles):
        for cfg in chosen:
            r = run_config(cfg, group, device=args.device, sleep_cycles=args.sleep_cycles)
            print(f"{cfg.name}: {'bitwise equal' if not r['bad'] else 'DIFFERS'} "
                  f"({r['seconds']:.1f} s)", flush=True)
            for line in r["bad"]:
                print(f"  {line}")
            results.append(r)
    for line in report(results, backend=args.backend):
        common.summary(line)
    failed = [r["cfg"].name for r in results if r["bad"]]
    if failed or not results:
        print(f"{SCRIPT}: FAIL: {'; '.join(failed) or 'no configuration ran'}",
              file=sys.stderr)
        return 1
    print(f"{SCRIPT}: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
