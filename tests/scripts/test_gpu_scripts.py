"""The GPU measurement scripts (scripts/bench/gpu_size.py, gpu_practicality.py, gpu_peers.py)
as scripts/gpu_check.sh runs them, checked where there is no GPU: each is a script that runs
its main, has --help, and refuses to run without CUDA, saying so. (Their logic:
tests/scripts/test_gpu_size.py and test_gpu_practicality.py; the gpu checks themselves are
tests under tests/gpu/.)

CUDA_VISIBLE_DEVICES="" hides any GPU from the subprocesses, so this holds on a GPU machine too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._env import cpu_only_env

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"
sys.path.insert(0, str(BENCH))  # the measurement scripts import their siblings as a script does
try:
    import gpu_peers
    import gpu_practicality
    import gpu_size
finally:
    sys.path.remove(str(BENCH))

GPU_SCRIPTS = ["gpu_size.py", "gpu_practicality.py", "gpu_peers.py"]


@pytest.mark.slow
def test_a_gpu_script_run_without_cuda_exits_1_saying_so(tmp_path):
    """From the command line, as gpu_check.sh runs it (one script: each costs ~6 s of imports
    on 2 cores; the in-process test below covers every script's main())."""
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_practicality.py")],
                          cwd=tmp_path, env=cpu_only_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "gpu_practicality.py: CUDA is needed: torch " in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_each_gpu_script_runs_main_as_a_script(name):
    text = (BENCH / name).read_text()
    assert text.startswith("#!/usr/bin/env python\n")
    assert text.rstrip().endswith('if __name__ == "__main__":\n    sys.exit(main())')


@pytest.mark.parametrize("module", [gpu_size, gpu_practicality, gpu_peers])
def test_help_and_in_process_refusal(module, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        module.parse_args(["--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA is needed"):
        module.main([])
