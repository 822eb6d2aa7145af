"""A configuration error is one line on stderr and exit status 2 at every entry point: the
`hf-zoffload` subcommands, scripts/run_clm.py (tests/acceptance/test_run_clm.py) and
scripts/train_accelerate.py, through one helper (commands/errors.py)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zoffload.commands.errors import TRACEBACK_ENV, run_command
from hf_zoffload.commands.main import main

ROOT = Path(__file__).resolve().parents[2]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_run_command_reports_configuration_errors_only(capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)

    def bad():
        raise ValueError("setting 'x': 3 is not allowed;\n  allowed: 1, 2")

    assert run_command("prog", bad) == 2
    assert _one_line(capsys.readouterr().err) == \
        "prog: error: ValueError: setting 'x': 3 is not allowed; allowed: 1, 2"
    assert run_command("prog", lambda: 7) == 7 and run_command("prog", lambda: {"a": 1}) == 0

    def bug():
        raise RuntimeError("internal")

    with pytest.raises(RuntimeError, match="internal"):  # a bug keeps its traceback
        run_command("prog", bug)
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(ValueError, match="not allowed"):
        run_command("prog", bad)


def test_subcommands_share_it(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    assert main(["estimate", "--params", "7B", "--gpu_memory", "24"]) == 2
    assert _one_line(capsys.readouterr().err).startswith(
        "hf-zoffload estimate: error: ValueError: --gpu_memory '24': expected a number")
    cfg = tmp_path / "sub" / "acc.yaml"
    assert main(["config", "--config_file", str(cfg), "--mixed_precision", "bf16"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "hf-zoffload config: error: ValueError: --mixed_precision only applies with "
        "--default (the interactive questions ask for it)")
    assert not (tmp_path / "sub").exists()  # refused before anything was written
    assert main(["launch", "--cpu", "--zoffload_config", str(tmp_path / "none.yaml"),
                 "never_started.py"]) == 2
    assert _one_line(capsys.readouterr().err).startswith(
        "hf-zoffload launch: error: ValueError: --zoffload_config=")
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(ValueError, match="expected a number"):
        main(["estimate", "--params", "7B", "--gpu_memory", "24"])


def _train_accelerate():
    spec = importlib.util.spec_from_file_location("train_accelerate",
                                                  ROOT / "scripts" / "train_accelerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_accelerate_refuses_before_starting(capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    script = _train_accelerate()
    assert run_command("train_accelerate.py", lambda: script.main(["--model_type", "gpt3"])) == 2
    assert _one_line(capsys.readouterr().err) == (
        "train_accelerate.py: error: ValueError: unknown --model_type 'gpt3'; allowed: the "
        "transformers model types, e.g. gpt2, llama")
    assert run_command("train_accelerate.py", lambda: script.main(
        ["--config_overrides", "n_layer=1,no_such_key=2"])) == 2
    assert _one_line(capsys.readouterr().err).startswith(
        "train_accelerate.py: error: ValueError: ")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HF_ZOFFLOAD_") and k != TRACEBACK_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return dict(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)


@pytest.mark.slow  # two processes that import torch and transformers
def test_the_scripts_exit_2_with_one_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "train_accelerate.py"), "--zero_offload"]
    proc = subprocess.run(cmd, env=_env(HF_ZOFFLOAD_BUCKET_SIZE_MB="-1"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _one_line(proc.stderr).startswith(
        "train_accelerate.py: error: ValueError: HF_ZOFFLOAD_BUCKET_SIZE_MB='-1': ZeRO-Offload "
        "setting 'bucket_size_mb': '-1' is not allowed"), proc.stderr
    # a subcommand whose error comes before any heavy import (0.2 CPU-s, estimate's 5)
    proc = subprocess.run(
        [sys.executable, "-m", "hf_zoffload.commands.main", "config", "--config_file",
         str(tmp_path / "acc.yaml"), "--mixed_precision", "bf16"],
        env=_env(**{TRACEBACK_ENV: "1"}), cwd=tmp_path, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert "ValueError: --mixed_precision only applies with --default" in proc.stderr
