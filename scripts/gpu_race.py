#!/usr/bin/env python
"""The CUDA engine against the CPU engine, bitwise, with the side stream delayed on purpose.

For fp16 / bf16 / fp32 x delayed update off / on x 1 and 3 micro-steps: the same initial
values (on CUDA for one engine, on the CPU for the other) and the same exact gradients
(scripts/_gpu_common.py: ``loss = sum((p.float() * c).sum())``, an inf in one ``c`` for an
fp16 overflow step, params that get no gradient in some micro-steps). After every step the
params, and the fp32 master weights and both moments whenever no delayed update is in flight,
the skipped flag and the loss scale must be bitwise equal; at the end, after ``flush()``, the
whole host state and the ``state_dict()`` too. Clipping is off: the squared norm comes from
Triton on CUDA and torch on the CPU and may differ in the last bits (its relative difference
is printed).

Every side-stream copy first waits ``--sleep_cycles`` GPU cycles (``CudaCopier.side``
patched to queue ``torch.cuda._sleep`` there), and the compute stream waits as long before
each backward: a missing wait (the host reading a landing buffer, overwriting a staging
buffer, a forward reading params, a copy reading a bucket the hooks are still writing) then
reads or writes too early, and the runs part.

``--short``: three configurations, four steps: for ``TORCH_CUDA_SANITIZER=1`` (torch's CUDA
stream sanitizer, which checks every op's stream ordering and raises on a race; gpu_check.sh
also fails the stage on its report). ``--expect_sanitizer`` checks first that the sanitizer
is on and catches a planted race.

Needs CUDA; exits 1 on any difference. Prints ``summary:`` lines (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

import _gpu_common as common
import torch
from _gpu_common import Config

SCRIPT = "gpu_race.py"


def configs(short: bool, steps: int | None = None) -> list[Config]:
    if short:
        n = steps or 4
        return [Config("fp16", False, 3, n, overflow_at=1),
                Config("bf16", True, 3, n, module_waits=True), Config("fp32", True, 1, n)]
    n = steps or 8
    # half of them with per-module forward waits (model=), each delayed-update mode both ways
    return [Config(dtype, delayed, accum, n, overflow_at=3 if dtype == "fp16" else None,
                   module_waits=accum == 3)
            for dtype in ("fp16", "bf16", "fp32") for delayed in (False, True)
            for accum in (1, 3)]


def async_problems(opt) -> list[str]:
    """The CUDA engine must copy asynchronously (pinned buffers on a side stream), else
    nothing here can race and equality proves little."""
    if not isinstance(opt.copier, common.CudaCopier):
        return [f"the engine on CUDA uses {type(opt.copier).__name__}, not CudaCopier"]
    if not opt.copier.pinned or not all(b.state.grads.grad16.is_pinned() for b in opt.buckets):
        return ["host buffers are not pinned (pinning failed?): copies are synchronous and "
                "the race check proves nothing"]
    return []


def run_config(cfg: Config, *, sleep_cycles: int, delays: dict, device: str = "cuda",
               around=contextlib.nullcontext) -> dict:
    """One configuration: the engine on ``device`` against the engine on the CPU (``device``
    "cpu" only in the test suite, where it checks this script's own logic, and ``around()``
    is entered while the engine under test is built and trained: the suite's AsyncCopier,
    which emulates the side stream)."""
    consts = common.constants(cfg)
    ref_params = common.make_params("cpu")
    ref_opt = common.make_engine(ref_params, cfg)
    ref = common.train(ref_opt, ref_params, consts, device="cpu")

    cuda = device == "cuda"
    with around():
        params = common.make_params(device)
        opt = common.make_engine(params, cfg)
        bad = async_problems(opt) if cuda else []
        before, t0 = delays["entered"], time.perf_counter()
        got = common.train(opt, params, consts, device=device,
                           compute_sleep=sleep_cycles if cuda else 0)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        bad += common.compare(ref, got)
        bad += [f"state_dict: {m}" for m in common.same_state_dicts(ref_opt.state_dict(),
                                                                     opt.state_dict())]
    return {"cfg": cfg, "bad": bad, "skipped": sum(s["skipped"] for s in got[:-1]),
            "scale": got[-1]["scale"], "scales": [s["scale"] for s in got[:-1]],
            "delayed_copies": delays["entered"] - before,
            "norm": common.norm_rel_diff(ref, got), "seconds": seconds,
            "buckets": len(opt.buckets)}


def sanitizer_on() -> bool:
    """Whether torch's CUDA stream sanitizer (TORCH_CUDA_SANITIZER) is active here."""
    if "torch.cuda._sanitizer" not in sys.modules:  # importing it would turn tracing on
        return False
    return bool(getattr(sys.modules["torch.cuda._sanitizer"].cuda_sanitizer, "enabled", False))


