#!/usr/bin/env bash
# GPU checks: the `gpu`-marked tests, then the GPU benchmarks. Logs go to $OUT when it is
# set (else outputs/gpu_check). Run from anywhere on a fresh CUDA machine:
#   bash scripts/gpu_check.sh
# It makes .venv-gpu. A CUDA torch already installed for $PYTHON (GPU images ship one, and
# often have no network) is reused through --system-site-packages; otherwise torch and
# triton come from PyPI, whose default Linux wheels are the CUDA builds (test.sh pins the
# CPU-sized torch==2.13.0 instead, which is why this script keeps its own venv).
# Exits non-zero if a test or a benchmark failed; all of them run regardless.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the compiled kernels are what is checked here
LOG_DIR="${OUT:-outputs/gpu_check}"
mkdir -p "$LOG_DIR"
PYTHON_BIN="${PYTHON:-python3}"

if [ ! -x .venv-gpu/bin/python ]; then
    if "$PYTHON_BIN" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' \
            2>/dev/null; then
        "$PYTHON_BIN" -m venv --system-site-packages .venv-gpu
    else
        "$PYTHON_BIN" -m venv .venv-gpu
        .venv-gpu/bin/python -m pip install -q torch triton
    fi
fi
# shellcheck disable=SC1091
source .venv-gpu/bin/activate
if grep -q "include-system-site-packages = true" .venv-gpu/pyvenv.cfg; then
    # Offline-safe: build against what is installed, fetch nothing.
    install=(--no-deps --no-build-isolation -e .)
else
    install=(-e ".[test]")
fi
if ! python -m pip install -q "${install[@]}" 2>&1 | tee "$LOG_DIR/install.log"; then
    echo "gpu_check: editable install failed (see install.log); using PYTHONPATH" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

status=0
{ nvidia-smi || true; python -c 'import torch, triton; print("torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__)'; } 2>&1 | tee "$LOG_DIR/env.txt"
python -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$LOG_DIR/pytest_gpu.log" || status=1
# Benchmarks: add new GPU benchmark scripts to this list.
for bench in scripts/bench_scaling.py scripts/bench_offload.py; do
    python "$bench" 2>&1 | tee "$LOG_DIR/$(basename "$bench" .py).md" || status=1
done
echo "gpu_check: logs in $LOG_DIR; status $status"
exit "$status"
