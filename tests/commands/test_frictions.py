"""Issue 35, item 8: the smaller frictions of a first hour, each one line or gone."""

import logging
import os

import pytest

from hf_zoffload import ZeroOffloadPlugin
from hf_zoffload.commands.main import main
from hf_zoffload.offload import threads


@pytest.fixture(autouse=True)
def no_zoffload_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_launch_with_a_missing_config_or_script_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--config_file", "nope.yaml", "train.py"]) == 2
    assert _one_line(capsys) == (
        "hf-zoffload launch: error: FileNotFoundError: --config_file nope.yaml: no such file "
        "(accelerate's config; `hf-zoffload config --config_file nope.yaml` writes one)")
    assert main(["launch", "--cpu", "train.py", "--lr", "1"]) == 2
    assert _one_line(capsys) == (
        "hf-zoffload launch: error: FileNotFoundError: the training script train.py: no such "
        "file (-m runs a module, --no_python a command)")


def test_estimate_of_a_file_that_is_no_config_names_it(tmp_path, capsys):
    (tmp_path / "train.txt").write_text("some training text\n")
    assert main(["estimate", str(tmp_path / "train.txt")]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"hf-zoffload estimate: error: ValueError: MODEL "
                           f"{tmp_path / 'train.txt'}: not a model config"), line
    (tmp_path / "list.json").write_text("[1, 2]")  # JSON, but no config
    assert main(["estimate", "--model", str(tmp_path / "list.json")]) == 2
    assert "no known 'model_type' (None)" in _one_line(capsys)


def test_estimate_help_marks_nothing_optional_as_required(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    out = capsys.readouterr().out
    assert "(required)" not in out
    assert "--gpu_memory" in out and "say whether they fit" in out


def test_a_misspelt_plugin_keyword_says_did_you_mean():
    with pytest.raises(TypeError, match=r"^ZeroOffloadPlugin\(\) got an unexpected keyword "
                       r"argument 'state_dtyp'; allowed: compute_dtype, .*; did you mean "
                       r"'state_dtype'\?$"):
        ZeroOffloadPlugin(state_dtyp="int8")
    assert ZeroOffloadPlugin(state_dtype="int8").state_dtype == "int8"


@pytest.mark.parametrize("cores, ranks, explicit, warned", [
    (2, 2, 0, False),  # 2 ranks on 2 cores: each its fair share, no warning (it fired twice)
    (16, 1, 0, True),  # one process narrowed to 1 core of 16 (taskset): worth saying
    (16, 16, 0, False),
    (16, 1, 1, False),  # cpu_threads=1 asked for
])
def test_the_one_thread_warning_fires_only_where_more_cores_could_be_free(
        monkeypatch, caplog, cores, ranks, explicit, warned):
    monkeypatch.setattr(threads, "affinity", lambda: {0})
    monkeypatch.setattr(threads.os, "cpu_count", lambda: cores)
    env = {"LOCAL_WORLD_SIZE": str(ranks), "LOCAL_RANK": "0"}
    with caplog.at_level(logging.INFO, logger="hf_zoffload"):
        assert threads.cpu_threads(explicit, environ=env, bound=True, log=True) == 1
    (record,) = [r for r in caplog.records if "host work runs on" in r.getMessage()]
    assert (record.levelno == logging.WARNING) is warned
    assert ("one core: set cpu_threads" in record.getMessage()) is warned
