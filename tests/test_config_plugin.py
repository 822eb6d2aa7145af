"""ZeroOffloadPlugin (hf_zoffload/config.py): precedence, round trips, bad keys and values."""

import dataclasses

import pytest
import yaml

from hf_zoffload.config import (
    ZeroOffloadPlugin,
    enabled_from_sources,
    env_values,
    read_yaml,
    sourced_values,
)


def _sidecar(tmp_path, section, **top):
    path = tmp_path / "acc_zoffload.yaml"
    path.write_text(yaml.safe_dump({"zero_offload": True, "zoffload": section, **top}))
    return str(path)


def test_precedence_argument_over_env_over_yaml(tmp_path):
    path = _sidecar(tmp_path, {"bucket_size_mb": 4, "cpu_threads": 3, "hysteresis": 5})
    environ = {"HF_ZOFFLOAD_CONFIG": path, "HF_ZOFFLOAD_BUCKET_SIZE_MB": "8",
               "HF_ZOFFLOAD_CPU_THREADS": "6"}
    p = ZeroOffloadPlugin.from_sources(environ=environ, bucket_size_mb=16)
    assert p.bucket_size_mb == 16.0  # argument beats env and yaml
    assert p.cpu_threads == 6  # env beats yaml
    assert p.hysteresis == 5  # yaml beats the default
    assert p.growth_interval == 2000  # default
    # config_file= names the yaml instead of HF_ZOFFLOAD_CONFIG, still below env
    q = ZeroOffloadPlugin.from_sources(config_file=path, environ={"HF_ZOFFLOAD_HYSTERESIS": "7"})
    assert (q.bucket_size_mb, q.hysteresis) == (4.0, 7)


def test_sourced_values_merge_yaml_and_env_and_say_where(tmp_path):
    """The one reading of the sources that from_sources and both integrations use: raw
    values, yaml overlaid by HF_ZOFFLOAD_*, and where they came from."""
    path = _sidecar(tmp_path, {"bucket_size_mb": 4, "hysteresis": 5})
    values, where = sourced_values(environ={"HF_ZOFFLOAD_CONFIG": path,
                                            "HF_ZOFFLOAD_BUCKET_SIZE_MB": "8"})
    assert values == {"bucket_size_mb": "8", "hysteresis": 5}
    assert where == f"{path} / HF_ZOFFLOAD_* variables"
    # config_file= instead of HF_ZOFFLOAD_CONFIG; nothing set: nothing, env named only
    assert sourced_values(environ={}, config_file=path) == (
        {"bucket_size_mb": 4, "hysteresis": 5}, f"{path} / HF_ZOFFLOAD_* variables")
    assert sourced_values(environ={}) == ({}, "HF_ZOFFLOAD_* variables")
    with pytest.raises(ValueError, match="HF_ZOFFLOAD_BUCKET_MB"):
        sourced_values(environ={"HF_ZOFFLOAD_BUCKET_MB": "3"})


def test_round_trips(tmp_path):
    p = ZeroOffloadPlugin(compute_dtype="FP16", bucket_size_mb=0.5, pin_memory="no",
                          delayed_update="yes", cpu_threads="2", init_scale=1024)
    assert (p.compute_dtype, p.pin_memory, p.delayed_update, p.cpu_threads) == \
        ("fp16", False, True, 2)
    assert ZeroOffloadPlugin.from_sources(environ=p.to_env()) == p
    path = tmp_path / "x_zoffload.yaml"
    p.save_yaml(str(path), enabled=False)
    data = yaml.safe_load(path.read_text())
    assert data["zero_offload"] is False and list(data) == ["zero_offload", "zoffload"]
    assert ZeroOffloadPlugin(**read_yaml(str(path))) == p
    assert set(p.to_env()) == {"HF_ZOFFLOAD_" + n.upper() for n in ZeroOffloadPlugin.names()}


def test_the_sidecar_and_the_environment_carry_only_what_was_chosen(tmp_path):
    """A written default would pin it (issue 15, item 1): compute_dtype: bf16 in the sidecar
    made `launch` train in bf16 what `python` trains in fp32."""
    p = ZeroOffloadPlugin(bucket_size_mb=8, state_dtype="bf16")
    assert p.changed() == ["bucket_size_mb", "state_dtype"]
    path = tmp_path / "x_zoffload.yaml"
    p.save_yaml(str(path))
    assert yaml.safe_load(path.read_text())["zoffload"] == {"bucket_size_mb": 8.0,
                                                           "state_dtype": "bf16"}
    p.save_yaml(str(path), names=["compute_dtype"])  # chosen, though equal to the default
    assert yaml.safe_load(path.read_text())["zoffload"] == {"compute_dtype": "bf16"}
    ZeroOffloadPlugin().save_yaml(str(path))
    assert yaml.safe_load(path.read_text()) == {"zero_offload": True, "zoffload": {}}
    assert p.to_env(["state_dtype"]) == {"HF_ZOFFLOAD_STATE_DTYPE": "bf16"}
    with pytest.raises(ValueError, match="unknown ZeRO-Offload setting 'state_dtyp'"):
        p.to_env(["state_dtyp"])


