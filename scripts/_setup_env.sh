# Sourced by test.sh and quickstart.sh: create or refresh .venv and install the package.
# torch is pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON_BIN" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
