"""`hf-zoffload config`: the wizard through a real pseudo-terminal, and `--default`."""

import inspect
import os
import sys
from pathlib import Path

import pytest
import yaml

from hf_zoffload.commands import config
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
    # the common path; on CPU processes no offload_fraction (nor, below, pinned buffers or
    # kernels), and no master_dtype with fp16 compute
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
    child.expect(r"\(fp32/compute\)\? \[fp32\]: ")
    child.sendline("")  # the default: not written
    child.expect(r"advanced settings .*\? \[yes/NO\]: ")
    child.sendline("yes")
    child.expect(r"MiB.*\? \[32.0\]: ")
    child.sendline("-1")
    child.expect(r"'bucket_size_mb': '-1' is not allowed; must be > 0.0")
    child.expect(r"MiB.*\? \[32.0\]: ")
    child.sendline("8")
    child.expect(r"delayed parameter update.*\[yes/NO\]: ")
    child.sendline("yes")
    child.expect(r"without delay first\? \[40\]: ")
    child.sendline("5")
    child.expect(r"CPU threads.*\[0\]: ")
    child.sendline("?")  # help, then the same question
    child.expect(r"cpu_threads: threads for the CPU-Adam")
    child.expect(r"CPU threads.*\[0\]: ")
    child.sendline("2")
    child.expect(r"physical cores\? \[YES/no\]: ")
    child.sendline("no")
    child.expect(r"global gradient norm.*\? \[0.0\]: ")
    child.sendline("1.0")
    child.expect(r"non-finite loss or gradient norm \(0: never\)\? \[3\]: ")
    child.sendline("5")
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
    chosen = dict(compute_dtype="fp16", bucket_size_mb=8, delayed_update=True,
                  delayed_update_warmup_steps=5, cpu_threads=2, bind_cores=False,
                  state_dtype="bf16", host_memory_limit="48gib", max_grad_norm=1.0,
                  max_nonfinite_steps=5, init_scale=1024, backoff_factor=0.25,
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
    enabled, plugin, chosen, fsdp2 = config.ask_offload(mixed_precision="bf16", on_gpu=True)
    assert enabled is False and chosen == [] and plugin == ZeroOffloadPlugin()
    assert fsdp2 is False


def test_wizard_follows_accelerates_mixed_precision(monkeypatch, capsys):
    """accelerate's fp16/bf16 is the compute dtype: not asked, not written (a different one
    would be refused by prepare_zero_offload)."""
    from hf_zoffload.commands import config

    prompts = []
    answers = iter(["yes", "", "", "", "compute", ""])  # state, master, host, save, advanced

    def answer(prompt=""):
        prompts.append(prompt)
        return next(answers)

    monkeypatch.setattr("builtins.input", answer)
    enabled, plugin, chosen, _ = config.ask_offload(mixed_precision="bf16")
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


# ------------------------------------------------------------ FSDP2 parameter offload
_ASK = config._Asker.__call__


def _wizard(monkeypatch, replies: dict, **kw) -> tuple[list[str], list[str]]:
    """`ask_offload` with each prompt answered by the first of ``replies`` (prompt fragment
    -> answer) it contains, else the default; (the settings asked, the prompts)."""
    from hf_zoffload.commands import config

    asked, prompts = [], []
    ask = _ASK  # the class's own, not an earlier call's wrapper
    monkeypatch.setattr(config._Asker, "__call__", lambda self, name, question, default=None: (
        asked.append(name), ask(self, name, question, default))[1])

    def answer(prompt=""):
        prompts.append(prompt)
        return next((a for k, a in replies.items() if k in prompt), "")

    monkeypatch.setattr("builtins.input", answer)
    assert config.ask_offload(**kw)[0]
    return asked, prompts


OPEN_ALL = {"use ZeRO-Offload": "yes", "stay on the host": "auto", "advanced": "yes",
            "delayed parameter update": "yes", "loss scaler": "yes"}


def test_the_wizard_asks_every_setting(monkeypatch):
    """Issue 35, item 7: master_dtype, bind_cores, kernels and max_grad_norm were never
    asked. With every group opened, a bf16 run and an fp16 run on GPUs ask them all."""
    bf16, _ = _wizard(monkeypatch, OPEN_ALL, mixed_precision="bf16", on_gpu=True)
    fp16, _ = _wizard(monkeypatch, OPEN_ALL, mixed_precision="fp16", on_gpu=True)
    fp32, _ = _wizard(monkeypatch, {**OPEN_ALL, "dtype should the parameters": "fp32"},
                      on_gpu=True)
    assert "master_dtype" in bf16 and "master_dtype" not in fp16  # a bf16 master: bf16 only
    assert "init_scale" in fp16 and "init_scale" not in bf16
    assert "compute_dtype" in fp32  # accelerate's "no": the one run that asks it
    assert set(bf16) | set(fp16) | set(fp32) == set(ZeroOffloadPlugin.names())
    # the common path stays short: the advanced group and the scaler unopened
    short, _ = _wizard(monkeypatch, {"use ZeRO-Offload": "yes"}, mixed_precision="bf16",
                       on_gpu=True)
    assert short == ["state_dtype", "master_dtype", "host_memory_limit", "offload_fraction",
                     "save_dtype"]


def test_a_cpu_only_config_asks_no_gpu_question(monkeypatch):
    asked, prompts = _wizard(monkeypatch, OPEN_ALL, mixed_precision="fp16")
    for name in ("pin_memory", "kernels", "offload_fraction", "device_memory_limit"):
        assert name not in asked, name
    assert not any("GPU" in p or "CUDA" in p for p in prompts), prompts
    assert {"bind_cores", "max_grad_norm", "max_nonfinite_steps", "cpu_threads"} <= set(asked)


DEEP_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=999)


