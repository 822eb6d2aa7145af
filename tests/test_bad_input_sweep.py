"""Issue 14, item 5: every setting, given a wrong type or an out-of-range value through
each source (the constructor, HF_ZOFFLOAD_<NAME>, the sidecar yaml, --zero_offload_<name>,
prepare_zero_offload's keywords), and every way the sidecar file can be wrong: one error,
on one line, naming what is wrong, before any state changes.

``python tests/test_bad_input_sweep.py`` prints the cases as a markdown table (input -> the
error's first line)."""

import os
import sys

import pytest
import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from transformers import HfArgumentParser

from hf_zoffload import prepare_zero_offload
from hf_zoffload.commands.main import main as cli
from hf_zoffload.config import ZeroOffloadPlugin, enabled_from_sources
from hf_zoffload.integrations.core import attached_engine
from hf_zoffload.integrations.trainer import ZeroOffloadTrainingArguments

# (setting, bad value, what the message must say after the setting's name)
BAD_VALUES = [
    ("compute_dtype", "fp8", "not allowed; allowed: fp16, bf16, fp32"),
    ("compute_dtype", 16, "not allowed; allowed: fp16, bf16, fp32"),
    ("bucket_size_mb", "big", "not a valid float"),
    ("bucket_size_mb", 0, "must be > 0.0"),
    ("bucket_size_mb", -4, "must be > 0.0"),
    ("bucket_size_mb", "nan", "not a valid float (a finite number)"),
    ("bucket_size_mb", "inf", "not a valid float (a finite number)"),
    ("pin_memory", "maybe", "not a valid bool (true/false)"),
    ("pin_memory", 2, "not a valid bool (true/false)"),
    ("delayed_update", 1.5, "not a valid bool (true/false)"),
    ("overlap_step", 1.5, "not a valid bool (true/false)"),
    ("delayed_update_warmup_steps", -1, "must be >= 0"),
    ("delayed_update_warmup_steps", 2.5, "not a valid int"),
    ("cpu_threads", "two", "not a valid int"),
    ("cpu_threads", -1, "must be >= 0"),
    ("cpu_threads", 2**31, "must be <= 32768"),
    ("bind_cores", "sometimes", "not a valid bool (true/false)"),
    ("state_dtype", "fp16", "not allowed; allowed: fp32, bf16, int8, int4"),
    ("master_dtype", "fp16", "not allowed; allowed: fp32, bf16"),
    ("save_dtype", "bf16", "not allowed; allowed: fp32, compute"),
    ("host_memory_limit", "48", "expected a number with a unit"),
    ("host_memory_limit", "-1GiB", "expected a number with a unit"),
    ("host_memory_limit", "1e400GiB", "expected a number with a unit"),
    ("host_memory_limit", "lots", "expected a number with a unit"),
    ("offload_fraction", 1.5, "not allowed; allowed: a number from 0 to 1"),
    ("offload_fraction", "half", "not allowed; allowed: a number from 0 to 1"),
    ("offload_fraction", -0.25, "not allowed; allowed: a number from 0 to 1"),
    ("device_memory_limit", "40", "expected a number with a unit"),
    ("device_memory_limit", "lots", "expected a number with a unit"),
    ("max_grad_norm", -0.5, "must be >= 0.0"),
    ("max_grad_norm", "inf", "not a valid float (a finite number)"),
    ("max_nonfinite_steps", -1, "must be >= 0"),
    ("max_nonfinite_steps", 2.5, "not a valid int"),
    ("kernels", "cuda", "not allowed; allowed: auto, triton, torch"),
    ("init_scale", 0, "must be > 0.0"),
    ("init_scale", "1e39", "must be <= 3.4028234663852886e+38"),
    ("growth_factor", 1.0, "must be > 1.0"),
    ("backoff_factor", 0, "must be > 0.0"),
    ("backoff_factor", 1.5, "must be < 1.0"),
    ("growth_interval", 0, "must be >= 1"),
    ("growth_interval", 1.5, "not a valid int"),
    ("hysteresis", 0, "must be >= 1"),
    ("min_scale", -1, "must be > 0.0"),
]
SOURCES = ["constructor", "env", "yaml", "cli", "prepare_zero_offload"]


def test_every_setting_is_swept():
    assert {name for name, _, _ in BAD_VALUES} == set(ZeroOffloadPlugin.names())


