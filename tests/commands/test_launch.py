"""`hf-zoffload launch`: settings carried to the script by environment variables."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_zoffload.commands.launch import _strip_own, find_sidecar, launch_env
from hf_zoffload.commands.main import main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "train_accelerate.py")


@pytest.fixture(autouse=True)
def no_zoffload_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)


def _configs(tmp_path, **section):
    """accelerate's yaml written by `hf-zoffload config --default`, our sidecar beside it."""
    cfg = tmp_path / "acc.yaml"
    assert main(["config", "--default", "--config_file", str(cfg)]) == 0
    side = tmp_path / "acc_zoffload.yaml"
    side.write_text(yaml.safe_dump({"zero_offload": True, "zoffload": section}))
    return cfg, side


def test_strip_own_leaves_the_script_args_alone():
    argv = ["--zoffload_config", "a.yaml", "--num_processes", "1", "--zoffload_config=b",
            "s.py", "--zoffload_config", "kept"]
    assert _strip_own(argv, 3) == ["--num_processes", "1", "s.py", "--zoffload_config", "kept"]


def test_find_sidecar_order(tmp_path):
    cfg, side = _configs(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text("zoffload: {}\n")
    assert find_sidecar(zoffload_config=None, config_file=str(cfg), environ={}) == str(side)
    assert find_sidecar(zoffload_config=None, config_file=str(cfg),
                        environ={"HF_ZOFFLOAD_CONFIG": str(other)}) == str(other)
    assert find_sidecar(zoffload_config=str(other), config_file=str(cfg),
                        environ={"HF_ZOFFLOAD_CONFIG": "x"}) == str(other)
    assert find_sidecar(zoffload_config=None, config_file=str(tmp_path / "none.yaml"),
                        environ={}) is None
    with pytest.raises(ValueError, match="^--zoffload_config=.*no.yaml: no such file"):
        find_sidecar(zoffload_config=str(tmp_path / "no.yaml"), config_file=None, environ={})
    with pytest.raises(ValueError, match="^HF_ZOFFLOAD_CONFIG=.*no.yaml: no such file"):
        find_sidecar(zoffload_config=None, config_file=None,
                     environ={"HF_ZOFFLOAD_CONFIG": str(tmp_path / "no.yaml")})


def test_launch_env_merges_sidecar_below_the_callers_env(tmp_path):
    _, side = _configs(tmp_path, bucket_size_mb=4, cpu_threads=3)
    env = launch_env(str(side), {"HF_ZOFFLOAD_CPU_THREADS": "1", "PATH": "/bin"})
    assert env["HF_ZOFFLOAD_BUCKET_SIZE_MB"] == "4.0"  # from the sidecar
    assert env["HF_ZOFFLOAD_CPU_THREADS"] == "1"  # the caller's variable wins
    assert env["HF_ZOFFLOAD_ENABLED"] == "true" and env["HF_ZOFFLOAD_CONFIG"] == str(side)
    assert env["PATH"] == "/bin"
    # nothing else: a setting nobody set keeps following its default (and the compute dtype
    # accelerate's mixed_precision / the Trainer's --fp16/--bf16) in the processes
    assert {k for k in env if k.startswith("HF_ZOFFLOAD_")} == {
        "HF_ZOFFLOAD_BUCKET_SIZE_MB", "HF_ZOFFLOAD_CPU_THREADS", "HF_ZOFFLOAD_ENABLED",
        "HF_ZOFFLOAD_CONFIG"}
    side.write_text(yaml.safe_dump({"zero_offload": False, "zoffload": {}}))
    assert launch_env(str(side), {})["HF_ZOFFLOAD_ENABLED"] == "false"


def test_bad_setting_fails_before_any_process_starts(tmp_path, capsys):
    cfg, _ = _configs(tmp_path, bucket_size_mb=0)
    rc = main(["launch", "--config_file", str(cfg), "does_not_exist.py"])
    assert rc == 2
    assert "'bucket_size_mb': 0 is not allowed; must be > 0.0" in capsys.readouterr().err


def test_default_sidecar_exports_no_compute_dtype(tmp_path):
    """`config --default` writes the switch only, so `launch ... --fp16` meets no compute
    dtype the user never chose (issue 15, item 1)."""
    cfg = tmp_path / "acc.yaml"
    assert main(["config", "--default", "--config_file", str(cfg)]) == 0
    env = launch_env(find_sidecar(zoffload_config=None, config_file=str(cfg), environ={}), {})
    assert env["HF_ZOFFLOAD_ENABLED"] == "true"
    assert not {k for k in env if k.startswith("HF_ZOFFLOAD_")} - {
        "HF_ZOFFLOAD_ENABLED", "HF_ZOFFLOAD_CONFIG"}


@pytest.mark.parametrize("problem, message", [
    ("missing", "hf-zoffload launch: error: ValueError: --zoffload_config={path}: no such file"),
    ("yaml", "hf-zoffload launch: error: ValueError: {path}: not valid YAML at line 3"),
    ("triton", "hf-zoffload launch: error: ValueError: ZeRO-Offload setting 'kernels': "
               "'triton' needs a CUDA device, and this run's device is cpu"),
])
def test_launch_errors_are_one_line(tmp_path, capsys, monkeypatch, problem, message):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the suite's interpreter mode
    path = tmp_path / "side_zoffload.yaml"
    if problem == "yaml":
        path.write_text("zoffload:\n  cpu_threads: [1\n")
    elif problem == "triton":
        path.write_text("zoffload: {kernels: triton}\n")
    rc = main(["launch", "--cpu", "--zoffload_config", str(path), "never_started.py"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(message.format(path=path)), err
    assert len(err.strip().splitlines()) == 1


def test_launch_help_shows_every_option(capsys):
    """accelerate's help formatter hid every option not on the command line."""
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: hf-zoffload launch")
    for option in ("--config_file", "--zoffload_config", "--cpu", "--multi_gpu",
                   "--num_processes", "--mixed_precision", "--main_process_port"):
        assert f"  {option}" in text, option


def _launch(tmp_path, cfg, *args, env_extra=None):
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_ZOFFLOAD_")}
    env.update(PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"), **(env_extra or {}))
    cmd = [sys.executable, "-m", "hf_zoffload.commands.main", "launch", "--config_file",
           str(cfg), *args, SCRIPT, "--zero_offload", "--steps", "3", "--output_json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return proc, out


@pytest.mark.slow
def test_two_processes_train_without_ddp(tmp_path):
    """accelerate launch with 2 CPU processes (gloo): the sidecar's settings reach both, the
    caller's variable above them; the engine partitions the host state and reduces the grads
    itself, so the model must reach the loop unwrapped. (One process, `hf-zoffload launch`
    as the README writes it: tests/acceptance/test_readme.py's test_commands_snippet.)"""
    cfg, _ = _configs(tmp_path, compute_dtype="fp32", bucket_size_mb=0.25, cpu_threads=2)
    proc, out = _launch(tmp_path, cfg, "--multi_gpu", "--num_processes", "2",
                        "--main_process_port", str(_free_port()),
                        env_extra={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                                   "HF_ZOFFLOAD_CPU_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO-Offload enabled; settings from" in proc.stderr
    result = json.loads(out.read_text())
    assert result["zero_offload"] and result["world_size"] == 2
    assert result["zoffload"]["compute_dtype"] == "fp32"
    assert result["zoffload"]["bucket_size_mb"] == 0.25
    assert result["zoffload"]["cpu_threads"] == 1
    assert result["model_class"] == "GPT2LMHeadModel"  # no DistributedDataParallel
    # accelerate 1.15 on CPUs reports distributed_type NO here and does not shard the
    # loader: each rank sees all 6 micro-batches
    assert len(result["losses"]) in (3, 6) and all(0 < x < 10 for x in result["losses"])
    assert result["losses"][-1] < result["losses"][0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
