"""Compact Adam moments train as well as fp32 ones: the quickstart model, 300 steps, same
seed, through scripts/bench/fidelity_state_dtype.py (bf16 final loss within 1% of fp32, int8
within 2%; about 2 min on 2 cores)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bf16_and_int8_moments_track_fp32():
    script = ROOT / "scripts" / "bench" / "fidelity_state_dtype.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=3000)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "| 300 |" in text and "final loss int8 vs fp32" in text and "FAILED" not in text