def _sidecar(folder, data, name="x_zoffload.yaml"):
    path = os.path.join(folder, name)
    with open(path, "w") as fh:
        fh.write(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def through_prepare(**settings):
    """prepare_zero_offload on a fresh accelerator; on an error, check that nothing changed
    (the model, the optimizer, the accelerator) and re-raise it."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    model, opt = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        prepare_zero_offload(acc, model, opt, **settings)
    except Exception:
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) and after[k].dtype == torch.float32
                   for k in before)
        assert attached_engine(acc) is None and acc.scaler is None and not acc._optimizers
        assert not opt.state and type(opt) is torch.optim.AdamW
        raise
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def through_cli(folder, *argv):
    """ZeroOffloadTrainingArguments from a command line, as run_clm.py parses it."""
    parser = HfArgumentParser(ZeroOffloadTrainingArguments)
    return parser.parse_args_into_dataclasses(
        args=["--output_dir", folder, "--use_cpu", "--report_to", "none", *argv])


def bad_value_error(source, name, value, folder, capsys=None) -> str:
    """The error ``source`` gives for ``name=value``, as its user sees it: a ValueError's
    text, or argparse's one line (it exits with status 2)."""
    try:
        if source == "constructor":
            ZeroOffloadPlugin(**{name: value})
        elif source == "env":
            ZeroOffloadPlugin.from_sources(environ={f"HF_ZOFFLOAD_{name.upper()}": str(value)})
        elif source == "yaml":
            path = _sidecar(folder, {"zero_offload": True, "zoffload": {name: value}})
            ZeroOffloadPlugin.from_sources(environ={"HF_ZOFFLOAD_CONFIG": path})
        elif source == "cli":
            through_cli(folder, "--zero_offload", f"--zero_offload_{name}", str(value))
        else:
            through_prepare(**{name: value})
    except ValueError as err:
        return str(err)
    except SystemExit as err:
        assert err.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1] if capsys else "(argparse)"
    raise AssertionError(f"{source}: {name}={value!r} was accepted")


PREFIX = {"constructor": "", "env": "HF_ZOFFLOAD_{NAME}={value!r}: ", "yaml": "{path}: {name}: ",
          "cli": "--zero_offload_{name}: ", "prepare_zero_offload": "prepare_zero_offload("
          "{name}=...): "}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name, value, says", BAD_VALUES,
                         ids=[f"{n}={v!r}" for n, v, _ in BAD_VALUES])
def test_bad_value(tmp_path, capsys, monkeypatch, source, name, value, says):
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    text = bad_value_error(source, name, value, str(tmp_path), capsys)
    assert "\n" not in text
    if text.startswith("hf_zoffload: error") or "error: argument" in text:
        # argparse's own check of the option's type or choices: names the option
        assert f"argument --zero_offload_{name}" in text and source == "cli"
        return
    prefix = PREFIX[source].format(NAME=name.upper(), name=name, value=str(value),
                                   path=tmp_path / "x_zoffload.yaml")
    assert text.startswith(f"{prefix}ZeRO-Offload setting {name!r}: "), text
    assert says in text, text


def test_cross_setting_rules():
    with pytest.raises(ValueError, match=r"^ZeRO-Offload settings 'init_scale' 1.0 and "
                                         r"'min_scale' 2.0: init_scale must be >= min_scale$"):
        ZeroOffloadPlugin(init_scale=1, min_scale=2)
    with pytest.raises(ValueError, match="init_scale must be >= min_scale"):
        through_prepare(init_scale=1, min_scale=2)


def test_unknown_names():
    with pytest.raises(ValueError, match=r"^unknown ZeRO-Offload argument 'bucket_mb'.*did "
                                         r"you mean 'bucket_size_mb'\?$"):
        through_prepare(bucket_mb=4)
    with pytest.raises(ValueError, match=r"^unknown environment variable HF_ZOFFLOAD_PIN; "
                                         r".*did you mean 'HF_ZOFFLOAD_PIN_MEMORY'\?$"):
        ZeroOffloadPlugin.from_sources(environ={"HF_ZOFFLOAD_PIN": "1"})


# ------------------------------------------------------------------ the sidecar file
def _unreadable(folder, monkeypatch):
    path = _sidecar(folder, "zero_offload: true\n")
    os.chmod(path, 0)
    if os.geteuid() == 0:  # root reads any file: make os.access answer as for a user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if p == path
                            else real(p, m, *a, **k))
    return path


def _io_error(folder, monkeypatch):
    import builtins

    path, real = _sidecar(folder, "zero_offload: true\n"), builtins.open

    def failing(file, *args, **kwargs):
        if file == path:
            raise OSError(5, "Input/output error")
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", failing)
    return path


