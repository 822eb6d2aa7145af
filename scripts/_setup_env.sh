# Sourced by test.sh and quickstart.sh: create or refresh .venv and install the package.
# torch is pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
# pip runs quietly (-q); each step says what it installs first, so that a first run, which
# downloads and compiles for about two minutes, is never silent.
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup 1/4] creating .venv with $PYTHON_BIN"
    "$PYTHON_BIN" -m venv .venv
else
    echo "[setup 1/4] using the existing .venv"
fi
# shellcheck disable=SC1091
source .venv/bin/activate
echo "[setup 2/4] upgrading pip"
python -m pip install -q --upgrade pip
echo "[setup 3/4] installing torch==2.13.0 (CPU build unless the pin is edited; ~200 MB the first time)"
python -m pip install -q torch==2.13.0
echo "[setup 4/4] installing hf_zoffload with its test extras (transformers, accelerate, triton, ...); compiling the CPU-Adam kernel"
python -m pip install -q -e ".[test]"
echo "[setup] done: $(python -c 'import hf_zoffload; print("hf_zoffload", hf_zoffload.__version__)')"
