#!/usr/bin/env bash
# Fetch, here (where a package registry answers), the wheels that scripts/gpu_check.sh's peers
# stage unpacks on the GPU machine, which has no registry: into wheels/ (ignored by git; the
# device tool carries it when the run names it, carry: ["wheels"], 64 MiB of carried paths
# at most). Nothing is installed, here or there.
#   bash scripts/gpu_wheels.sh           # PYTHON=/path/to/python overrides the pip used
# torchao 0.18.0 (3.4 MB): its compiled kernels load only with torch >= 2.11 (its __init__
# checks), the GPU machine's torch; CPUOffloadOptimizer itself is Python. cp310-abi3: any
# CPython >= 3.10, so the wheel asked for is the machine's (CPython 3.12, x86-64 Linux), not
# this interpreter's. DeepSpeed is not fetched: PyPI has its releases as source only.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS=(torchao==0.18.0)
mkdir -p "$ROOT/wheels"
"$PY" -m pip download --no-deps --only-binary=:all: --implementation cp \
    --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$ROOT/wheels" "${WHEELS[@]}"
size_kib=$(du -sk "$ROOT/wheels" | cut -f1)
echo "gpu_wheels.sh: $(ls "$ROOT/wheels" | paste -sd ' '): $((size_kib / 1024)) MiB in wheels/"
if [ "$size_kib" -gt $((48 * 1024)) ]; then  # the carry limit is 64 MiB for every path
    echo "gpu_wheels.sh: wheels/ holds more than 48 MiB: remove old wheels" >&2
    exit 1
fi