# (case, the file's text or a function making the path, what the message says)
SIDECARS = [
    ("missing file", lambda d, mp: os.path.join(d, "gone.yaml"), r"=\S+gone.yaml: no such file"),
    ("a directory", lambda d, mp: d, r"=\S+: is a directory, not a file"),
    ("no read permission", _unreadable, r": cannot be read \(permission denied\)"),
    ("an I/O error", _io_error, r": cannot be read \(Input/output error\)"),
    ("not YAML", "zoffload:\n  bucket_size_mb: [4\n", r": not valid YAML at line 3"),
    ("not UTF-8", b"zoffload: {bucket_size_mb: \xff}\n",
     r": not valid YAML: not utf-8 text \(invalid start byte at byte 27\)"),
    ("a list", "- 1\n", r": expected a mapping with a 'zoffload:' section"),
    ("unknown key", "zoffload: {pin_memmory: true}\n",
     r"unknown ZeRO-Offload key in \S+ 'pin_memmory'.*did you mean 'pin_memory'"),
    ("unknown top-level key", "zero_offload: true\ncompute_dtype: fp16\n",
     r"unknown top-level key\(s\) 'compute_dtype'; allowed: zero_offload, zoffload, version"),
    ("a key twice", "zoffload:\n  bucket_size_mb: 4\n  bucket_size_mb: 8\n",
     r"not valid YAML at line 3.*'bucket_size_mb' is given twice \(lines 2 and 3\)"),
    ("zoffload not a mapping", "zoffload: 0\n", r": 'zoffload' must be a mapping"),
    ("zero_offload not a bool", "zero_offload: 'yes'\n", r": 'zero_offload' must be true or "
                                                         r"false, got 'yes'"),
    ("another format version", "version: 2\nzoffload: {}\n", r": sidecar format version 2, but "
                                                             r"this hf-zoffload reads format 1"),
    ("a version that is no number", "version: '1.0'\n", r": 'version' must be a whole number"),
    ("a bad value", "zoffload: {state_dtype: fp16}\n", r": state_dtype: ZeRO-Offload setting"),
]


def _sidecar_path(folder, monkeypatch, content):
    if callable(content):
        return content(folder, monkeypatch)
    path = os.path.join(folder, "x_zoffload.yaml")
    with open(path, "wb") as fh:
        fh.write(content if isinstance(content, bytes) else content.encode())
    return path


READERS = ["from_sources", "enabled", "trainer_arguments", "prepare_zero_offload", "launch"]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case, content, says", SIDECARS, ids=[c for c, _, _ in SIDECARS])
def test_bad_sidecar(tmp_path, monkeypatch, capsys, reader, case, content, says):
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    path = _sidecar_path(str(tmp_path), monkeypatch, content)
    monkeypatch.setenv("HF_ZOFFLOAD_CONFIG", path)
    text = sidecar_error(reader, path, str(tmp_path), capsys)
    assert "\n" not in text
    assert __import__("re").search(says, text), text


def sidecar_error(reader, path, folder, capsys=None) -> str:
    try:
        if reader == "from_sources":
            ZeroOffloadPlugin.from_sources()
        elif reader == "enabled":
            enabled_from_sources(default=True)
        elif reader == "trainer_arguments":  # --zero_offload unset: the sidecar decides
            through_cli(folder)
        elif reader == "prepare_zero_offload":
            through_prepare()
        else:  # refused before accelerate launch starts anything (status 2, one line)
            code = cli(["launch", "--cpu", "--zoffload_config", path, "script.py"])
            assert code == 2
            return capsys.readouterr().err.strip()
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{reader} accepted the sidecar")


def test_sidecar_versions_that_are_read(tmp_path):
    """Format 1 is a file without `version:` (every sidecar written so far, and what
    save_yaml writes) or with `version: 1`."""
    plain = _sidecar(str(tmp_path), {"zero_offload": True, "zoffload": {"hysteresis": 3}})
    tagged = _sidecar(str(tmp_path), {"version": 1, "zoffload": {"hysteresis": 3}}, "v1.yaml")
    for path in (plain, tagged):
        assert ZeroOffloadPlugin.from_sources(environ={"HF_ZOFFLOAD_CONFIG": path}).hysteresis == 3
    ZeroOffloadPlugin().save_yaml(plain)
    assert "version" not in yaml.safe_load(open(plain))


def _table() -> str:
    import tempfile

    rows = ["| input | source | error (first line) |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        for name, value, _ in BAD_VALUES:
            for source in SOURCES:
                if source == "cli":  # argparse writes to stderr and exits
                    import contextlib
                    import io

                    err = io.StringIO()
                    with contextlib.redirect_stderr(err):
                        text = bad_value_error(source, name, value, folder)
                    if text == "(argparse)":
                        text = err.getvalue().strip().splitlines()[-1]
                else:
                    text = bad_value_error(source, name, value, folder)
                rows.append(f"| `{name}={value!r}` | {source} | {_cell(text, folder)} |")
        for case, content, _ in SIDECARS:
            mp = pytest.MonkeyPatch()
            path = _sidecar_path(folder, mp, content)
            os.environ["HF_ZOFFLOAD_CONFIG"] = path
            try:
                text = sidecar_error("from_sources", path, folder)
            finally:
                del os.environ["HF_ZOFFLOAD_CONFIG"]
                mp.undo()
            rows.append(f"| sidecar: {case} | HF_ZOFFLOAD_CONFIG (all 5 readers) | "
                        f"{_cell(text, folder)} |")
    return "\n".join(rows)


def _cell(text: str, folder: str) -> str:
    return text.splitlines()[0].replace(folder, "DIR").replace("|", "\\|")


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(print(_table()))
