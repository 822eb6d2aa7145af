"""A one-rank NCCL process group against the plain engine on CUDA, bitwise.

An explicit ``process_group=`` runs the data-parallel code even with one rank
(hf_zoffload/offload/modes/partitioned.py: reduce-scatter, the one all-reduce of the step's flags,
all-gather, the unreduced micro-steps summed on the host and uploaded back, NCCL's
stream-ordered waits). With one rank it must change nothing: for fp16 / bf16 / fp32 x delayed
update off / on, 3 micro-steps per step with ``no_sync()`` on some (the first two on even
steps, the first on odd ones), an fp16 overflow inside a ``no_sync`` micro-step, params with
no gradient in some micro-steps, every step's params and host state, the gathered
``state_dict()``, and two more steps after loading it into fresh engines must be bitwise those
of the plain engine. The side stream is delayed before every copy, as in test_race.py.
(tests/offload/test_partition.py has the same check for one bf16 configuration of a model.)

`test_one_rank_nccl_group` is the gpu test (scripts/gpu_check.sh's nccl_one_rank stage);
`test_one_rank_gloo_group_on_the_cpu` runs the same check with gloo on the CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import pytest
import torch
import torch.distributed as dist

from hf_zoffload.offload.memory import human
from hf_zoffload.offload.modes.exchange import LocalExchange
from hf_zoffload.offload.modes.partitioned import PartitionedExchange
from tests.gpu import _common as common
from tests.gpu._common import Config

# 4 steps, not 6: the overflow is at step 2 and steps 2-3 are delayed; 2 more after loading.
STEPS = 4


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
             human(r["sent"]["reduce_scatter"]),
             human(r["sent"]["all_gather"]), f"{r['norm']:.1e}",
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


def check(figures: list[str], *, backend: str, device: str, cfgs: list[Config] | None = None
          ) -> None:
    """Every configuration (`configs` of `STEPS`) on a one-rank ``backend`` group; the table
    into ``figures``; fails on any difference."""
    results = []
    with one_rank_group(backend) as group, common.delayed_side(common.SLEEP_CYCLES):
        for cfg in configs(STEPS) if cfgs is None else cfgs:
            r = run_config(cfg, group, device=device, sleep_cycles=common.SLEEP_CYCLES)
            print(f"{cfg.name}: {'bitwise equal' if not r['bad'] else 'DIFFERS'} "
                  f"({r['seconds']:.1f} s)", flush=True)
            for line in r["bad"]:
                print(f"  {line}")
            results.append(r)
    failed = [f"{r['cfg'].name}: {'; '.join(r['bad'][:3])}" for r in results if r["bad"]]
    common.finish(figures, report(results, backend=backend), failed)


@pytest.mark.gpu
def test_one_rank_nccl_group(figures):
    check(figures, backend="nccl", device="cuda")


# ------------------------------------------------------------------ the same on the CPU
def test_one_rank_gloo_group_on_the_cpu():
    figures = []
    check(figures, backend="gloo", device="cpu")
    assert "7/7 configurations of a one-rank gloo group bitwise equal" in figures[-1]
    assert sum(line.startswith("| ") for line in figures) == 9  # header, separator, 7 rows


def test_a_difference_fails_the_check(monkeypatch):
    """One configuration whose partitioned run differs: its row says so, the check fails
    naming it, and the failure is a figure too."""
    real = common.compare

    def compare(ref, got, **kw):
        return real(ref, got, **kw) or ["step 0: param 3 differs"]

    monkeypatch.setattr(common, "compare", compare)
    figures = []
    with pytest.raises(pytest.fail.Exception, match="bf16, delayed off, accum 1: step 0"):
        check(figures, backend="gloo", device="cpu", cfgs=[Config("bf16", False, 1, 1)])
    assert "0/1 configurations" in figures[-2] and figures[-1].startswith("**bf16, delayed")


def test_no_sync_pattern_has_all_three_boundary_styles():
    even = [no_sync(0, m, 3) for m in range(3)]
    odd = [no_sync(1, m, 3) for m in range(3)]
    assert even == [True, True, False] and odd == [True, False, False]
    assert [no_sync(s, 0, 1) for s in range(2)] == [False, False]
