"""scripts/bench/fraction_check.py (the CPU check of offload_fraction against AdamW), run
short: its table, and its verdict when a difference is above the tolerance."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import fraction_check  # noqa: E402


@pytest.mark.slow
def test_fraction_check_table_and_verdict(capsys):
    assert fraction_check.main(["--steps", "3", "--fractions", "0,1", "--no_ranks"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 process |")]
    assert [r.split(" | ")[1] for r in rows] == ["0", "1"]
    assert rows[0].split(" | ")[2] == "10/10" and rows[1].split(" | ")[2] == "0/10"
    assert "within 0.0001" in out
    # a tolerance no rounding meets: the check fails, so it can
    assert fraction_check.main(["--steps", "3", "--fractions", "0", "--no_ranks",
                                "--tolerance", "0"]) == 1
