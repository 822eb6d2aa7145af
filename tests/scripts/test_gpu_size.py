"""scripts/bench/gpu_size.py and the Llama helpers the measured GPU stages share
(scripts/bench/_gpu_llama.py), checked where there is no GPU: the parameter counts, the model
configs and both training steps on a tiny CPU model, the ladder search against oracles, the
round planning, the report, the argument errors, and probes run on the CPU.

CUDA_VISIBLE_DEVICES="" hides any GPU from the subprocesses, so this holds on a GPU machine too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest
import torch

from tests._env import cpu_only_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
BENCH = str(SCRIPTS / "bench")
sys.path.insert(0, BENCH)  # the measurement scripts import their siblings as a script does
try:
    import _gpu_llama as llama
    import gpu_size
finally:
    sys.path.remove(BENCH)

GiB = 2**30
TINY = ("hidden_size=32,intermediate_size=64,num_attention_heads=4,num_key_value_heads=2,"
        "head_dim=8,vocab_size=97,max_position_embeddings=64")


# ------------------------------------------------------------------ models
@pytest.mark.parametrize("base, layers", [(llama.LLAMA_4096, 1), (llama.LLAMA_4096, 3),
                                          (llama.LLAMA_1B, None),
                                          ({**llama.LLAMA_1B, "tie_word_embeddings": True}, 2)])
def test_param_counts_match_the_built_models(base, layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(base) if layers is None else {**base, "num_hidden_layers": layers}
    with torch.device("meta"):
        n = LlamaForCausalLM(LlamaConfig(**cfg)).num_parameters()
    assert llama.n_params(base, layers) == n


def test_the_figures_the_docs_state():
    assert llama.n_params(llama.LLAMA_1B) == 1_100_048_384
    per_layer = llama.n_params(llama.LLAMA_4096, 1) - llama.n_params(llama.LLAMA_4096, 0)
    assert round(per_layer / 1e5) == 2024 and round(llama.n_params(llama.LLAMA_4096, 0) / 1e5) \
        == 2621  # 202.4M a layer, 262.1M in embeddings and head


def test_overrides_change_only_known_keys_to_positive_integers():
    out = llama.with_overrides(llama.LLAMA_1B, "hidden_size=64,num_hidden_layers=2")
    assert out["hidden_size"] == 64 and out["num_hidden_layers"] == 2
    assert llama.LLAMA_1B["hidden_size"] == 2048  # not changed in place
    for bad in ("hiden_size=64", "hidden_size=big", "hidden_size=0", "tie_word_embeddings=1"):
        with pytest.raises(SystemExit, match="expected key=positive integer with the key one "
                                             "of vocab_size, hidden_size"):
            llama.with_overrides(llama.LLAMA_1B, bad, what="--overrides")


def test_build_model_in_its_dtype_without_cache():
    base = llama.with_overrides(llama.LLAMA_1B, TINY + ",num_hidden_layers=2")
    model = llama.build_model(base, torch.bfloat16, "cpu", checkpointing=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
    assert model.is_gradient_checkpointing and model.training
    assert model.config.use_cache is False and model.config.num_hidden_layers == 2
    three = llama.build_model(base, torch.float32, "cpu", layers=3)
    assert three.config.num_hidden_layers == 3 and not three.is_gradient_checkpointing


def test_both_training_steps_run_and_learn_on_the_cpu():
    base = llama.with_overrides(llama.LLAMA_1B, TINY + ",num_hidden_layers=1")
    ids = llama.token_ids(base, 2, 16, "cpu")
    assert torch.equal(ids, llama.token_ids(base, 2, 16, "cpu"))  # fixed batch
    for make, dtype in ((llama.amp_step, torch.float32), (llama.zoffload_step, torch.bfloat16)):
        torch.manual_seed(0)
        model = llama.build_model(base, dtype, "cpu")
        step, finish = make(model)[:2]
        losses = [float(step(ids)) for _ in range(3)]
        finish()
        assert losses[-1] < losses[0], (make.__name__, losses)


# ------------------------------------------------------------------ size: the search
def _search_to_the_end(size, pred, fits, k=2):
    s = gpu_size.Search("w", size, pred)
    rounds = 0
    while not s.done:
        cands = s.next(k)
        assert cands and len(cands) <= k and all(s.lo < c < s.hi for c in cands)
        for i in cands:
            s.record(i, {"result": "fits" if fits(i) else "oom", "layers": i})
        rounds += 1
        assert rounds <= size, "no progress"
    return s, rounds


@pytest.mark.parametrize("size", [1, 2, 7, 30])
def test_search_finds_every_boundary_from_every_prediction(size):
    for boundary in range(size + 1):  # rungs below it fit
        for pred in range(size):
            s, rounds = _search_to_the_end(size, pred, lambda i, b=boundary: i < b)
            assert (s.lo, s.hi) == (boundary - 1, boundary), (size, boundary, pred)
            assert s.conflicts == []
            if pred == boundary - 1 or (boundary == 0 and pred == 0):
                assert rounds == 1  # a right prediction settles it in one round


def test_search_notes_conflicts_and_stops_on_errors():
    s = gpu_size.Search("w", 10, 4)
    s.record(4, {"result": "oom"})
    s.record(5, {"result": "fits"})  # fits above a failure: allocator luck, not a boundary
    assert s.conflicts == ["rung 5 fits above the failed rung 4"]
    s = gpu_size.Search("w", 10, 4)
    s.record(4, {"result": "error"})
    assert s.done and s.next() == []  # nothing to infer from it; no endless retries


def test_predictions_and_host_needs_the_check_relies_on():
    """gpu_check.sh's comment on the size stage: at 9 GiB, amp 1 layer and zoffload 20; the
    round's fp32 probe (59 GiB of host) and the next rung's int8 one (37 GiB) fit together."""
    ladder = list(range(1, 49))
    base = llama.LLAMA_4096
    assert ladder[gpu_size.predicted_rung("amp", ladder, base, 9 * GiB)] == 1
    assert ladder[gpu_size.predicted_rung("zoffload", ladder, base, 9 * GiB)] == 20
    assert round(gpu_size.host_need("zoffload", 20, base, "fp32") / GiB) == 59
    assert round(gpu_size.host_need("zoffload", 21, base, "int8") / GiB) == 37
    assert gpu_size.predicted_rung("amp", ladder, base, 1 * GiB) == 0  # none: the first
    top = gpu_size.ladder_top(base, 100 * GiB, 48)  # one fp32 probe alone fits the budget
    assert gpu_size.host_need("zoffload", top, base, "fp32") <= 100 * GiB < \
        gpu_size.host_need("zoffload", top + 1, base, "fp32")
    assert gpu_size.ladder_top(base, 10**15, 48) == 48


def test_plan_round_keeps_each_batch_within_the_host_budget():
    specs = [{"way": w, "host_need": n} for w, n in
             (("amp", 3), ("zoffload", 59), ("zoffload", 37), ("amp", 3), ("zoffload", 120))]
    batches = gpu_size.plan_round(specs, budget=100)
    assert sorted(s["host_need"] for b in batches for s in b) == [3, 3, 37, 59, 120]
    assert [[s["host_need"] for s in b] for b in batches] == [[120], [59, 37, 3], [3]]


def _args(**kw):
    base = dict(max_layers=12, time_limit=None, seq=8, device="cpu", fsdp2=False, host_speed=1.0)
    return argparse.Namespace(**{**base, **kw})


def _oracle(limits):
    """A fake run_batch: a probe fits while its layers are <= limits[way]; records calls."""
    calls = []

    def run(batch, work, timeout):
        calls.append([dict(s) for s in batch])
        return [{"way": s["way"], "layers": s["layers"], "state_dtype": s["state_dtype"],
                 "n_params": llama.n_params(llama.LLAMA_4096, s["layers"]),
                 "result": "fits" if s["layers"] <= limits[s["way"]] else "oom",
                 "message": "", "seconds": 20.0, "peak_allocated": 8 * GiB,
                 "peak_reserved": 8.5 * GiB, "host_total": 50 * GiB if s["state_dtype"] else None}
                for s in batch]
    return run, calls


def test_search_assigns_states_threads_and_host_shares(monkeypatch, tmp_path):
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    run, calls = _oracle({"amp": 1, "zoffload": 20})
    ladder, searches, notes = gpu_size.search(_args(max_layers=40), llama.LLAMA_4096, 9 * GiB,
                                              200 * GiB, run=run)
    assert ladder[-1] == 40 and notes == []
    assert len(calls) == 1  # the predictions were right: one round, all probes at once
    probes = {(s["way"], s["layers"], s["state_dtype"]) for s in calls[0]}
    assert probes == {("amp", 1, None), ("amp", 2, None), ("zoffload", 20, "fp32"),
                      ("zoffload", 21, "int8")}
    zo = [s for s in calls[0] if s["way"] == "zoffload"]
    assert {s["threads"] for s in zo} == {max(1, (os.cpu_count() or 1) // 2)}
    total = sum(s["host_need"] for s in calls[0])
    for s in zo:  # each engine's host_memory_limit: its share of the budget, at least its need
        assert s["host_limit"] == int(200 * GiB * s["host_need"] / total) >= s["host_need"]
    assert (searches["amp"].lo, searches["zoffload"].lo) == (0, 19)  # indices: 1 and 20 layers
    lines, failures = gpu_size.report(ladder, searches, cap=9 * GiB, device="NVIDIA H200")
    assert failures == []
    text = "\n".join(lines)
    assert ("| torch AdamW (fused), fp32 params, bf16 autocast, all on the device | 1 layers | "
            "464.5M | probed | 8.00 / 8.50 | n/a | 2 layers (amp): oom |") in text
    assert ("| ZeroOffloadOptimizer, bf16 params, state fp32 | 20 layers | 4.31B | probed |"
            in text) and "| 21 layers (int8): oom |" in text
    assert "| ZeroOffloadOptimizer, bf16 params, state int8 | 20 layers | 4.31B | implied by " \
           "the fp32 fit |" in text
    assert "within 9 GiB of the NVIDIA H200: ZeRO-Offload trains 9.3x the params of AMP " \
           "AdamW (4.31B vs 464.5M; the ZeRO-Offload paper: 10x" in text


def test_a_round_over_the_host_budget_runs_in_batches(monkeypatch, tmp_path):
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    run, calls = _oracle({"amp": 1, "zoffload": 20})
    gpu_size.search(_args(max_layers=40), llama.LLAMA_4096, 9 * GiB, 80 * GiB, run=run)
    # the fp32 probe (59 GiB) and the int8 one (37 GiB) do not fit 80 GiB together
    assert [[(s["layers"], s["state_dtype"]) for s in b] for b in calls] == [
        [(20, "fp32"), (1, None), (2, None)], [(21, "int8")]]
    assert calls[1][0]["threads"] == (os.cpu_count() or 1)  # alone: every core


def test_search_stops_at_the_time_limit(monkeypatch, tmp_path):
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    clock = {"t": 0.0}
    run, calls = _oracle({"amp": 1, "zoffload": 30})  # the prediction (20) is far too low

    def slow(batch, work, timeout):
        clock["t"] += 20.0  # a round takes 20 s
        return run(batch, work, timeout)

    # host passes 1000x the 2-vCPU rates: every probe's predicted seconds fit the limit
    ladder, searches, notes = gpu_size.search(_args(max_layers=40, time_limit=30,
                                                    host_speed=1000.0),
                                              llama.LLAMA_4096, 9 * GiB, 200 * GiB, run=slow,
                                              clock=lambda: clock["t"])
    # after the first round (20 s) no probe is predicted to end in the 10 s left
    assert len(calls) == 1 and "10 s left" in searches["zoffload"].stopped
    lines, failures = gpu_size.report(ladder, searches, cap=9 * GiB, device="H")
    assert failures == [] and "zoffload: the search ended before its time ran out: 22 layers " \
                              "(fp32) not probed" in "\n".join(lines)


def test_probe_seconds_from_the_host_passes():
    """A probe's seconds: its start, plus the placement and the re-layout over its engine
    state at the 2-vCPU rates (0.93 and 1.6 GiB/s with fp32 state, 0.46 and 0.22 with int8):
    the 20-layer fp32 probe at 9 GiB (56 GiB of state) is ~106 s there, its int8 rung
    ~240 s, far past the size stage's seconds."""
    base = llama.LLAMA_4096
    state = (gpu_size.host_need("zoffload", 20, base, "fp32") - gpu_size.PROCESS_HOST_BYTES) / GiB
    want = gpu_size.PROBE_START_S + state * (1 / 0.93 + 1 / 1.6)
    assert gpu_size.probe_seconds("zoffload", 20, base, "fp32") == pytest.approx(want)
    assert 100 < want < 110
    assert gpu_size.probe_seconds("zoffload", 21, base, "int8") > 230
    assert gpu_size.probe_seconds("zoffload", 20, base, "fp32", speed=4.0) == pytest.approx(
        gpu_size.PROBE_START_S + (want - gpu_size.PROBE_START_S) / 4)
    assert gpu_size.probe_seconds("amp", 20, base, None) == gpu_size.PROBE_START_S


