"""The GPU check scripts (scripts/gpu_*.py) and what scripts/gpu_check.sh does with them,
checked where there is no GPU: each script refuses to run without CUDA, saying so; the logic
that does not need a device (comparisons, verdicts, the data stand-ins, the one-rank group
on gloo, the CPU side of the race check) runs on the CPU. (gpu_check.sh's stage machinery:
tests/test_gpu_check_script.py.)

CUDA_VISIBLE_DEVICES="" hides any GPU from the subprocesses, so this holds on a GPU machine too.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import _gpu_common as common  # noqa: E402
import gpu_clm_compare  # noqa: E402
import gpu_host_memory  # noqa: E402
import gpu_nccl_one_rank  # noqa: E402
import gpu_peers  # noqa: E402
import gpu_practicality  # noqa: E402
import gpu_race  # noqa: E402
import gpu_size  # noqa: E402

from tests._env import cpu_only_env  # noqa: E402

GPU_SCRIPTS = ["gpu_race.py", "gpu_nccl_one_rank.py", "gpu_host_memory.py",
               "gpu_clm_compare.py", "gpu_size.py", "gpu_practicality.py", "gpu_peers.py"]


# ------------------------------------------------------------------ without CUDA
@pytest.mark.slow
def test_a_gpu_script_run_without_cuda_exits_1_saying_so(tmp_path):
    """From the command line, as gpu_check.sh runs it (one script: each costs ~6 s of imports
    on 2 cores; the in-process test below covers every script's main())."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_race.py"), "--short"],
                          cwd=tmp_path, env=cpu_only_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "gpu_race.py: CUDA is needed: torch " in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_each_gpu_script_runs_main_as_a_script(name):
    text = (SCRIPTS / name).read_text()
    assert text.startswith("#!/usr/bin/env python\n")
    assert text.rstrip().endswith('if __name__ == "__main__":\n    sys.exit(main())')


@pytest.mark.parametrize("module", [gpu_race, gpu_nccl_one_rank, gpu_host_memory,
                                    gpu_clm_compare, gpu_size, gpu_practicality,
                                    gpu_peers])
def test_help_and_in_process_refusal(module, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        module.parse_args(["--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA is needed"):
        module.main([])


# ------------------------------------------------------------------ race (CPU side)
def test_race_logic_on_the_cpu_is_bitwise_and_counts_what_it_should():
    """gpu_race's run on two CPU engines: equal, one fp16 overflow step skipped, the scale
    moved; the CUDA-only parts (pinning, delays) are not asked for."""
    results = {}
    for cfg in gpu_race.configs(short=True):
        r = gpu_race.run_config(cfg, sleep_cycles=0, delays={"entered": 0}, device="cpu")
        assert r["bad"] == [], (cfg, r["bad"])
        results[cfg.dtype] = r
    assert results["fp16"]["skipped"] == 1 and results["bf16"]["skipped"] == 0
    assert results["fp16"]["scales"] == [1024.0, 512.0, 512.0, 1024.0]  # backed off, grew
    assert results["fp16"]["buckets"] == 5
    lines = gpu_race.report(list(results.values()), sleep_cycles=0, sanitizer=False)
    assert lines[0].startswith("| config |") and "3/3 configurations bitwise equal" in lines[-1]
    assert len(gpu_race.configs(short=False)) == 12


@pytest.mark.parametrize("delayed", [False, True])
def test_race_stress_fails_without_the_per_module_waits(monkeypatch, delayed):
    """The stress's model= configuration through the suite's AsyncCopier (the side stream
    emulated on a thread, random delays, chunked copies): bitwise the CPU engine, each
    forward's reads included; with every module's wait removed, a forward reads params
    still on their way and the comparison says so. So the stress is not blind to it (it
    once was: its snapshot made the device wait for every upload after each step)."""
    from tests.offload._async_copier import AsyncCopier, installed

    cfg = common.Config("bf16", delayed, 1, 4, module_waits=True)
    counter = iter(range(100))

    def run():
        return gpu_race.run_config(cfg, sleep_cycles=0, delays={"entered": 0}, device="cpu",
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


# ------------------------------------------------------------- one-rank group (gloo)
def test_one_rank_gloo_group_is_bitwise_the_plain_engine(capsys):
    assert gpu_nccl_one_rank.main(["--backend", "gloo", "--device", "cpu", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "7/7 configurations of a one-rank gloo group bitwise equal" in out
    assert out.count("summary: | ") == 9  # header, separator, 7 rows
    assert gpu_nccl_one_rank.main(["--backend", "nccl", "--device", "cpu"]) == 2


def test_no_sync_pattern_has_all_three_boundary_styles():
    even = [gpu_nccl_one_rank.no_sync(0, m, 3) for m in range(3)]
    odd = [gpu_nccl_one_rank.no_sync(1, m, 3) for m in range(3)]
    assert even == [True, True, False] and odd == [True, False, False]
    assert [gpu_nccl_one_rank.no_sync(s, 0, 1) for s in range(2)] == [False, False]


# ------------------------------------------------------------------ host memory
def _report(staging=9_000_000):
    host = {"master": 1, "exp_avg": 1, "exp_avg_sq": 1, "grad_staging": staging,
            "grad_accumulation": 0}
    return {"host": host, "host_total": sum(host.values())}


def _facts(pinned=9_000_000, blocks=3):
    return {"pinned": pinned, "allocations": pinned, "blocks": blocks,
            "rounded": blocks * 4 * 2**20, "staging_unpinned": 0 if pinned else blocks}


def test_host_memory_verdict():
    held = {"allocated_bytes.current": 3 * 4 * 2**20, "active_bytes.current": 3 * 4 * 2**20}
    lines, failures = gpu_host_memory.verdict(_report(), held, _facts(), engine_pins=True)
    assert failures == []
    text = "\n".join(lines)
    assert "| torch pinned allocator holds (`allocated_bytes` / `reserved_bytes`, the larger) " \
           "| 12.00 MiB |" in text
    assert "allocator / pinned buffers: 1.40; allocator / report staging: 1.40" in text
    assert "powers of two: 1.00" in text
    # the engine's pinned allocations exceed what the allocator holds: inconsistent
    _, failures = gpu_host_memory.verdict(_report(), {"allocated_bytes.current": 8_000_000},
                                          _facts(), engine_pins=True)
    assert len(failures) == 2 and "more than the 7.63 MiB" in failures[0]
    # pageable staging while the engine claims to pin: the report's staging exceeds the pool
    _, failures = gpu_host_memory.verdict(_report(), {"allocated_bytes.current": 0},
                                          _facts(0, 0), engine_pins=True)
    assert failures and "memory_report() counts 8.58 MiB of host staging" in failures[0]
    _, failures = gpu_host_memory.verdict(_report(), {"allocated_bytes.current": 0},
                                          _facts(0, 0), engine_pins=False)
    assert failures == []
    _, failures = gpu_host_memory.verdict(_report(), {"num_host_alloc": 1}, _facts(),
                                          engine_pins=True)
    assert failures and "has neither of ('allocated_bytes.current'" in failures[0]
    # the older naming: reserved = held, allocated = handed out
    older = {"allocated_bytes.current": 9_000_000, "reserved_bytes.current": 3 * 4 * 2**20}
    assert gpu_host_memory.held_bytes(older) == 3 * 4 * 2**20
    assert gpu_host_memory.verdict(_report(), older, _facts(), engine_pins=True)[1] == []


def test_host_buffers_of_a_cpu_engine():
    cfg = common.Config("fp16", True, 2, 3)
    params = common.make_params("cpu")
    opt = common.make_engine(params, cfg)
    common.train(opt, params, common.constants(cfg), device="cpu")
    buffers = gpu_host_memory.host_buffers(opt)
    kinds = {k for k, _ in buffers}
    assert {"master", "exp_avg", "exp_avg_sq", "grad_staging", "grad_accumulation"} <= kinds
    n = sum(math.prod(shape) for shape in common.SHAPES)
    sizes = {kind: sum(t.numel() * t.element_size() for k, t in buffers if k == kind)
             for kind in kinds}
    assert sizes["master"] == sizes["exp_avg"] == 4 * n
    assert sizes["grad_staging"] == 2 * 2 * n  # two sets; no param staging buffer (issue 12)
    facts = gpu_host_memory.pinned_facts(buffers)
    assert facts["pinned"] == facts["allocations"] == 0 and facts["staging_unpinned"] > 0
    report = opt.memory_report()["host"]
    for kind in ("master", "exp_avg", "exp_avg_sq", "grad_accumulation"):
        assert report[kind] == sizes[kind], kind
    # the buffers, or the blocks they are cut from
    assert sizes["grad_staging"] <= report["grad_staging"] <= 1.02 * sizes["grad_staging"]
    assert [gpu_host_memory.next_pow2(n) for n in (1, 2, 3, 6_002_000)] == [1, 2, 4, 2**23]


# ---------------------------------------------------------------------- run_clm
def _run(losses, peak=None, datasets=False):
    return {"losses": losses, "train_loss": sum(x for _, x in losses) / len(losses),
            "n_params": 98_700_000, "peak_bytes": peak, "seconds": 12.0, "datasets": datasets}


def test_clm_final_losses_within_one_percent():
    stock = _run([[10, 7.5], [50, 5.0]], peak=2 * 2**30)
    ok = _run([[10, 7.4], [50, 5.049]], peak=2**29)
    lines, failures = gpu_clm_compare.compare_runs(stock, ok, max_rel=0.01)
    assert failures == []
    text = "\n".join(lines)
    assert "| stock Trainer --bf16 | 98.7M | 7.5000 | 5.0000 (step 50) |" in text
    assert "2.00 GiB" in text and "512.00 MiB" in text
    assert "differ by 0.98% (limit 1%); peak device memory: zero_offload 0.25x" in text
    assert "the list-based stand-in" in text
    _, failures = gpu_clm_compare.compare_runs(stock, _run([[10, 7.4], [50, 5.051]]),
                                               max_rel=0.01)
    assert failures == ["final losses 5.0000 (stock) and 5.0510 (zero_offload) differ by "
                        "1.02%, more than 1%"]
    _, failures = gpu_clm_compare.compare_runs(stock, _run([[10, 5.0], [50, 5.0]]),
                                               max_rel=0.01)
    assert failures and "the loss did not fall" in failures[0]
    _, failures = gpu_clm_compare.compare_runs(stock, _run([[50, 5.0]]), max_rel=0.01)
    assert failures and "fewer than 2 logged losses" in failures[0]
    _, failures = gpu_clm_compare.compare_runs(stock, _run([[10, 7.4], [40, 5.0]]),
                                               max_rel=0.01)
    assert failures and "last loss at steps 50 and 40" in failures[0]


def test_run_clm_args_differ_only_by_zero_offload():
    kw = dict(steps=50, overrides=gpu_clm_compare.LLAMA_100M, block_size=256, batch=8,
              lr=6e-4, seed=42, logging_steps=10)
    stock = gpu_clm_compare.run_clm_args("out", offload=False, **kw)
    ours = gpu_clm_compare.run_clm_args("out", offload=True, **kw)
    assert ours == stock + ["--zero_offload"] and "--bf16" in stock
    args = gpu_clm_compare.parse_args(["--child", "r.json", "--", *ours])
    assert args.child == "r.json" and args.run_clm_args[1:] == ours


# Each stand-in run marks that it started, waits (up to argv[3] s) for the other's mark, then
# writes its result: both succeed only when they run at the same time.
_MEETING_RUN = """
import json, os, sys, time
res, other = sys.argv[1], sys.argv[2]
open(res + ".started", "w").close()
t_end = time.monotonic() + float(sys.argv[3])
while not os.path.exists(other + ".started"):
    if time.monotonic() > t_end:
        sys.exit(7)
    time.sleep(0.05)
print("run output of", os.path.basename(res))
json.dump({"losses": [[1, 2.0], [2, 1.0]]}, open(res, "w"))
"""


@pytest.mark.parametrize("parallel", [True, False])
def test_run_pair_parallel_runs_both_at_once(tmp_path, monkeypatch, capsys, parallel):
    def command(name, result, *, use_datasets, **kwargs):
        other = "zero_offload" if name == "stock" else "stock"
        return [sys.executable, "-c", _MEETING_RUN, result,
                os.path.join(os.path.dirname(result), f"{other}.json"),
                "30" if parallel else "1"]

    monkeypatch.setattr(gpu_clm_compare, "child_command", command)
    results, failures = gpu_clm_compare.run_pair(str(tmp_path), use_datasets=False,
                                                 timeout=60, parallel=parallel)
    if parallel:
        assert failures == [] and sorted(results) == ["stock", "zero_offload"]
        out = capsys.readouterr().out  # each run's output, after both ended, under its name
        assert "== stock's output\nrun output of stock.json" in out
        assert "== zero_offload's output\nrun output of zero_offload.json" in out
    else:  # one after the other: the first waits in vain for a run not started yet
        assert failures == ["stock: run_clm exited 7"] and list(results) == ["zero_offload"]


def test_child_command_runs_this_script_with_the_run_clm_args(tmp_path):
    kw = dict(steps=5, overrides="x=1", block_size=16, batch=2, lr=1e-3, seed=1,
              logging_steps=1)
    cmd = gpu_clm_compare.child_command("zero_offload", str(tmp_path / "zero_offload.json"),
                                        use_datasets=False, **kw)
    assert cmd[:6] == [sys.executable, gpu_clm_compare.__file__, "--child",
                       str(tmp_path / "zero_offload.json"), "--no_datasets", "--"]
    assert cmd[6:] == gpu_clm_compare.run_clm_args(str(tmp_path / "zero_offload"),
                                                   offload=True, **kw)
    assert gpu_clm_compare.parse_args(["--parallel"]).parallel


def test_llama_config_is_about_100m_params():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=2048)
    cfg.update_from_string(gpu_clm_compare.LLAMA_100M)
    with torch.device("meta"):
        n = LlamaForCausalLM(cfg).num_parameters()
    assert n == 98_716_416, n  # 98.7M: the estimate in LLAMA_100M's comment, plus the norms


class _Args:
    @contextlib.contextmanager
    def main_process_first(self, desc=""):
        yield


def test_data_stand_ins_give_run_clms_blocks():
    """The list-based load_texts / tokenize_blocks give exactly what run_clm's own (on the
    datasets library) give, for the built-in corpus."""
    pytest.importorskip("datasets")
    run_clm = gpu_clm_compare.load_run_clm()
    from hf_zoffload.integrations import defaults

    data = run_clm.DataArguments(corpus_mb=0.3, validation_split_percentage=7)
    theirs, ours = run_clm.load_texts(data), gpu_clm_compare.load_texts_without_datasets(data)
    for split in ("train", "validation"):
        assert ours[split]["text"] == theirs[split]["text"], split
        assert ours[split].column_names == theirs[split].column_names
    tok = defaults.train_tokenizer(ours["train"]["text"], vocab_size=300)
    kw = dict(column="text", block_size=48, args=_Args())
    theirs = run_clm.tokenize_blocks(theirs, tok, **kw)
    ours = gpu_clm_compare.tokenize_blocks_without_datasets(ours, tok, **kw)
    for split in ("train", "validation"):
        assert len(ours[split]) == len(theirs[split]) > 10
        assert ours[split]["input_ids"] == theirs[split]["input_ids"]
        assert ours[split][3] == theirs[split][3]
        assert ours[split].select(range(4))["labels"] == theirs[split].select(range(4))["labels"]


@pytest.mark.slow
def test_one_zero_offload_run_without_datasets(tmp_path):
    """The child side of gpu_clm_compare end to end on the CPU: run_clm with --zero_offload,
    the data stand-ins, the figures written."""
    import json

    out = tmp_path / "run"
    argv = gpu_clm_compare.run_clm_args(
        str(out), offload=True, steps=4, block_size=32, batch=2, lr=3e-3, seed=1,
        logging_steps=2, bf16=False, extra=["--corpus_mb", "0.05", "--vocab_size", "300"],
        overrides="hidden_size=32,intermediate_size=64,num_hidden_layers=1,"
                  "num_attention_heads=2,num_key_value_heads=2,max_position_embeddings=64")
    gpu_clm_compare.child(str(tmp_path / "r.json"), argv, use_datasets=False)
    r = json.loads((tmp_path / "r.json").read_text())
    assert [s for s, _ in r["losses"]] == [2, 4] and r["datasets"] is False
    assert r["n_params"] > 0 and r["peak_bytes"] is None and r["train_loss"] > 0
