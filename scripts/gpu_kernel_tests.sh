#!/usr/bin/env bash
# The kernel_tests stage of scripts/gpu_check.sh: the CPU-Adam's tests on this host's CPU
# (AVX-512 on the GPU machines; the development VMs' had AVX2 only, so no AVX-512 path had
# run), on the build stage's in-place -march=native build (what every later stage runs), then
# on a portable build (HF_ZOFFLOAD_PORTABLE_BUILD=1: baseline, AVX2 and AVX-512-BF16 clones
# picked at run time, what a wheel carries) made in a copy of the sources in $SCRATCH while
# the first tests run. Measured on the 2-vCPU VM: 9 s of tests, 13 s to build. Prints each
# run's variants and pass count as "summary: " lines. Needs PY and SCRATCH (gpu_check.sh
# exports them).
#   PY=python3 SCRATCH=$(mktemp -d) bash scripts/gpu_kernel_tests.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
: "${PY:?PY: the interpreter}" "${SCRATCH:?SCRATCH: a scratch folder}"

kernel_run() {  # kernel_run LABEL: the CPU-Adam's tests on the hf_zoffload of the current folder
    local rc out
    out="$(mktemp "$SCRATCH/kernel_run.XXXXXX")" || return 1
    "$PY" - "$1" <<'EOF' || return 1
import sys

from hf_zoffload.commands.env import SIMD_FLAGS
from hf_zoffload.ops import adam_kernels as ca

ext, feats = ca._ext(), ca.compiled_features()
variants = [v for v in ("generic", "native", "avx2", "avx512bf16")
            if ext.variant_available(ext.VARIANTS[v])]
used = ", ".join(SIMD_FLAGS[f] for f in SIMD_FLAGS if feats.get(f)) or "scalar"
print(f"summary: {sys.argv[1]}: variants here {', '.join(variants)}; auto runs "
      f"{ext.auto_variant()} ({used})")
EOF
    # test_scaling.py is not a CPU-Adam test: its CPU cases run Triton's interpreter, which
    # tests/conftest.py turns on only without CUDA; its gpu cases run in gpu_tests
    # test_masters.py: the bf16 master's kernels (stochastic rounding), beside the fp32 ones;
    # test_adam_undo.py: the overlapped schedule's undo pass, every variant against its reference
    "$PY" -m pytest tests/ops/test_adam_kernels.py tests/ops/test_moments.py \
        tests/ops/test_masters.py tests/ops/test_adam_undo.py -m "not gpu" -q \
        -p no:cacheprovider 2>&1 | tee "$out"
    rc=${PIPESTATUS[0]}
    echo "summary: $1: $(grep -E '[0-9]+ (passed|failed|error)' "$out" | tail -n 1 \
        | tr -d '=' | sed 's/^ *//; s/ *$//')"
    return "$rc"
}

rc=0
port="$SCRATCH/portable"  # the portable build's copy of the sources and the ops tests
mkdir -p "$port/tests" || exit 1
cp -r hf_zoffload cython_ext setup.py setup.cfg pyproject.toml README.md "$port/" &&
    cp -r tests/__init__.py tests/conftest.py tests/ops "$port/tests/" || exit 1
rm -f "$port"/hf_zoffload/ops/_cpu_adam*.so
(cd "$port" && HF_ZOFFLOAD_PORTABLE_BUILD=1 "$PY" setup.py build_ext --inplace --force) \
    >"$port/build.log" 2>&1 &
pid=$!
kernel_run "native build" || rc=1
# issue 38: which port each zmm op of the coded pass shares on this CPU, its rows as figures
# (5 s on the VM; nothing where the CPU has no AVX-512), while the portable build compiles
"$PY" scripts/bench/bench_kernel_loop.py --ports 2>&1 |
    sed -n 's/^core: /summary: ports, /p; s/^| v/summary: &/p'
if wait "$pid"; then
    (cd "$port" && PYTHONPATH="$port" kernel_run "portable build") || rc=1
    # issue 38: the portable build's variant (AVX-512-BF16 there) timed too, 1 and 2 threads,
    # its table rows as figures; 2M params (56 MB a pass, past a Zen 4 CCD's L3): 18 s loaded VM
    PYTHONPATH="$port" "$PY" scripts/bench/bench_cpu_adam.py --sizes 2M --threads 1,2 \
        --repeats 3 --qblocks 256 --llama_div 0 | sed -n 's/^| 2M /summary: &/p' || rc=1
else
    echo "summary: **portable build: setup.py build_ext failed** (its last lines below)"
    tail -n 20 "$port/build.log"
    rc=1
fi
exit "$rc"