def test_the_ladder_starts_where_a_probe_can_finish(monkeypatch, tmp_path):
    """Under a 28 s limit the predicted 20 layers cannot be probed at 2-vCPU rates: zoffload
    starts at the largest rung predicted to end in time (2 layers, ~26 s), probes it, and
    stops before the int8 rung above (predicted past the time left); the figure is reported
    as a lower bound, and the no-gain check does not fail a search cut short by time."""
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    run, calls = _oracle({"amp": 1, "zoffload": 20})
    ladder, searches, notes = gpu_size.search(_args(max_layers=40, time_limit=28),
                                              llama.LLAMA_4096, 9 * GiB, 200 * GiB, run=run,
                                              clock=lambda: 0.0)
    zo = searches["zoffload"]
    top = gpu_size.time_top(llama.LLAMA_4096, 28, ladder)
    assert ladder[top] == 2 and zo.pred == top
    assert "the search starts at 2 layers, not the predicted 20" in notes[0]
    probed = [(s["way"], s["layers"], s["state_dtype"]) for b in calls for s in b]
    assert ("zoffload", 2, "fp32") in probed
    assert all(s["predicted_s"] <= 28 for b in calls for s in b)
    assert zo.done and "3 layers (int8) not probed: predicted" in zo.stopped
    lines, failures = gpu_size.report(ladder, searches, cap=9 * GiB, device="NVIDIA H200",
                                      notes=notes)
    assert failures == []
    text = "\n".join(lines)
    assert "zoffload: the search ended before its time ran out" in text and "lower bound" in text
    assert "| ZeroOffloadOptimizer, bf16 params, state fp32 | 2 layers |" in text