def _answers(monkeypatch, *answers):
    """Feed ``answers`` to the questions in turn; the prompts asked, in order."""
    prompts, left = [], iter(answers)

    def answer(prompt=""):
        prompts.append(prompt)
        return next(left)

    monkeypatch.setattr("builtins.input", answer)
    return prompts


def _deep_llama(tmp_path) -> str:
    from transformers import LlamaConfig

    LlamaConfig(**DEEP_LLAMA).save_pretrained(tmp_path / "deep")
    return str(tmp_path / "deep")


def test_wizard_proposes_fsdp2_offload_when_the_weights_do_not_fit(monkeypatch, capsys,
                                                                    tmp_path):
    """On GPUs: the model and the GPU's memory; optimizer offload alone would need more than
    the GPU has, FSDP2 parameter offload less (what `estimate --fsdp2_offload` counts): the
    proposal, taken by default; then offload_fraction is not asked (it must stay 1)."""
    from hf_zoffload.commands import config

    model = _deep_llama(tmp_path)
    needs = config.gpu_needs(model, ZeroOffloadPlugin(compute_dtype="bf16"))
    assert needs["fsdp2_offload"] < needs["zero_offload"]
    gpu = f"{needs['fsdp2_offload']}B"
    # yes (ZeRO-Offload), the model, the GPU, "" (FSDP2: yes), then the defaults
    prompts = _answers(monkeypatch, "yes", model, gpu, "", *[""] * 7)
    enabled, plugin, chosen, fsdp2 = config.ask_offload(mixed_precision="bf16", on_gpu=True)
    assert enabled and fsdp2 and chosen == []
    out = capsys.readouterr().out
    assert "with optimizer offload alone the GPU would hold" in out
    assert "FSDP2 parameter offload keeps the weights on the host too" in out
    assert "of model states)." in out  # fits
    assert any(config.TRAINER_FLAGS in p for p in prompts)
    assert config.TRAINER_FLAGS == ('--fsdp --fsdp_config \'{"version": 2, "cpu_offload": '
                                    'true}\' --zero_offload')  # not the deprecated string
    assert not any("stay on the host" in p for p in prompts)
    assert "offload_fraction stays 1" in out
    # "no": optimizer offload alone, and offload_fraction is asked as before
    prompts = _answers(monkeypatch, "yes", model, gpu, "no", *[""] * 8)
    assert config.ask_offload(mixed_precision="bf16", on_gpu=True)[3] is False
    assert any("stay on the host" in p for p in prompts)
    # a GPU smaller than even that: still proposed (the most it saves), and said so
    _answers(monkeypatch, "yes", model, "1KiB", "no", *[""] * 8)
    config.ask_offload(mixed_precision="bf16", on_gpu=True)
    assert "of model states: that does not fit either)." in capsys.readouterr().out