def sanitizer_catches_planted_race() -> bool:
    """The example of torch's own docs: a tensor written on the default stream, then on a
    new stream with no wait. Its report is swallowed here, so that any report in the log
    is a real one."""
    from torch.cuda._sanitizer import CUDASanitizerErrors

    a = torch.rand(1 << 16, device="cuda")
    caught = False
    with contextlib.redirect_stderr(io.StringIO()), torch.cuda.stream(torch.cuda.Stream()):
        try:
            torch.mul(a, 5, out=a)
        except CUDASanitizerErrors:
            caught = True
    torch.cuda.synchronize()
    return caught


def report(results: list[dict], *, sleep_cycles: int, sanitizer: bool) -> list[str]:
    rows = [[r["cfg"].name, r["cfg"].steps, r["buckets"], r["skipped"], f"{r['scale']:g}",
             r["delayed_copies"], f"{r['norm']:.1e}", f"{r['seconds']:.1f}",
             "bitwise equal" if not r["bad"] else f"**{len(r['bad'])} differences**"]
            for r in results]
    lines = common.md_table(["config", "steps", "buckets", "skipped", "final scale",
                             "copies delayed", "norm rel. diff", "s", "vs CPU engine"], rows)
    equal = sum(not r["bad"] for r in results)
    lines.append("")
    lines.append(f"{equal}/{len(results)} configurations bitwise equal to the CPU engine "
                 f"(params, master, exp_avg, exp_avg_sq, skipped, loss scale each step; "
                 f"state_dict at the end); side stream delayed {sleep_cycles:,} cycles before "
                 f"each copy and the compute stream before each backward; CUDA stream "
                 f"sanitizer {'on' if sanitizer else 'off'}")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true",
                   help="three configurations of four steps (for TORCH_CUDA_SANITIZER=1)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per configuration (default 8, or 4 with --short)")
    p.add_argument("--sleep_cycles", type=int, default=common.SLEEP_CYCLES,
                   help="GPU cycles the side stream waits before each copy, and the compute "
                        "stream before each backward (0: no delay)")
    p.add_argument("--expect_sanitizer", action="store_true",
                   help="fail unless TORCH_CUDA_SANITIZER is on and catches a planted race")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.require_cuda(SCRIPT)
    sanitizer = sanitizer_on()
    if args.expect_sanitizer:
        if not sanitizer:
            print(f"{SCRIPT}: --expect_sanitizer, but torch's CUDA sanitizer is off "
                  f"(TORCH_CUDA_SANITIZER={os.environ.get('TORCH_CUDA_SANITIZER')!r} must be "
                  f"set before torch is imported)", file=sys.stderr)
            return 1
        if not sanitizer_catches_planted_race():
            print(f"{SCRIPT}: the CUDA sanitizer did not report a planted race: its silence "
                  f"below would prove nothing", file=sys.stderr)
            return 1
        print("the CUDA sanitizer is on and reported a planted race")
    torch.manual_seed(0)
    results = []
    with common.delayed_side(args.sleep_cycles) as delays:
        for cfg in configs(args.short, args.steps):
            r = run_config(cfg, sleep_cycles=args.sleep_cycles, delays=delays)
            print(f"{cfg.name}: {'bitwise equal' if not r['bad'] else 'DIFFERS'} "
                  f"({r['seconds']:.1f} s)", flush=True)
            for line in r["bad"]:
                print(f"  {line}")
            if not r["delayed_copies"]:
                r["bad"].append("no side-stream copy went through CudaCopier.side(): the "
                                "delay was never applied")
            results.append(r)
    for line in report(results, sleep_cycles=args.sleep_cycles, sanitizer=sanitizer):
        common.summary(line)
    failed = [r["cfg"].name for r in results if r["bad"]]
    if failed:
        print(f"{SCRIPT}: FAIL: the CUDA engine differs from the CPU engine in: "
              f"{'; '.join(failed)}", file=sys.stderr)
        return 1
    print(f"{SCRIPT}: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