@pytest.mark.parametrize("name,value", [("state_dtype", "int8"), ("save_dtype", "compute")])
def test_new_settings_from_every_source(tmp_path, name, value):
    """state_dtype and save_dtype, one name end to end: argument, HF_ZOFFLOAD_<NAME>, the
    sidecar's key (the wizard, the Trainer and launch: tests/commands, tests/integrations)."""
    assert getattr(ZeroOffloadPlugin(), name) == "fp32"  # the default
    assert getattr(ZeroOffloadPlugin.from_sources(environ={}, **{name: value}), name) == value
    env = {"HF_ZOFFLOAD_" + name.upper(): value.upper()}
    assert getattr(ZeroOffloadPlugin.from_sources(environ=env), name) == value
    path = _sidecar(tmp_path, {name: value})
    assert getattr(ZeroOffloadPlugin.from_sources(environ={"HF_ZOFFLOAD_CONFIG": path}),
                   name) == value
    assert ZeroOffloadPlugin(**{name: value}).to_env([name]) == {
        "HF_ZOFFLOAD_" + name.upper(): value}


def test_help_names_choices_and_default():
    text = ZeroOffloadPlugin.help("compute_dtype")
    assert "fp16, bf16, fp32" in text and "Default: bf16" in text
    with pytest.raises(ValueError, match="unknown ZeRO-Offload setting 'nope'.*compute_dtype"):
        ZeroOffloadPlugin.help("nope")


# ------------------------------------------------------------------ bad keys
def test_unknown_argument():
    with pytest.raises(ValueError, match=r"unknown ZeRO-Offload argument 'bucket_mb'.*"
                                         r"allowed: compute_dtype, bucket_size_mb.*"
                                         r"did you mean 'bucket_size_mb'\?$"):
        ZeroOffloadPlugin.from_sources(environ={}, bucket_mb=3)


def test_unknown_env_var_and_reserved_names():
    with pytest.raises(ValueError, match="HF_ZOFFLOAD_BUCKET_MB.*HF_ZOFFLOAD_BUCKET_SIZE_MB"):
        env_values({"HF_ZOFFLOAD_BUCKET_MB": "3"})
    # the list of what is allowed names the two variables that are not settings too
    with pytest.raises(ValueError) as err:
        env_values({"HF_ZOFFLOAD_ENABLE": "1"})
    text = str(err.value)
    assert "HF_ZOFFLOAD_ENABLED" in text.split("allowed:")[1]
    assert "HF_ZOFFLOAD_CONFIG" in text.split("allowed:")[1]
    assert text.endswith("did you mean 'HF_ZOFFLOAD_ENABLED'?")
    # the enable switch, the sidecar path and build switches are not settings
    assert env_values({"HF_ZOFFLOAD_ENABLED": "false", "HF_ZOFFLOAD_CONFIG": "x",
                       "HF_ZOFFLOAD_PORTABLE_BUILD": "1", "OTHER": "1"}) == {}


def test_unknown_yaml_keys(tmp_path):
    with pytest.raises(ValueError, match=r"unknown ZeRO-Offload key in .*'pinned'.*pin_memory"):
        read_yaml(_sidecar(tmp_path, {"pinned": True}))
    with pytest.raises(ValueError, match="unknown top-level key.*'compute_dtype'"):
        read_yaml(_sidecar(tmp_path, {}, compute_dtype="fp16"))
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        read_yaml(str(path))
    path.write_text("zoffload: [1]\n")
    with pytest.raises(ValueError, match="'zoffload' must be a mapping"):
        read_yaml(str(path))


