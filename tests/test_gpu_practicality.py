"""scripts/gpu_practicality.py, checked where there is no GPU: the rows and ratios, the
argument errors, and a tiny CPU run of each way (in this process, with --device cpu, so this
holds on a GPU machine too).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import _gpu_llama as llama  # noqa: E402
import gpu_practicality  # noqa: E402

GiB = 2**30
TINY = ("hidden_size=32,intermediate_size=64,num_attention_heads=4,num_key_value_heads=2,"
        "head_dim=8,vocab_size=97,max_position_embeddings=64")


# ------------------------------------------------------------------ practicality
def test_practicality_rows_and_ratios():
    amp = {"way": llama.AMP, "tokens_per_s": 40000.0, "ms_per_step": 204.8,
           "peak_bytes": 30 * GiB, "final_loss": 10.4}
    ours = {**amp, "way": llama.ZOFFLOAD, "tokens_per_s": 10000.0, "peak_bytes": None}
    delayed = {**ours, "way": llama.ZOFFLOAD + gpu_practicality.DELAYED,
               "tokens_per_s": 20000.0}
    assert gpu_practicality.row(ours, amp) == [llama.ZOFFLOAD, "10,000", "205", "n/a", "0.25",
                                               "10.400"]
    assert gpu_practicality.row(amp, None)[3:5] == ["30.00", "n/a"]
    line = gpu_practicality.ratio_line([amp, ours, delayed])
    assert line.startswith("ZeRO-Offload runs at 25.0% of AMP AdamW's tokens/s, 50.0% with "
                           "the delayed update; reference (issue 22, DeepSpeed's study): "
                           "ZeRO-Offload at 17.6% of no-offload speed")
    assert gpu_practicality.ratio_line([amp, delayed]) == "ratios: n/a (a way did not finish)"
    assert gpu_practicality.check([amp, {**ours, "final_loss": float("nan")}]) == [
        f"{llama.ZOFFLOAD}: final loss nan"]


def test_practicality_arguments_are_checked(capsys):
    for bad in (["--batch", "0"], ["--steps", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit) as e:
            gpu_practicality.parse_args(bad)
        assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_practicality_runs_its_three_ways_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = gpu_practicality.main(["--device", "cpu", "--overrides", TINY + ",num_hidden_layers=1",
                                "--batch", "2", "--seq", "16", "--warmup", "1", "--steps", "2",
                                "--json", str(out)])
    assert rc == 0
    said = capsys.readouterr().out
    lines = [x[len("summary: "):] for x in said.splitlines() if x.startswith("summary: ")]
    assert lines[0].startswith("Llama 1 layers x 32") and "batch 2 x 16 tokens" in lines[0]
    assert lines[2] == "| " + " | ".join(gpu_practicality.HEADER) + " |"
    rows = [x for x in lines if x.startswith("| ") and "tokens/s" not in x and "---" not in x]
    assert [r.split(" | ")[0][2:] for r in rows] == [
        llama.AMP, llama.ZOFFLOAD, llama.ZOFFLOAD + gpu_practicality.DELAYED]
    assert rows[0].split(" | ")[4] == "1.00" and lines[-1].startswith("ZeRO-Offload runs at ")
    saved = json.loads(out.read_text())
    assert saved["batch"] == 2 and len(saved["results"]) == 3
    assert all(r["tokens_per_s"] > 0 for r in saved["results"])
