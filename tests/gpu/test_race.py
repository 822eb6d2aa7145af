"""The CUDA engine against the CPU engine, bitwise, with the side stream delayed on purpose.

For fp16 / bf16 / fp32 x delayed update off / on x 1 and 3 micro-steps: the same initial
values (on CUDA for one engine, on the CPU for the other) and the same exact gradients
(tests/gpu/_common.py: ``loss = sum((p.float() * c).sum())``, an inf in one ``c`` for an
fp16 overflow step, params that get no gradient in some micro-steps). After every step the
params, and the fp32 master weights and both moments whenever no delayed update is in flight,
the skipped flag and the loss scale must be bitwise equal; at the end, after ``flush()``, the
whole host state and the ``state_dict()`` too. Clipping is off: the squared norm comes from
Triton on CUDA and torch on the CPU and may differ in the last bits (its relative difference
is a figure).

Every side-stream copy first waits `SLEEP_CYCLES` GPU cycles (``CudaCopier.side`` patched to
queue ``torch.cuda._sleep`` there), and the compute stream waits as long before each
backward: a missing wait (the host reading a landing buffer, overwriting a staging buffer, a
forward reading params, a copy reading a bucket the hooks are still writing) then reads or
writes too early, and the runs part.

The gpu tests: `test_race_stress` (scripts/gpu_check.sh's race stage) and
`test_race_under_the_cuda_sanitizer` (its race_sanitizer stage, under
``TORCH_CUDA_SANITIZER=1``: torch's CUDA stream sanitizer checks every op's stream ordering
and raises on a race; the stage also fails on its report). The other tests run the same logic
on the CPU, where the suite's AsyncCopier stands in for the side stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import time

import pytest
import torch

from hf_zoffload.offload.engine import ZeroOffloadOptimizer
from tests.gpu import _common as common
from tests.gpu._common import Config
from tests.offload._async_copier import AsyncCopier, installed

# 6 steps, not 8: the delayed update starts at step 2 and the fp16 overflow is at step 3, so
# every configuration still crosses both; each step is ~10 copies delayed ~1 ms.
STRESS_STEPS = 6


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


def run_config(cfg: Config, *, sleep_cycles: int, delays: dict, device: str = "cuda",
               around=None) -> dict:
    """One configuration: the engine on ``device`` against the engine on the CPU (``device``
    "cpu" in the CPU tests below, which check this logic, and ``around()`` is entered while
    the engine under test is built and trained: the suite's AsyncCopier, which emulates the
    side stream). The engine under test must copy asynchronously (`common.async_problems`)
    on CUDA and through the stand-in alike."""
    consts = common.constants(cfg)
    ref_params = common.make_params("cpu")
    ref_opt = common.make_engine(ref_params, cfg)
    ref = common.train(ref_opt, ref_params, consts, device="cpu")

    cuda = device == "cuda"
    with (around or contextlib.nullcontext)():
        params = common.make_params(device)
        opt = common.make_engine(params, cfg)
        bad = common.async_problems(opt, pinned=cuda) if cuda or around else []
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
    # here, not at the top: sanitizer_on() tells it is on by torch having imported it already
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


def stress(figures: list[str], cfgs: list[Config], *, sanitizer: bool) -> None:
    """Every configuration against the CPU engine with the side stream delayed; the table
    into ``figures``; fails on any difference."""
    torch.manual_seed(0)
    results = []
    with common.delayed_side(common.SLEEP_CYCLES) as delays:
        for cfg in cfgs:
            r = run_config(cfg, sleep_cycles=common.SLEEP_CYCLES, delays=delays)
            print(f"{cfg.name}: {'bitwise equal' if not r['bad'] else 'DIFFERS'} "
                  f"({r['seconds']:.1f} s)", flush=True)
            for line in r["bad"]:
                print(f"  {line}")
            if not r["delayed_copies"]:
                r["bad"].append("no side-stream copy went through CudaCopier.side(): the "
                                "delay was never applied")
            results.append(r)
    failed = [f"the CUDA engine differs from the CPU engine in {r['cfg'].name}: "
              f"{'; '.join(r['bad'][:3])}" for r in results if r["bad"]]
    common.finish(figures, report(results, sleep_cycles=common.SLEEP_CYCLES,
                                  sanitizer=sanitizer), failed)


@pytest.mark.gpu
def test_race_stress(figures):
    stress(figures, configs(short=False, steps=STRESS_STEPS), sanitizer=sanitizer_on())


@pytest.mark.gpu
def test_race_under_the_cuda_sanitizer(figures):
    """Three configurations of four steps under torch's CUDA stream sanitizer, which must be
    on and catch a planted race first (else its silence proves nothing)."""
    if not sanitizer_on():
        pytest.skip("torch's CUDA stream sanitizer is off: TORCH_CUDA_SANITIZER=1 must be set "
                    "before torch is imported (scripts/gpu_check.sh's race_sanitizer stage "
                    "sets it)")
    assert sanitizer_catches_planted_race(), \
        "the CUDA sanitizer did not report a planted race: its silence would prove nothing"
    print("the CUDA sanitizer is on and reported a planted race")
    stress(figures, configs(short=True), sanitizer=True)


# ------------------------------------------------------------------ the same on the CPU
def test_race_logic_on_the_cpu_is_bitwise_and_counts_what_it_should():
    """The stress's run on two CPU engines: equal, one fp16 overflow step skipped, the scale
    moved; the CUDA-only parts (pinning, delays) are not asked for."""
    results = {}
    for cfg in configs(short=True):
        r = run_config(cfg, sleep_cycles=0, delays={"entered": 0}, device="cpu")
        assert r["bad"] == [], (cfg, r["bad"])
        results[cfg.dtype] = r
    assert results["fp16"]["skipped"] == 1 and results["bf16"]["skipped"] == 0
    assert results["fp16"]["scales"] == [1024.0, 512.0, 512.0, 1024.0]  # backed off, grew
    assert results["fp16"]["buckets"] == 5
    lines = report(list(results.values()), sleep_cycles=0, sanitizer=False)
    assert lines[0].startswith("| config |") and "3/3 configurations bitwise equal" in lines[-1]
    assert len(configs(short=False)) == 12


@pytest.mark.parametrize("delayed", [False, True])
def test_race_stress_fails_without_the_per_module_waits(monkeypatch, delayed):
    """The stress's model= configuration through the suite's AsyncCopier (the side stream
    emulated on a thread, random delays, chunked copies): bitwise the CPU engine, each
    forward's reads included; with every module's wait removed, a forward reads params
    still on their way and the comparison says so. So the stress is not blind to it (it
    once was: its snapshot made the device wait for every upload after each step)."""
    cfg = common.Config("bf16", delayed, 1, 4, module_waits=True)
    counter = iter(range(100))

    def run():
        return run_config(cfg, sleep_cycles=0, delays={"entered": 0}, device="cpu",
                                   around=lambda: installed(next(counter) + 11))

    ok = run()
    assert ok["bad"] == [], ok["bad"]
    monkeypatch.setattr(AsyncCopier, "wait_ready", lambda self, keys: None)
    bad = run()["bad"]
    assert any("forward read" in m for m in bad), bad


def test_race_comparison_sees_a_one_bit_difference():
    cfg = common.Config("bf16", True, 3, 4)
    traces = []
    for _ in range(2):
        params = common.make_params("cpu")
        opt = common.make_engine(params, cfg)
        traces.append(common.train(opt, params, common.constants(cfg), device="cpu"))
    assert common.compare(*traces) == []
    assert [s["skipped"] for s in traces[0][:-1]] == [False] * 4
    assert "host" not in traces[0][2] and "host" in traces[0][-1]  # delayed update in flight
    bits = common.bits(traces[1][1]["params"][3])
    bits.view(-1)[5] ^= 1  # the lowest mantissa bit of one bf16 element
    master = traces[1][-1]["host"][0]["exp_avg_sq"]
    master.view(-1)[0] = -master.view(-1)[0] if master.view(-1)[0] != 0 else -0.0
    traces[1][0]["scale"] = 2.0
    bad = common.compare(*traces)
    assert any(m.startswith("step 1: param 3 (101, 199): 1 of 20099") for m in bad), bad
    assert any(m.startswith("after flush(): exp_avg_sq of param 0") for m in bad), bad
    assert "step 0: scale 1.0 vs 2.0" in bad


def test_gradients_are_exact_in_every_compute_dtype():
    """loss_of's gradient is scale * c exactly: c is exact in the compute dtype and the
    scale a power of two, so no device or kernel can round it differently."""
    for dtype in ("fp16", "bf16", "fp32"):
        cfg = common.Config(dtype, False, 1, 1)
        params = [torch.nn.Parameter(p.detach().to(common.DTYPES[dtype]))
                  for p in common.make_params("cpu")]
        cs = common.constants(cfg)[0][0]
        (common.loss_of(params, cs, 1, 0) * 1024.0).backward()
        for i, (p, c) in enumerate(zip(params, cs)):
            if common.skips(1, 0, i):
                assert p.grad is None
            else:
                assert torch.equal(p.grad.float(), c * 1024.0), (dtype, i)


def test_delayed_side_wraps_and_restores_the_copier_side(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def fake_side(self):
        entered.append(self)
        yield

    monkeypatch.setattr(common.CudaCopier, "side", fake_side)
    with common.delayed_side(0) as count:
        with common.CudaCopier.side("copier"):
            pass
        assert count["entered"] == 1 and entered == ["copier"]
    assert common.CudaCopier.side is fake_side


def test_async_problems_asks_the_engines_own_copier_stack():
    """`async_problems` (the stress's and the Trainer gpu test's precondition) over the
    stack the engine builds: the stand-in's asynchronous copies pass it, the CPU's
    synchronous ones do not, nor an engine whose every bucket stays on the device (nothing
    is copied). So a change to the stack's wrappers that hides the streams breaks here."""
    params = common.make_params("cpu")
    cfg = common.Config("bf16", False, 1, 1)
    with installed(3):
        opt = common.make_engine(params, cfg)
        assert common.async_problems(opt, pinned=False) == []
        assert common.async_problems(opt) == [
            "host buffers are not pinned (pinning failed?): copies are synchronous and the "
            "race check proves nothing"]
    opt = common.make_engine(common.make_params("cpu"), cfg)
    assert any("copies are synchronous (HostCopier" in m
               for m in common.async_problems(opt, pinned=False))
    with installed(4):
        opt = ZeroOffloadOptimizer(common.make_params("cpu"), plugin=dataclasses.replace(
            common.plugin(cfg), offload_fraction="0"))
        assert common.async_problems(opt, pinned=False) == [
            "no bucket's state is on the host: nothing is copied"]


def test_late_reads_queue_behind_the_uploads_through_the_engines_stack():
    """`LateReads` through the engine's copier stack over the stand-in: a read is a job on
    the emulated side stream (the host does not wait for it, nor for the uploads before
    it), and once settled it holds the params the last step uploaded."""
    cfg = common.Config("bf16", False, 1, 2)
    with installed(5) as made:
        params = common.make_params("cpu")
        opt = common.make_engine(params, cfg)
        common.train(opt, params, common.constants(cfg), device="cpu")
        reader, c = common.LateReads(opt), made[0]
        with c.hold():  # the worker starts nothing: the read must still be queued
            out = reader.read(params)
            assert c.counts["jobs_read"] == 1 and c._done < c._queued
        reader.settle()
        c.synchronize()
        assert all(torch.equal(o, p.detach()) for o, p in zip(out, params))
