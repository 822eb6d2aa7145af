"""scripts/run_clm.py --bf16 with and without --zero_offload on CUDA: final losses within 1%,
both falling, both runs' peak device memory (tests/gpu/_clm.py runs and compares them).

`test_run_clm_with_and_without_zero_offload` is the gpu test (scripts/gpu_check.sh's run_clm
stage); the others check the comparison, the command lines, the parallel runs, the data
stand-ins and a run on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import pytest
import torch

from tests._env import cpu_only_env
from tests.gpu import _clm
from tests.gpu import _common as common

# A ~100M-parameter Llama (_clm.LLAMA_100M) for 50 steps of 8 x 256 tokens, logged every 10.
RUN = dict(steps=50, overrides=_clm.LLAMA_100M, block_size=256, batch=8, lr=6e-4, seed=42,
           logging_steps=10)
MAX_REL = 0.01  # the final logged losses may differ by bf16 roundings, not more
# Both runs at once, each its own process (own peak memory; the same seed and losses): one
# run's imports, tokenizer and 50 steps (~15 s, estimated) instead of two after each other.
RUN_TIMEOUT_S = 16  # within the run_clm stage's 19 s (gpu_check.sh)
TINY = ("hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,"
        "num_key_value_heads=2,max_position_embeddings=64")


@pytest.mark.gpu
def test_run_clm_with_and_without_zero_offload(figures, tmp_path):
    results, failures = _clm.run_pair(str(tmp_path), use_datasets=_clm.have_datasets(),
                                      timeout=RUN_TIMEOUT_S, parallel=True, **RUN)
    lines = []
    if not failures:
        lines, failures = _clm.compare_runs(results["stock"], results["zero_offload"],
                                            max_rel=MAX_REL)
    common.finish(figures, lines, failures)


# ------------------------------------------------------------------ on the CPU
def _run(losses, peak=None, datasets=False):
    return {"losses": losses, "train_loss": sum(x for _, x in losses) / len(losses),
            "n_params": 98_700_000, "peak_bytes": peak, "seconds": 12.0, "datasets": datasets}


def test_clm_final_losses_within_one_percent():
    stock = _run([[10, 7.5], [50, 5.0]], peak=2 * 2**30)
    ok = _run([[10, 7.4], [50, 5.049]], peak=2**29)
    lines, failures = _clm.compare_runs(stock, ok, max_rel=0.01)
    assert failures == []
    text = "\n".join(lines)
    assert "| stock Trainer --bf16 | 98.7M | 7.5000 | 5.0000 (step 50) |" in text
    assert "2.00 GiB" in text and "512.00 MiB" in text
    assert "differ by 0.98% (limit 1%); peak device memory: zero_offload 0.25x" in text
    assert "the list-based stand-in" in text
    _, failures = _clm.compare_runs(stock, _run([[10, 7.4], [50, 5.051]]),
                                               max_rel=0.01)
    assert failures == ["final losses 5.0000 (stock) and 5.0510 (zero_offload) differ by "
                        "1.02%, more than 1%"]
    _, failures = _clm.compare_runs(stock, _run([[10, 5.0], [50, 5.0]]),
                                               max_rel=0.01)
    assert failures and "the loss did not fall" in failures[0]
    _, failures = _clm.compare_runs(stock, _run([[50, 5.0]]), max_rel=0.01)
    assert failures and "fewer than 2 logged losses" in failures[0]
    _, failures = _clm.compare_runs(stock, _run([[10, 7.4], [40, 5.0]]),
                                               max_rel=0.01)
    assert failures and "last loss at steps 50 and 40" in failures[0]


def test_run_clm_args_differ_only_by_zero_offload():
    kw = dict(steps=50, overrides=_clm.LLAMA_100M, block_size=256, batch=8,
              lr=6e-4, seed=42, logging_steps=10)
    stock = _clm.run_clm_args("out", offload=False, **kw)
    ours = _clm.run_clm_args("out", offload=True, **kw)
    assert ours == stock + ["--zero_offload"] and "--bf16" in stock
    args = _clm.parse_args(["--child", "r.json", "--", *ours])
    assert args.child == "r.json" and args.run_clm_args[1:] == ours and not args.no_datasets


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

    monkeypatch.setattr(_clm, "child_command", command)
    results, failures = _clm.run_pair(str(tmp_path), use_datasets=False,
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
    cmd = _clm.child_command("zero_offload", str(tmp_path / "zero_offload.json"),
                                        use_datasets=False, **kw)
    assert cmd[:7] == [sys.executable, "-m", "tests.gpu._clm", "--child",
                       str(tmp_path / "zero_offload.json"), "--no_datasets", "--"]
    assert cmd[7:] == _clm.run_clm_args(str(tmp_path / "zero_offload"), offload=True, **kw)


def test_llama_config_is_about_100m_params():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=2048)
    cfg.update_from_string(_clm.LLAMA_100M)
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
    run_clm = _clm.load_run_clm()
    from hf_zoffload.integrations import defaults

    data = run_clm.DataArguments(corpus_mb=0.3, validation_split_percentage=7)
    theirs, ours = run_clm.load_texts(data), _clm.load_texts_without_datasets(data)
    for split in ("train", "validation"):
        assert ours[split]["text"] == theirs[split]["text"], split
        assert ours[split].column_names == theirs[split].column_names
    tok = defaults.train_tokenizer(ours["train"]["text"], vocab_size=300)
    kw = dict(column="text", block_size=48, args=_Args())
    theirs = run_clm.tokenize_blocks(theirs, tok, **kw)
    ours = _clm.tokenize_blocks_without_datasets(ours, tok, **kw)
    for split in ("train", "validation"):
        assert len(ours[split]) == len(theirs[split]) > 10
        assert ours[split]["input_ids"] == theirs[split]["input_ids"]
        assert ours[split][3] == theirs[split][3]
        assert ours[split].select(range(4))["labels"] == theirs[split].select(range(4))["labels"]


@pytest.mark.slow
def test_one_zero_offload_run_without_datasets(tmp_path):
    """The child side end to end on the CPU, in this process: run_clm with --zero_offload,
    the data stand-ins, the figures written."""
    out = tmp_path / "run"
    argv = _clm.run_clm_args(
        str(out), offload=True, steps=4, block_size=32, batch=2, lr=3e-3, seed=1,
        logging_steps=2, bf16=False, extra=["--corpus_mb", "0.05", "--vocab_size", "300"],
        overrides=TINY)
    run_clm = _clm.load_run_clm()
    own = (run_clm.load_texts, run_clm.tokenize_blocks, run_clm.build_model)
    _clm.child(str(tmp_path / "r.json"), argv, use_datasets=False)
    assert (run_clm.load_texts, run_clm.tokenize_blocks, run_clm.build_model) == own
    r = json.loads((tmp_path / "r.json").read_text())
    assert [s for s, _ in r["losses"]] == [2, 4] and r["datasets"] is False
    assert r["n_params"] > 0 and r["peak_bytes"] is None and r["train_loss"] > 0


@pytest.mark.slow
def test_both_runs_as_child_processes_on_the_cpu(tmp_path, monkeypatch):
    """run_pair as the gpu test starts it (python -m tests.gpu._clm, both at once), on a tiny
    model in fp32 on the CPU, from another folder and without PYTHONPATH (child_env puts the
    checkout there): both runs write their figures."""
    for key, value in cpu_only_env().items():  # the children inherit this environment
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    results, failures = _clm.run_pair(
        str(tmp_path), use_datasets=False, timeout=240, parallel=True, steps=4,
        overrides=TINY, block_size=32, batch=2, lr=3e-3, seed=1, logging_steps=2,
        bf16=False, extra=["--corpus_mb", "0.05", "--vocab_size", "300"])
    assert failures == [] and sorted(results) == ["stock", "zero_offload"], failures
    for r in results.values():
        assert [s for s, _ in r["losses"]] == [2, 4] and r["datasets"] is False
        assert r["peak_bytes"] is None and r["n_params"] > 0
