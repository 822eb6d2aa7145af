"""bench_fsdp2_step.py at a tiny size: every row once, each reference 1.00 against itself (the
same round), ours with every state_dtype; bad arguments are one usage error."""

import runpy
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "bench" / "bench_fsdp2_step.py")


def test_prints_every_row_with_its_ratios(capsys):
    bench = runpy.run_path(SCRIPT)  # main() not run
    threads = torch.get_num_threads()
    assert bench["main"](["--params", "5K", "--dim", "32", "--rounds", "1",
                          "--threads", "1"]) == 0
    assert torch.get_num_threads() == threads  # main() puts it back
    out = capsys.readouterr().out
    assert "5,280 params in 5 Linear(32, 32) layers, 1 rounds" in out
    table = {r[0]: r[1:] for r in ([c.strip() for c in line.strip("|").split("|")]
                                   for line in out.splitlines() if line.startswith("| "))}
    assert list(table)[1:] == ["torch AdamW(default) fp32", "torch AdamW(foreach) fp32",
                               "torch AdamW(fused) fp32",
                               "ours fp32 state, bf16 grads", "ours bf16 state, bf16 grads",
                               "ours int8 state, bf16 grads"]
    assert table["torch AdamW(foreach) fp32"][1] == "1.00"
    assert table["torch AdamW(fused) fp32"][2] == "1.00"
    assert all(float(v[0]) > 0 for k, v in table.items() if k != "row")


@pytest.mark.parametrize("argv, says", [(["--state_dtypes", "fp8"], "allowed fp32"),
                                        (["--params", "lots"], "--params 'lots'"),
                                        (["--rounds", "0"], "must be positive")])
def test_bad_arguments_are_one_usage_error(argv, says, capsys):
    bench = runpy.run_path(SCRIPT)
    with pytest.raises(SystemExit) as exc:
        bench["main"](argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err
