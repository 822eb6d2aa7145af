# Sourced by test.sh and quickstart.sh: create or refresh .venv and install the package.
# torch is pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
# pip runs quietly (-q); each step says what it installs first, so that a first run, which
# downloads and compiles for about two minutes, is never silent.
# An up-to-date .venv is kept as it is: the install is skipped when nothing it is made from
# changed since the last one (the stamp below: the build and dependency files, the kernel's
# sources, this file, the interpreter) and the package still imports with its kernel. The
# reinstall cost about 40 s of every run on 2 cores (pip's resolve plus the kernel's compile).
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup 1/4] creating .venv with $PYTHON_BIN"
    "$PYTHON_BIN" -m venv .venv
else
    echo "[setup 1/4] using the existing .venv"
fi
# shellcheck disable=SC1091
source .venv/bin/activate
_zoffload_stamp() {
    {
        python -c 'import sys; print(sys.version)'
        cat setup.py setup.cfg pyproject.toml scripts/_setup_env.sh cython_ext/*
    } | sha256sum | cut -d' ' -f1
}
_ZOFFLOAD_STAMP_FILE=.venv/.hf_zoffload_installed
if [ -f "$_ZOFFLOAD_STAMP_FILE" ] && [ "$(cat "$_ZOFFLOAD_STAMP_FILE")" = "$(_zoffload_stamp)" ] \
        && python -c 'import hf_zoffload.ops._native as n; n.ext()' 2>/dev/null; then
    echo "[setup 2-4/4] .venv is up to date (nothing it is built from changed): install skipped"
else
    rm -f "$_ZOFFLOAD_STAMP_FILE"
    echo "[setup 2/4] upgrading pip"
    python -m pip install -q --upgrade pip
    echo "[setup 3/4] installing torch==2.13.0 (CPU build unless the pin is edited; ~200 MB the first time)"
    python -m pip install -q torch==2.13.0
    echo "[setup 4/4] installing hf_zoffload with its test extras (transformers, accelerate, triton, ...); compiling the CPU-Adam kernel"
    python -m pip install -q -e ".[test]"
    _zoffload_stamp >"$_ZOFFLOAD_STAMP_FILE"
fi
echo "[setup] done: $(python -c 'import hf_zoffload; print("hf_zoffload", hf_zoffload.__version__)')"
