"""scripts/gpu_check.sh and the HF_ZOFFLOAD_REQUIRE_GPU switch of tests/conftest.py, checked
where there is no GPU: the script must fail fast there, never pass having tested nothing, and
under the switch a `gpu` test that does not run is a failure, not a skip.

CUDA_VISIBLE_DEVICES="" hides any GPU from the subprocesses, so this holds on a GPU machine too.
"""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

from tests._env import cpu_only_env

ROOT = Path(__file__).resolve().parents[1]
# A module whose only gpu test is test_gpu_scale_tensors_refresh_without_sync; cheap to collect.
GPU_TEST_FILE = "tests/optim/test_loss_scaler.py"


def _run_script(tmp_path, python):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path,
                          env=cpu_only_env(OUT=str(out), PYTHON=python), capture_output=True,
                          text=True, timeout=60)
    return proc, out


def test_gpu_check_fails_fast_without_cuda(tmp_path):
    proc, out = _run_script(tmp_path, sys.executable)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said
    assert "no CUDA device available" in said
    summary = (out / "summary.md").read_text()
    assert "# gpu_check: FAIL" in summary and "no CUDA device available" in summary
    assert "| env | pass |" in summary and "| cuda | fail (exit 1) |" in summary
    assert "no CUDA device available" in (out / "cuda.log").read_text()
    # nothing is built or run once the CUDA check failed
    assert sorted(p.name for p in out.iterdir()) == ["cuda.log", "env.log", "summary.md"]


def test_gpu_check_fails_without_a_python(tmp_path):
    proc, out = _run_script(tmp_path, str(tmp_path / "no-such-python"))
    assert proc.returncode != 0
    assert "no CUDA device available" in proc.stdout + proc.stderr
    assert "| cuda | fail (exit 127) |" in (out / "summary.md").read_text()


def _pytest(tmp_path, args, **env):
    xml = tmp_path / f"report{len(list(tmp_path.glob('report*.xml')))}.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={xml}",
         *args], cwd=ROOT, env=cpu_only_env(**env), capture_output=True, text=True, timeout=120)
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        skipped = case.find("skipped")
        if skipped is not None and skipped.get("type") == "pytest.xfail":
            kinds = ["xfailed"]
        outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    return proc, outcomes


def test_require_gpu_turns_the_no_cuda_skip_into_a_failure(tmp_path):
    args = [GPU_TEST_FILE, "-m", "gpu"]
    proc, outcomes = _pytest(tmp_path, args)
    assert proc.returncode == 0, proc.stdout
    assert outcomes and set(outcomes.values()) == {"skipped"}, outcomes

    proc, outcomes = _pytest(tmp_path, args, HF_ZOFFLOAD_REQUIRE_GPU="1")
    assert proc.returncode == 1, proc.stdout
    assert outcomes and set(outcomes.values()) == {"error"}, outcomes  # fails in setup
    assert "HF_ZOFFLOAD_REQUIRE_GPU=1 and no CUDA device is available" in proc.stdout


def test_require_gpu_fails_a_gpu_test_that_skips_itself(tmp_path):
    """With CUDA reported present, a skip inside a gpu test (pytest.skip, a skip mark) fails;
    xfail and the skips of tests not marked gpu are left as they are. (Without the switch
    these skips stay skips: the test above.)"""
    (tmp_path / "fake_cuda.py").write_text(
        "import torch\ntorch.cuda.is_available = lambda: True\n")
    probe = tmp_path / "test_probe.py"
    probe.write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.gpu
        def test_gpu_runs():
            pass

        @pytest.mark.gpu
        def test_gpu_skips_itself():
            pytest.skip("no luck")

        @pytest.mark.gpu
        @pytest.mark.skip(reason="marked")
        def test_gpu_skip_mark():
            pass

        @pytest.mark.gpu
        @pytest.mark.xfail(reason="known")
        def test_gpu_xfail():
            assert False

        def test_cpu_skips_itself():
            pytest.skip("fine")
    """))
    # The repo's conftest as a plugin, after the fake (-p loads in order), with its config.
    args = ["-c", "pyproject.toml", "--rootdir", str(ROOT), "-p", "fake_cuda",
            "-p", "tests.conftest", str(probe)]
    pythonpath = os.pathsep.join([str(tmp_path), str(ROOT)])
    proc, outcomes = _pytest(tmp_path, args, HF_ZOFFLOAD_REQUIRE_GPU="1", PYTHONPATH=pythonpath)
    assert proc.returncode == 1, proc.stdout
    assert outcomes == {"test_gpu_runs": "passed", "test_gpu_skips_itself": "failure",
                        "test_gpu_skip_mark": "error", "test_gpu_xfail": "xfailed",
                        "test_cpu_skips_itself": "skipped"}, outcomes
    assert "this gpu test skipped (Skipped: no luck" in proc.stdout