def test_wizard_does_not_propose_fsdp2_offload_where_the_gpu_holds_the_model(monkeypatch,
                                                                              capsys, tmp_path):
    from hf_zoffload.commands import config

    model = _deep_llama(tmp_path)
    # fits: said so, no proposal; skipped (empty model); a typo asked again
    prompts = _answers(monkeypatch, "yes", model, "80GiB", *[""] * 8)
    assert config.ask_offload(mixed_precision="bf16", on_gpu=True)[3] is False
    assert "that fits 80.00 GiB" in capsys.readouterr().out
    assert not any("Use FSDP2" in p for p in prompts)
    prompts = _answers(monkeypatch, "yes", "", *[""] * 8)
    assert config.ask_offload(mixed_precision="bf16", on_gpu=True)[3] is False
    assert not any("How much memory" in p for p in prompts)
    prompts = _answers(monkeypatch, "yes", str(tmp_path / "nothing"), "7B", "24", "24GiB",
                       *[""] * 8)
    assert config.ask_offload(mixed_precision="bf16", on_gpu=True)[3] is False
    out = capsys.readouterr().out
    assert "is neither a local config nor in the local cache (nothing is downloaded)" in out
    assert "expected a number with a unit" in out  # "24", asked again
    assert "7,000,000,000 params): that fits 24.00 GiB" in out
    # a bare count that does not fit: proposed without the FSDP2 figure (no layers known)
    _answers(monkeypatch, "yes", "70B", "80GiB", "yes", *[""] * 7)
    assert config.ask_offload(mixed_precision="bf16", on_gpu=True)[3] is True
    assert "give the model's config to see what the GPU then holds" in capsys.readouterr().out
    # a model whose root group outweighs two layers: streaming them saves nothing
    shallow = tmp_path / "shallow"
    from transformers import LlamaConfig

    LlamaConfig(**{**DEEP_LLAMA, "num_hidden_layers": 2}).save_pretrained(shallow)
    prompts = _answers(monkeypatch, "yes", str(shallow), "1KiB", *[""] * 8)
    assert config.ask_offload(mixed_precision="bf16", on_gpu=True)[3] is False
    assert "no gain, so it is not proposed" in capsys.readouterr().out
    assert not any("Use FSDP2" in p for p in prompts)
    # CPU processes (accelerate's "CPU only"): no model question at all
    prompts = _answers(monkeypatch, "yes", *[""] * 8)
    config.ask_offload(mixed_precision="bf16")
    assert not any("Which model" in p for p in prompts)


def _cluster(**fields):
    from accelerate.commands.config.config_args import ClusterConfig

    return ClusterConfig(**{"compute_environment": "LOCAL_MACHINE",
                            "distributed_type": "MULTI_GPU", "mixed_precision": "bf16",
                            "use_cpu": False, "debug": False, "num_processes": 2, **fields})


