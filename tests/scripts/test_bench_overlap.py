"""scripts/bench/bench_overlap.py on a few steps: its tables come out whole, and what they
state about the overlapped schedule holds (bitwise where speculation held, within the
derived bound where it was corrected, the same fp16 skips)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = str(Path(__file__).resolve().parents[2] / "scripts" / "bench")
sys.path.insert(0, BENCH)
try:
    import bench_overlap
finally:
    sys.path.remove(BENCH)


def _rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and "---" not in line]


@pytest.mark.slow
def test_fidelity_rows_hold_what_they_say(capsys):
    """4 steps, an inf every 2nd step in fp16: the skips equal, held steps bitwise, every
    corrected step within its bound."""
    assert bench_overlap.main(["fidelity", "--steps", "4", "--inf_every", "2", "--batch", "2",
                               "--seq", "32"]) == 0
    header, *rows = _rows(capsys.readouterr().out)
    assert header[0] == "run" and len(rows) == 2
    for _run, steps, _hit, skips, _free, control, lock, share in rows:
        assert steps == "4"
        held, corrected = lock.split(" / ")
        assert held == "0 ulp"
        assert float(share) <= 1.0
        assert float(control) >= 0.0
        assert skips.endswith("(True)")
        assert int(corrected.split("(")[1].rstrip(")")) >= 1  # something was corrected
    assert rows[1][3] == "2 (True)"  # fp16: the two poisoned steps skipped, both ways


def test_timing_row_on_the_quickstart_model(capsys):
    assert bench_overlap.main(["timing", "--models", "quickstart", "--rounds", "1",
                               "--batch", "1", "--seq", "16"]) == 0
    header, row = _rows(capsys.readouterr().out)
    assert header[0] == "model" and row[0] == "quickstart"
    assert float(row[4]) > 0 and 0.0 <= float(row[5]) <= 1.0