# ------------------------------------------------------------------ size: FSDP2 offload
def test_fsdp2_probes_one_rung_past_the_weights_wall():
    """At 9 GiB the first rung whose bf16 weights alone pass the cap is 23 layers (4.92B
    params, 9.16 GiB): what optimizer offload alone cannot train. Its host need (bf16 master,
    int4 moments, FSDP2's pinned shards and the copies around them) makes the round two
    batches on a 128 GiB host."""
    ladder, base = list(range(1, 49)), llama.LLAMA_4096
    wall = gpu_size.wall_rung(ladder, base, 9 * GiB)
    assert ladder[wall] == 23 and round(2 * llama.n_params(base, 23) / GiB, 2) == 9.16
    assert 2 * llama.n_params(base, 22) <= 9 * GiB
    assert round(gpu_size.host_need("fsdp2", 23, base, "int4") / GiB) == 54
    assert gpu_size.wall_rung([1, 2], base, 9 * GiB) is None  # the ladder does not reach it
    s = gpu_size.OneRung("fsdp2", 48, wall)
    assert s.next() == [wall] and not s.done
    s.record(wall, {"result": "fits"})
    assert s.done and s.next() == []


def test_search_with_fsdp2_probes_its_rung_in_the_same_round(monkeypatch, tmp_path):
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    run, calls = _oracle({"amp": 1, "zoffload": 20, "fsdp2": 48})
    ladder, searches, notes = gpu_size.search(_args(max_layers=40, fsdp2=True),
                                              llama.LLAMA_4096, 9 * GiB, 128 * GiB, run=run)
    assert notes == []
    probes = [(s["way"], s["layers"], s["state_dtype"]) for b in calls for s in b]
    assert ("fsdp2", 23, "int4") in probes and len(probes) == 5  # one round
    assert len(calls) == 2  # in two batches: 62 + 40 + 54 GiB of probes over 128 GiB
    lines, failures = gpu_size.report(ladder, searches, cap=9 * GiB, device="NVIDIA H200",
                                      base=llama.LLAMA_4096, host_budget=108 * GiB)
    assert failures == []
    text = "\n".join(lines)
    assert ("| ZeroOffloadOptimizer over FSDP2 parameter offload, bf16 master, state int4 | "
            "23 layers | 4.92B | probed |") in text
    assert ("within 9 GiB of the NVIDIA H200: FSDP2 parameter offload trained 23 layers (4.92B "
            "params, whose bf16 weights alone are 9.16 GiB), device peak 8.00 GiB allocated, "
            "host 50.00 GiB by memory_report() and n/a GiB pinned by torch; the device need "
            "does not grow with the layers, so the host bounds it: 108 GiB hold about") in text
    # on a GPU, a probe that does not train its rung fails the stage
    run, _ = _oracle({"amp": 1, "zoffload": 20, "fsdp2": 22})
    ladder, searches, _ = gpu_size.search(_args(max_layers=40, fsdp2=True), llama.LLAMA_4096,
                                          9 * GiB, 128 * GiB, run=run)
    _, failures = gpu_size.report(ladder, searches, cap=9 * GiB, device="NVIDIA H200")
    assert failures == ["FSDP2 parameter offload did not train 23 layers within the cap: oom: "]


