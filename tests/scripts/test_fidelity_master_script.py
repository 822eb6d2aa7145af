"""scripts/bench/fidelity_master_dtype.py: its modes and options are checked before any run
(the runs themselves are the benchmark, docs/benchmarks.md)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import fidelity_master_dtype as fm  # noqa: E402


@pytest.mark.parametrize("argv,message", [
    (["--modes", "bf16/int4"], "--modes: fp32/fp32 first (the reference), each mode once"),
    (["--modes", "fp32/fp32,bf16/int3"], "a mode is master/state with master one of fp32, bf16"),
    (["--modes", "fp32/fp32,bf16-nearest/fp32"], "got 'bf16-nearest/fp32'"),
    (["--nearest", "int3"], "--nearest: a comma list of fp32, bf16, int8, int4, each once"),
    (["--modes", "fp32/fp32", "--jobs", "3"], "--jobs must be between 1 and 1"),
    (["--steps", "29"], "--steps >= 30"),
])
def test_bad_options_are_refused_before_any_run(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fm.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_modes_parse_in_their_order():
    assert fm.parse_modes("fp32/fp32,bf16/int8") == [("fp32", "fp32"), ("bf16", "int8")]
