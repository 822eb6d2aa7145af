"""Every ``HF_ZOFFLOAD_*`` variable the package, its scripts or its docs mention is accepted
by the settings reader (a setting, or one of `config.NOT_SETTINGS`), and setting the
traceback switch leaves every entry point working."""

import os
import pathlib
import re

import pytest
import torch

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.commands.main import main
from hf_zoffload.config import ENV_PREFIX, NOT_SETTINGS, TRACEBACK_ENV, env_values

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What users read and run: the package, its scripts and docs, the build switches' setup.py.
SOURCES = ["hf_zoffload", "scripts", "docs", "README.md", "setup.py", "cython_ext"]
NAME = re.compile(r"HF_ZOFFLOAD_[A-Z][A-Z0-9_]*[A-Z0-9]")
# Mentioned on purpose and not variables: the C header's include guard.
NOT_VARIABLES = {"HF_ZOFFLOAD_ADAM_KERNEL_H"}


def _mentioned() -> dict[str, str]:
    """Each name found, with one file that mentions it."""
    out = {}
    for top in SOURCES:
        path = ROOT / top
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()
                                               and f.suffix in (".py", ".md", ".sh", ".pyx",
                                                                ".pxd", ".h", ".cfg", ".yaml")]
        for f in files:
            for name in NAME.findall(f.read_text(errors="replace")):
                out.setdefault(name, str(f.relative_to(ROOT)))
    return out


def test_the_grep_finds_the_known_names():
    found = _mentioned()
    # the grep itself works: the names every error message and the docs use are found
    for name in ("HF_ZOFFLOAD_TRACEBACK", "HF_ZOFFLOAD_CONFIG", "HF_ZOFFLOAD_ENABLED",
                 "HF_ZOFFLOAD_BUCKET_SIZE_MB", "HF_ZOFFLOAD_PORTABLE_BUILD"):
        assert name in found, name


def test_every_mentioned_variable_is_accepted():
    found = _mentioned()
    settings = {ENV_PREFIX + n.upper(): n for n in ZeroOffloadPlugin.names()}
    for name, where in sorted(found.items()):
        if name in NOT_VARIABLES:
            continue
        short = name[len(ENV_PREFIX):]
        assert name in settings or short in NOT_SETTINGS, f"{name} (in {where}) is neither a " \
            "setting nor in config.NOT_SETTINGS"
        value = str(ZeroOffloadPlugin().to_env()[name]) if name in settings else "1"
        got = env_values({name: value})  # raised "unknown environment variable" before
        assert got == ({settings[name]: value} if name in settings else {})


def test_a_misspelt_variable_still_raises():
    with pytest.raises(ValueError, match=r"unknown environment variable HF_ZOFFLOAD_TRACEBAK;"
                                         r".*did you mean 'HF_ZOFFLOAD_TRACEBACK'\?$"):
        env_values({"HF_ZOFFLOAD_TRACEBAK": "1"})


def test_entry_points_run_with_the_traceback_switch(monkeypatch, capsys, tmp_path):
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    # a bare optimizer reads the variables
    p = torch.nn.Parameter(torch.ones(8))
    opt = ZeroOffloadOptimizer([p], plugin=ZeroOffloadPlugin.from_sources(compute_dtype="fp32"))
    p.sum().backward()
    opt.step()
    assert p[0].item() != 1.0
    opt.close()
    # the console script
    assert main(["estimate", "--params", "1M"]) == 0
    assert "unknown environment variable" not in capsys.readouterr().err
    # and a bad setting then raises with its traceback, not the one line
    monkeypatch.setenv("HF_ZOFFLOAD_BUCKET_SIZE_MB", "-1")
    with pytest.raises(ValueError, match="bucket_size_mb"):
        main(["estimate", "--params", "1M"])