def test_report_fails_on_errors_an_unenforced_cap_and_no_gain():
    def probe(way, layers, result, reserved=8 * GiB, state=None):
        return {"way": way, "layers": layers, "state_dtype": state, "result": result,
                "n_params": layers, "message": "boom", "seconds": 1.0,
                "peak_allocated": reserved, "peak_reserved": reserved}

    amp, zo = gpu_size.Search("amp", 5, 1), gpu_size.Search("zoffload", 5, 1)
    amp.record(1, probe("amp", 2, "fits", reserved=10 * GiB))  # past the 9 GiB cap
    zo.record(0, probe("zoffload", 1, "fits", state="fp32"))
    zo.record(1, probe("zoffload", 2, "error", state="int8"))
    _, failures = gpu_size.report([1, 2, 3, 4, 5], {"amp": amp, "zoffload": zo},
                                  cap=9 * GiB, device="H")
    assert any("amp 2 layers reserved 10.00 GiB, past the 9.00 GiB cap" in f for f in failures)
    assert "zoffload 2 layers: error: boom" in failures
    assert "ZeRO-Offload fits no larger model than AMP AdamW (0.50x)" in failures


def test_size_arguments_are_checked_before_any_work(monkeypatch, capsys):
    for bad in (["--cap_gib", "0"], ["--max_layers", "1"], ["--seq", "1"],
                ["--host_speed", "0"]):
        with pytest.raises(SystemExit) as e:
            gpu_size.parse_args(bad)
        assert e.value.code == 2 and "must be > 0" in capsys.readouterr().err
    monkeypatch.setenv("GPU_CHECK_STAGE_S", "42")
    assert gpu_size.parse_args([]).time_limit == 36.0  # gpu_check.sh's limit, less 6 s
    with pytest.raises(SystemExit, match="gpu_size.py: --overrides 'layers=3'"):
        gpu_size.main(["--device", "cpu", "--overrides", "layers=3"])