def test_broken_or_missing_sidecar_is_one_line(tmp_path):
    path = tmp_path / "broken_zoffload.yaml"
    path.write_text("zero_offload: true\nzoffload:\n  bucket_size_mb: [4\n")
    for environ in ({"HF_ZOFFLOAD_CONFIG": str(path)}, {"HF_ZOFFLOAD_CONFIG": str(path),
                                                        "HF_ZOFFLOAD_ENABLED": "true"}):
        with pytest.raises(ValueError) as err:
            ZeroOffloadPlugin.from_sources(environ=environ)
        assert str(err.value).startswith(f"{path}: not valid YAML at line 4")
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=f"^{path}: not valid YAML"):
        enabled_from_sources(default=True, environ={"HF_ZOFFLOAD_CONFIG": str(path)})
    missing = str(tmp_path / "gone.yaml")
    with pytest.raises(ValueError, match=f"^HF_ZOFFLOAD_CONFIG={missing}: no such file"):
        ZeroOffloadPlugin.from_sources(environ={"HF_ZOFFLOAD_CONFIG": missing})
    with pytest.raises(ValueError, match=f"^HF_ZOFFLOAD_CONFIG={missing}: no such file"):
        enabled_from_sources(default=True, environ={"HF_ZOFFLOAD_CONFIG": missing})
    with pytest.raises(ValueError, match=f"^config_file={missing}: no such file"):
        ZeroOffloadPlugin.from_sources(environ={}, config_file=missing)


def test_triton_kernels_refused_without_cuda(monkeypatch):
    """kernels=triton needs CUDA: refused when the settings are read, naming the setting
    (it used to fail at the first step, naming backend=torch)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plugin = ZeroOffloadPlugin(kernels="triton")
    with pytest.raises(ValueError, match="setting 'kernels': 'triton' needs a CUDA device, and "
                                         "this run's device is cpu; allowed here: auto, torch"):
        plugin.check_device("cpu")
    plugin.check_device("cuda")
    ZeroOffloadPlugin(kernels="auto").check_device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the test suite's interpreter mode
    plugin.check_device("cpu")


# ---------------------------------------------------------------- bad values
# One case per kind of rule: the message names the key and what is allowed.
BAD = [
    ("compute_dtype", "fp8", r"'compute_dtype'.*allowed: fp16, bf16, fp32"),  # choice
    ("kernels", "cuda", r"'kernels'.*allowed: auto, triton, torch"),  # choice
    ("pin_memory", "maybe", r"'pin_memory'.*not a valid bool \(true/false\)"),  # bool
    ("pin_memory", 2, r"'pin_memory'.*not a valid bool"),  # bool, not a number
    ("cpu_threads", "two", r"'cpu_threads'.*not a valid int"),  # int
    ("cpu_threads", 1.5, r"'cpu_threads'.*not a valid int"),  # int, fractional
    ("cpu_threads", True, r"'cpu_threads'.*not a valid int"),  # int, bool is not one
    ("cpu_threads", -1, r"'cpu_threads'.*must be >= 0"),  # inclusive minimum
    ("growth_interval", 0, r"'growth_interval'.*must be >= 1"),
    ("bucket_size_mb", "big", r"'bucket_size_mb'.*not a valid float"),  # float
    ("bucket_size_mb", 0, r"'bucket_size_mb'.*must be > 0.0"),  # exclusive minimum
    ("bucket_size_mb", "nan", r"'bucket_size_mb'.*not a valid float"),  # non-finite
    ("init_scale", "inf", r"'init_scale'.*not a valid float"),
    ("growth_factor", 1.0, r"'growth_factor'.*must be > 1.0"),
    ("backoff_factor", 1.0, r"'backoff_factor'.*must be < 1.0"),  # exclusive maximum
    ("max_grad_norm", -0.5, r"'max_grad_norm'.*must be >= 0.0"),
    ("state_dtype", "fp16", r"'state_dtype'.*allowed: fp32, bf16, int8, int4"),  # choice
    ("save_dtype", "bf16", r"'save_dtype'.*allowed: fp32, compute"),  # choice
]


@pytest.mark.parametrize("name,value,message", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_bad_values_from_every_source(tmp_path, name, value, message):
    with pytest.raises(ValueError, match=message):
        ZeroOffloadPlugin(**{name: value})
    with pytest.raises(ValueError, match=message):
        ZeroOffloadPlugin.from_sources(environ={"HF_ZOFFLOAD_" + name.upper(): str(value)})
    with pytest.raises(ValueError, match=message):
        ZeroOffloadPlugin.from_sources(environ={}, config_file=_sidecar(tmp_path, {name: value}))


def test_every_field_has_help_and_a_valid_default():
    for f in dataclasses.fields(ZeroOffloadPlugin):
        assert f.metadata["help"], f.name
    assert ZeroOffloadPlugin() == ZeroOffloadPlugin.from_sources(environ={})
