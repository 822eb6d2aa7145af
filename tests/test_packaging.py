"""What the sdist holds: the package, the kernel's sources, README, docs, LICENSE and the build
files; not tests/ or scripts/ (MANIFEST.in says why). setuptools' egg_info writes the list the
sdist is made of (SOURCES.txt) from setup.cfg and MANIFEST.in; `python -m build --sdist` adds
only the .c that cythonize generates from cpu_adam.pyx."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a setuptools process (~1.5 s)
def test_sdist_files(tmp_path):
    subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                    "egg_info", "-e", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True)
    info = tmp_path / "hf_zoffload.egg-info"
    files = set((info / "SOURCES.txt").read_text().split())
    ours = {f for f in files if not f.startswith(str(tmp_path))}
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "hf_zoffload").rglob("*.py")}
    kernel = {str(p.relative_to(ROOT)) for p in (ROOT / "cython_ext").iterdir()
              if p.suffix in (".pyx", ".pxd", ".h")}
    docs = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    assert kernel >= {"cython_ext/cpu_adam.pyx", "cython_ext/cpu_adam.pxd",
                      "cython_ext/adam_kernel.h"}
    assert ours == package | kernel | docs | {
        "LICENSE", "MANIFEST.in", "README.md", "pyproject.toml", "setup.cfg", "setup.py"}
    assert not any(f.startswith(("tests/", "scripts/")) for f in files)
    assert "License-File: LICENSE" in (info / "PKG-INFO").read_text()
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