def test_one_probe_in_this_process_on_the_cpu():
    base = llama.with_overrides(llama.LLAMA_4096, TINY)
    spec = {"way": "zoffload", "layers": 2, "state_dtype": "int8", "base": base, "seq": 16,
            "cap": 9 * GiB, "device": "cpu", "threads": 1, "host_limit": 2 * GiB}
    r = gpu_size.run_probe(spec)
    assert r["result"] == "fits", r
    assert r["n_params"] == llama.n_params(base, 2) and r["host_total"] > 0
    assert len(r["losses"]) == 2 and "peak_reserved" not in r  # no device figures on the CPU
    r = gpu_size.run_probe({**spec, "host_limit": 1000})  # the engine's host check refuses
    assert r["result"] == "host" and "host memory" in r["message"]
    r = gpu_size.run_probe({**spec, "way": "amp", "state_dtype": None})
    assert r["result"] == "fits" and r["host_total"] is None


def test_one_fsdp2_probe_in_this_process_on_the_cpu():
    """FSDP2 parameter offload: built on the host, sharded over a one-rank gloo group, which
    the probe takes down again; the host holds its bf16 params (2 B) beside the state."""
    base = llama.with_overrides(llama.LLAMA_4096, TINY)
    spec = {"way": "fsdp2", "layers": 2, "state_dtype": "int4", "base": base, "seq": 16,
            "cap": 9 * GiB, "device": "cpu", "threads": 1, "host_limit": 2 * GiB}
    r = gpu_size.run_probe(spec)
    assert r["result"] == "fits" and len(r["losses"]) == 2, r
    assert r["host_total"] > 2 * r["n_params"]
    import torch.distributed as dist

    assert not dist.is_initialized()


@pytest.mark.slow
def test_a_probe_process_writes_its_result(tmp_path, monkeypatch):
    """The child side as run_batch starts it (one subprocess: ~6 s of imports on 2 cores)."""
    base = llama.with_overrides(llama.LLAMA_4096, TINY)
    spec = {"way": "amp", "layers": 1, "state_dtype": None, "base": base, "seq": 8,
            "cap": GiB, "device": "cpu", "threads": 1, "host_limit": 0}
    for key, value in cpu_only_env().items():  # the child inherits this environment
        monkeypatch.setenv(key, value)
    [r] = gpu_size.run_batch([spec], str(tmp_path), timeout=120)
    assert r["result"] == "fits" and r["layers"] == 1 and len(r["losses"]) == 2, r
    broken = {k: v for k, v in spec.items() if k != "device"}  # the child dies: no result
    [r] = gpu_size.run_batch([broken], str(tmp_path), timeout=120)
    assert r["result"] == "error" and r["message"] == "probe process: exit 1", r