def test_wizard_writes_accelerates_fsdp2_plugin_with_parameter_offload(monkeypatch, capsys,
                                                                        tmp_path):
    """Taken: accelerate's yaml gets its FSDP plugin, version 2 with parameter offload
    (accelerate's own defaults beside), which accelerate's loader reads back; the Trainer's
    flags are printed."""
    from accelerate.commands.config import config as acc_config
    from accelerate.commands.config.config_args import load_config_from_file

    monkeypatch.setattr(acc_config, "get_user_input", lambda: _cluster())
    _answers(monkeypatch, "yes", "70B", "80GiB", "", *[""] * 7)
    cfg = tmp_path / "acc.yaml"
    assert main(["config", "--config_file", str(cfg)]) == 0
    loaded = load_config_from_file(str(cfg))
    assert loaded.distributed_type == "FSDP"
    assert loaded.fsdp_config["fsdp_version"] == 2 and loaded.fsdp_config["fsdp_offload_params"]
    assert loaded.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    # what integrations/fsdp2.py trains: whole-tensor checkpoints, every rank loading
    assert loaded.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    assert loaded.fsdp_config["fsdp_cpu_ram_efficient_loading"] is False
    config.check_fsdp(loaded.fsdp_config)
    out = capsys.readouterr().out
    assert f"with the Trainer pass {config.TRAINER_FLAGS}" in out
    assert f"`hf-zoffload estimate --config_file {cfg} MODEL` counts it" in out
    # and it does: the config written turns estimate's mode on
    from hf_zoffload.commands.estimate import fsdp2_layout

    args = type("Args", (), {"fsdp2_offload": False, "config_file": str(cfg)})()
    assert fsdp2_layout(args) == (True, str(cfg))
    side = yaml.safe_load(Path(sidecar_path(str(cfg))).read_text())
    assert side == {"zero_offload": True, "zoffload": {}}  # nothing of FSDP2 in ours


@pytest.mark.parametrize("fsdp, said", [
    ({"fsdp_version": 1, "fsdp_offload_params": True},
     "accelerate's answers: FSDP version 1 with parameter offload"),
    ({"fsdp_version": 2, "fsdp_offload_params": False},
     "accelerate's answers: FSDP version 2 without parameter offload"),
    ({"fsdp_version": 2, "fsdp_offload_params": True},  # accelerate's default for FSDP2
     "accelerate's answers: FSDP2 with state_dict_type SHARDED_STATE_DICT"),
    ({"fsdp_version": 2, "fsdp_offload_params": True, "fsdp_state_dict_type": "FULL_STATE_DICT",
      "fsdp_cpu_ram_efficient_loading": True},
     "accelerate's answers: FSDP2 with cpu_ram_efficient_loading"),
])
def test_wizard_refuses_an_fsdp_zero_offload_cannot_train(fsdp, said, monkeypatch, capsys,
                                                          tmp_path):
    """accelerate's answers chose another FSDP: with ZeRO-Offload on, one line before our
    other questions, nothing written; with it off, nothing to refuse. FSDP2 with parameter
    offload chosen there is taken as it is (not asked)."""
    from accelerate.commands.config import config as acc_config

    monkeypatch.setattr(acc_config, "get_user_input",
                        lambda: _cluster(distributed_type="FSDP", fsdp_config=fsdp))
    prompts = _answers(monkeypatch, "yes")
    cfg = tmp_path / "acc.yaml"
    assert main(["config", "--config_file", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
    assert len(prompts) == 1 and not cfg.exists()
    _answers(monkeypatch, "no")
    assert main(["config", "--config_file", str(cfg)]) == 0 and cfg.exists()
    cfg.unlink()
    monkeypatch.setattr(acc_config, "get_user_input", lambda: _cluster(
        distributed_type="FSDP", fsdp_config={"fsdp_version": 2, "fsdp_offload_params": True,
                                              "fsdp_state_dict_type": "FULL_STATE_DICT"}))
    prompts = _answers(monkeypatch, "yes", *[""] * 7)
    assert main(["config", "--config_file", str(cfg)]) == 0
    assert not any("Which model" in p or "stay on the host" in p for p in prompts)
    assert "FSDP2 parameter offload, as accelerate's answers say" in capsys.readouterr().out
