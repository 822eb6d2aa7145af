"""Compact Adam moments train as well as fp32 ones, through
scripts/bench/fidelity_state_dtype.py: the quickstart model, 300 steps from scratch, same seed,
and a fine-tune (200 more steps at a tenth of the learning rate from the fp32 run's weights);
final loss of bf16 within 1% of fp32, int8 and int4 within 2% (about 5 min on 2 idle cores)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_compact_moments_track_fp32():
    script = ROOT / "scripts" / "bench" / "fidelity_state_dtype.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=6000)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "| 300 |" in text and "| 200 |" in text and "FAILED" not in text
    for mode in ("bf16", "int8", "int4"):
        assert text.count(f"final loss {mode} vs fp32") == 2, mode  # both scenarios
