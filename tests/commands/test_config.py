"""`hf-zoffload config`: the wizard through a real pseudo-terminal, and `--default`."""

import inspect
import os
import sys
from pathlib import Path

import pytest
import yaml

from hf_zoffload.commands.config import sidecar_path
from hf_zoffload.commands.main import main
from hf_zoffload.config import ZeroOffloadPlugin

pexpect = pytest.importorskip("pexpect")
ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_ZOFFLOAD_")}
    env.update(PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"), TERM="xterm")
    return env


def _accelerate_questions(child):
    """Answer accelerate's own questions with its defaults, except 'CPU only' (yes: fewer
    questions, the same on every machine); stop at our first question."""
    while True:
        i = child.expect([r"select a choice[^\n]*\n", r"CPU only[^\n]*:",
                          r"\[[^][\n]*\]:", r"use ZeRO-Offload"])
        if i == 0:  # a bullet menu: enter takes the highlighted default
            child.send("\r")
        elif i == 1:
            child.sendline("yes")
        elif i == 2:
            child.sendline("")
        else:
            return


@pytest.mark.slow
def test_wizard_writes_both_yamls_and_reasks_wrong_answers(tmp_path):
    cfg = tmp_path / "acc.yaml"
    child = pexpect.spawn(sys.executable, ["-m", "hf_zoffload.commands.main", "config",
                                           "--config_file", str(cfg)],
                          env=_env(tmp_path), encoding="utf-8", timeout=60,
                          dimensions=(50, 200))
    _accelerate_questions(child)
    child.expect(r"\[YES/no\]: ")
    child.sendline("")  # enable: the default, yes
    # accelerate's mixed_precision is "no": the default offered is fp32, as the stock run's
    child.expect(r"mixed_precision is 'no'.*\(fp32/bf16/fp16\)\? \[fp32\]: ")
    child.sendline("fp8")
    child.expect(r"'compute_dtype': 'fp8' is not allowed; allowed: fp16, bf16, fp32")
    child.expect(r"\(fp32/bf16/fp16\)\? \[fp32\]: ")  # asked again
    child.sendline("fp16")
    child.expect(r"MiB.*\? \[32.0\]: ")
    child.sendline("-1")
    child.expect(r"'bucket_size_mb': '-1' is not allowed; must be > 0.0")
    child.expect(r"MiB.*\? \[32.0\]: ")
    child.sendline("8")
    child.expect(r"pinned.*\[YES/no\]: ")
    child.sendline("no")
    child.expect(r"delayed parameter update.*\[yes/NO\]: ")
    child.sendline("yes")
    child.expect(r"without delay first\? \[40\]: ")
    child.sendline("5")
    child.expect(r"CPU threads.*\[0\]: ")
    child.sendline("?")  # help, then the same question
    child.expect(r"cpu_threads: threads for the CPU-Adam")
    child.expect(r"CPU threads.*\[0\]: ")
    child.sendline("2")
    child.expect(r"Adam moments \(fp32/bf16/int8/int4\)\? \[fp32\]: ")
    child.sendline("int2")
    child.expect(r"'state_dtype': 'int2' is not allowed; allowed: fp32, bf16, int8, int4")
    child.expect(r"Adam moments \(fp32/bf16/int8/int4\)\? \[fp32\]: ")
    child.sendline("bf16")
    child.expect(r"optimizer state, with a unit .*\? \[0\]: ")
    child.sendline("48")  # no unit
    child.expect(r"host_memory_limit.*expected a number with a unit")
    child.expect(r"optimizer state, with a unit .*\? \[0\]: ")
    child.sendline("48GiB")
    child.expect(r"stay on the host, from 0 to 1 .*\? \[1\]: ")
    child.sendline("1.5")
    child.expect(r"'offload_fraction': '1.5' is not allowed; allowed: a number from 0 to 1")
    child.expect(r"stay on the host, from 0 to 1 .*\? \[1\]: ")
    child.sendline("auto")
    child.expect(r"GPU memory may auto plan with.*\? \[0\]: ")
    child.sendline("40GiB")
    child.expect(r"\(fp32/compute\)\? \[fp32\]: ")
    child.sendline("")  # the default: not written
    child.expect(r"loss scaler\? \[yes/NO\]: ")
    child.sendline("yes")
    child.expect(r"Initial loss scale\? \[65536.0\]: ")
    child.sendline("1024")
    child.expect(r"growth factor.*\[2.0\]: ")
    child.sendline("")
    child.expect(r"backoff factor.*\[0.5\]: ")
    child.sendline("1.5")  # the range lives in ZeroOffloadPlugin too
    child.expect(r"'backoff_factor': '1.5' is not allowed; must be < 1.0")
    child.expect(r"backoff factor.*\[0.5\]: ")
    child.sendline("0.25")
    for answer in ("100", "1", ""):  # growth_interval, hysteresis, min_scale
        child.expect(r"\]: ")
        child.sendline(answer)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before

    side = yaml.safe_load(Path(sidecar_path(str(cfg))).read_text())
    assert Path(sidecar_path(str(cfg))) == tmp_path / "acc_zoffload.yaml"
    assert side["zero_offload"] is True
    chosen = dict(compute_dtype="fp16", bucket_size_mb=8, pin_memory=False, delayed_update=True,
                  delayed_update_warmup_steps=5, cpu_threads=2, state_dtype="bf16",
                  host_memory_limit="48gib", offload_fraction="auto",
                  device_memory_limit="40gib", init_scale=1024, backoff_factor=0.25,
                  growth_interval=100, hysteresis=1)
    # only the answers that differ from the default offered: a default written would pin it
    assert side["zoffload"] == ZeroOffloadPlugin(**chosen).to_dict(chosen)
    # accelerate's yaml has accelerate's keys only, and its own loader (the one `accelerate
    # launch --config_file` uses) still reads it
    from accelerate.commands.config.config_args import load_config_from_file

    acc = yaml.safe_load(cfg.read_text())
    assert not {"zero_offload", "zoffload"} & set(acc)
    loaded = load_config_from_file(str(cfg))
    assert (loaded.use_cpu, loaded.num_processes, loaded.distributed_type) == (True, 1, "NO")


def test_wizard_disabled_asks_nothing_more(monkeypatch):
    from hf_zoffload.commands import config

    answers = iter(["no"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    enabled, plugin, chosen = config.ask_offload(mixed_precision="bf16")
    assert enabled is False and chosen == [] and plugin == ZeroOffloadPlugin()


def test_wizard_follows_accelerates_mixed_precision(monkeypatch, capsys):
    """accelerate's fp16/bf16 is the compute dtype: not asked, not written (a different one
    would be refused by prepare_zero_offload)."""
    from hf_zoffload.commands import config

    prompts = []
    answers = iter(["yes", "", "", "", "", "", "", "", "compute"])

    def answer(prompt=""):
        prompts.append(prompt)
        return next(answers)

    monkeypatch.setattr("builtins.input", answer)
    enabled, plugin, chosen = config.ask_offload(mixed_precision="bf16")
    assert enabled and plugin.compute_dtype == "bf16" and plugin.save_dtype == "compute"
    assert chosen == ["save_dtype"]
    assert not any("dtype should the parameters have" in p for p in prompts)
    assert "compute in bf16 on the device, as accelerate's mixed_precision" in \
        capsys.readouterr().out


def test_default_mode(tmp_path, capsys):
    cfg = tmp_path / "sub" / "acc.yaml"
    assert main(["config", "--default", "--config_file", str(cfg),
                 "--mixed_precision", "fp16"]) == 0
    side = yaml.safe_load((tmp_path / "sub" / "acc_zoffload.yaml").read_text())
    # the switch only: the compute dtype follows accelerate's fp16 at run time
    assert side == {"zero_offload": True, "zoffload": {}}
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(cfg)).mixed_precision == "fp16"
    # existing files are kept, as `accelerate config default` keeps its own
    (tmp_path / "sub" / "acc_zoffload.yaml").write_text(
        yaml.safe_dump({"zero_offload": False, "zoffload": {}}))
    assert main(["config", "--default", "--config_file", str(cfg)]) == 0
    assert "will not override" in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "sub" / "acc_zoffload.yaml").read_text())[
        "zero_offload"] is False


def test_sidecar_path_is_beside_accelerates_yaml():
    assert sidecar_path("/a/b/default_config.yaml") == "/a/b/default_config_zoffload.yaml"
    assert sidecar_path("/a/cfg.json") == "/a/cfg_zoffload.yaml"


def test_accelerate_wizard_internals(monkeypatch):
    """The accelerate module functions the wizard reuses (not documented API): fail loudly
    here, not in a user's terminal, if an accelerate release changes them."""
    from accelerate.commands.config import config as acc_config
    from accelerate.commands.config import config_utils, default

    params = list(inspect.signature(config_utils._ask_field).parameters)
    assert params == ["input_text", "convert_value", "default", "error_message"]
    assert list(inspect.signature(acc_config.get_user_input).parameters) == []
    assert list(inspect.signature(default.write_basic_config).parameters)[:2] == \
        ["mixed_precision", "save_location"]
    # _ask_field: empty answer -> default unconverted; a raising converter -> asked again
    answers = iter(["", "x", "3"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    assert config_utils._ask_field("q", int, default=7) == 7
    assert config_utils._ask_field("q", int, default=7) == 3
