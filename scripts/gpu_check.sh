#!/usr/bin/env bash
# GPU checks for a CUDA machine, run with the interpreter found there, installing nothing:
#   bash scripts/gpu_check.sh                      # python3 on PATH; PYTHON=/path overrides
#   bash scripts/gpu_check.sh --only race,size     # env, cuda, then only these stages
# Stages, each with its own timeout (the list is at the end of this file): env (nvidia-smi,
# versions), cuda (torch.cuda.is_available() and one kernel; when it fails nothing else runs),
# build (the CPU-Adam extension, in place), kernel_tests (the CPU-Adam's tests on this host's
# CPU, native and portable builds), gpu_tests (pytest -m gpu over tests/ but tests/gpu/), the
# engine checks, each a gpu test of tests/gpu/ run on its own (race: test_race.py, also under
# torch's CUDA stream sanitizer; nccl_one_rank; host_memory), run_clm.py with and without
# --zero_offload (tests/gpu/test_clm_compare.py); then the measured stages, scripts of
# scripts/bench/: size (gpu_size.py), practicality (gpu_practicality.py), peers (gpu_peers.py:
# torchao from wheels/, see scripts/gpu_wheels.sh), bench_scaling and bench_cpu_adam. Every
# pytest runs with HF_ZOFFLOAD_REQUIRE_GPU=1: a skipped gpu test fails, and so does selecting
# none. Every stage runs even after an earlier one failed; the exit status is non-zero if any
# failed. The whole run stays within GPU_CHECK_BUDGET_S (300 s): a stage gets what is left of
# it when that is less than its own timeout, and sees its limit as GPU_CHECK_STAGE_S.
#
# --only NAME,... runs env and cuda, then only the stages named, in this file's order (an
# unknown name is an error naming the stages, before anything runs). A later stage may need
# an earlier one's work: the in-place build (build), practicality's figures (peers).
#
# Output ($OUT, default outputs/gpu_check), at most 5 files, since a device machine brings back
# 8: summary.md (rewritten after every stage: versions, a pass/fail/timeout table, each stage's
# figures, the last 40 lines of each failed stage's log), env.log and cuda.log, logs.txt (every
# later stage's log under a "===== NAME: result, seconds =====" header, appended as the stage
# ends) and, while a stage runs, its own NAME.log. Figures: the lines a stage prints starting
# with "summary: " (prefix dropped) go to summary.md under the stage's name (the gpu tests of
# tests/gpu/ print theirs after pytest's report: tests/gpu/conftest.py); the benchmarks,
# which print markdown tables, contribute their table lines instead.
#
# To add a check, add a `stage NAME TIMEOUT_S CMD...` line below and NAME to STAGES. CMD is a
# program with its arguments, or a shell function defined in this file (it runs under bash
# -c, so it sees only exported variables and functions: ROOT, OUT, PY, SCRATCH). Keep the sum
# of the timeouts within the budget, with about 25 s to spare; write nothing else into $OUT
# (SCRATCH is a scratch folder, removed at the end).
set -uo pipefail
# Every stage, in the order of the stage lines at the end of this file.
STAGES=(env cuda build kernel_tests gpu_tests race race_sanitizer nccl_one_rank host_memory
        run_clm size practicality peers bench_scaling bench_cpu_adam)
ONLY=""  # " env cuda NAME ... " with --only; empty: every stage

usage() {
    echo "usage: bash scripts/gpu_check.sh [--only STAGE,...]"
    echo "stages: $(echo "${STAGES[*]}" | sed 's/ /, /g')"
}

choose() {  # choose LIST: the comma-separated stages of --only, checked against STAGES
    local name names=() unknown=()
    IFS=, read -r -a names <<<"$1"
    for name in ${names[@]+"${names[@]}"}; do
        [ -n "$name" ] || continue
        if [[ " ${STAGES[*]} " == *" $name "* ]]; then
            ONLY+=" $name"
        else
            unknown+=("'$name'")
        fi
    done
    if [ "${#unknown[@]}" -gt 0 ]; then
        echo "gpu_check.sh: unknown stage(s) in --only: ${unknown[*]}; the stages:" \
            "$(echo "${STAGES[*]}" | sed 's/ /, /g')" >&2
        exit 2
    fi
    if [ -z "$ONLY" ]; then
        echo "gpu_check.sh: --only needs at least one stage name" >&2
        usage >&2
        exit 2
    fi
}

chosen() {  # the stages --only chose, in the order they run
    local name out=()
    for name in "${STAGES[@]}"; do
        [[ "$ONLY" == *" $name "* ]] && out+=("$name")
    done
    echo "${out[*]}"
}

while [ "$#" -gt 0 ]; do
    case "$1" in
        --only) [ "$#" -ge 2 ] || { echo "gpu_check.sh: --only needs a value" >&2; exit 2; }
                choose "$2"; shift 2;;
        --only=*) choose "${1#--only=}"; shift;;
        -h|--help) usage; exit 0;;
        *) echo "gpu_check.sh: unknown argument '$1'" >&2; usage >&2; exit 2;;
    esac
done
[ -z "$ONLY" ] || ONLY=" env cuda$ONLY "  # env and cuda always run

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/outputs/gpu_check}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)" || exit 2
cd "$ROOT" || exit 2
PY="$(command -v "${PYTHON:-python3}" || echo "${PYTHON:-python3}")"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")" || exit 2
trap 'rm -rf -- "$SCRATCH"' EXIT
rm -f "$OUT/summary.md" "$OUT/logs.txt"  # this run's only; stage logs are overwritten
export ROOT OUT PY SCRATCH
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, no install
export PYTHONUNBUFFERED=1
export HF_ZOFFLOAD_REQUIRE_GPU=1  # tests/conftest.py: a skipped gpu test is a failure
unset TRITON_INTERPRET            # the compiled kernels are what is checked here

BUDGET_S="${GPU_CHECK_BUDGET_S:-300}"
KILL_GRACE=5    # seconds between timeout's TERM and its KILL
STATUS=0        # 1 once any stage did not pass
ROWS=()         # summary table rows
DONE=()         # names of the stages run, in order
FAILED=()       # "name|result" of each stage that did not pass
NOTE=""         # a line for the top of the summary
OWN_LOG=" env cuda "                     # stages whose log stays a file of its own in $OUT
TABLES=" bench_scaling bench_cpu_adam "  # stages whose markdown tables are figures

info() {  # info KEY: the value of an "info KEY: value" line printed by the env or cuda stage
    local value
    value="$(sed -n "s/^info $1: //p" "$OUT/env.log" "$OUT/cuda.log" 2>/dev/null | head -n 1)"
    echo "${value:-unknown}"
}

log_of() {  # log_of NAME: where the log of stage NAME is now
    if [ -f "$OUT/$1.log" ]; then echo "$OUT/$1.log"; else echo "$SCRATCH/$1.log"; fi
}

write_summary() {
    local verdict=PASS line name
    [ "$STATUS" -eq 0 ] || verdict=FAIL
    {
        echo "# gpu_check: $verdict"
        echo
        echo "- GPU: $(info gpu)"
        echo "- driver (nvidia-smi): $(info driver)"
        echo "- python: $(info python)"
        echo "- torch: $(info torch)"
        echo "- versions: $(info versions)"
        echo "- compiler: $(info cc)"
        echo "- host CPU: $(info cpu)"
        echo "- host memory: $(info memory)"
        echo "- host: $(hostname 2>/dev/null), $(nproc 2>/dev/null) CPUs; $(date -u +%FT%TZ);" \
             "${SECONDS} s of a ${BUDGET_S} s budget"
        [ -z "$ONLY" ] || echo "- stages: only $(chosen | sed 's/ /, /g') (--only)"
        [ -z "$NOTE" ] || echo "- **$NOTE**"
        echo
        echo "| stage | result | seconds | timeout (s) | log |"
        echo "| --- | --- | ---: | ---: | --- |"
        [ "${#ROWS[@]}" -eq 0 ] || printf '%s\n' "${ROWS[@]}"
        for name in ${DONE[@]+"${DONE[@]}"}; do
            [ -s "$SCRATCH/$name.figures" ] || continue
            echo
            echo "## $name"
            echo
            cat "$SCRATCH/$name.figures"
        done
        for line in ${FAILED[@]+"${FAILED[@]}"}; do
            name="${line%%|*}"
            echo
            echo "## $name: ${line#*|} (last 40 lines of its log)"
            echo
            echo '```'
            tail -n 40 "$(log_of "$name")" 2>/dev/null
            echo '```'
        done
    } >"$OUT/summary.md"
}

finish_log() {  # finish_log NAME RESULT SECONDS: take the figures, move the log into logs.txt
    local name=$1 log="$OUT/$1.log"
    [ -f "$log" ] || return 0
    if [[ "$TABLES" == *" $name "* ]]; then
        grep '^|' "$log" >"$SCRATCH/$name.figures"
    else
        sed -n 's/^summary: //p' "$log" >"$SCRATCH/$name.figures"
    fi
    [[ "$OWN_LOG" == *" $name "* ]] && return 0
    { echo "===== $name: $2, $3 s ====="; cat "$log"; echo; } >>"$OUT/logs.txt"
    mv -f "$log" "$SCRATCH/$name.log"
}

stage() {  # stage NAME TIMEOUT_S CMD...: run CMD under timeout, output to $OUT/NAME.log
    # while it runs (finish_log then moves it into logs.txt, unless it is env or cuda)
    local name=$1 limit=$2 asked=$2 rc result t0 secs
    shift 2
    [ -z "$ONLY" ] || [[ "$ONLY" == *" $name "* ]] || return 0  # not chosen with --only
    local left=$((BUDGET_S - SECONDS - KILL_GRACE))
    [ "$limit" -le "$left" ] || limit=$left
    local log="$OUT/$name.log"
    echo "\$ $*" >"$log"
    if [ "$limit" -lt 1 ]; then
        echo "not run: the ${BUDGET_S} s budget of gpu_check.sh is spent" >>"$log"
        rc=1 result="not run (budget spent)" secs=0
    else
        if declare -F "$1" >/dev/null; then  # a function of this file: run it in a bash
            export -f "$1"
            set -- bash -c '"$@"' bash "$@"
        fi
        echo "gpu_check: [$name] timeout ${limit} s: see $log"
        t0=$SECONDS
        # timeout kills the command's whole process group. It runs in the background so that
        # a signal to this script is handled at once (interrupted, below); the subshell gives
        # it back the SIGINT that bash takes from background commands.
        (trap - INT QUIT; export GPU_CHECK_STAGE_S=$limit
         exec timeout -k "$KILL_GRACE" "$limit" "$@") >>"$log" 2>&1 </dev/null &
        STAGE_PID=$! STAGE_NAME=$name STAGE_T0=$t0 STAGE_LIMIT=$asked
        wait "$STAGE_PID"
        rc=$?
        STAGE_PID=""
        secs=$((SECONDS - t0))
        if [ "$rc" -eq 0 ]; then
            result=pass
        elif { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [ "$secs" -ge "$limit" ]; then
            result="timeout"
            echo "gpu_check: killed after its ${limit} s timeout" >>"$log"
        else
            result="fail (exit $rc)"
        fi
    fi
    record "$name" "$result" "$secs" "$asked"
    finish_log "$name" "$result" "$secs"
    echo "gpu_check: [$name] $result, ${secs} s"
    write_summary
    [ "$rc" -eq 0 ]
}

record() {  # record NAME RESULT SECONDS TIMEOUT_S: a row of the summary table
    local where=logs.txt
    [[ "$OWN_LOG" == *" $1 "* ]] && where="$1.log"
    ROWS+=("| $1 | $2 | $3 | $4 | $where |")
    DONE+=("$1")
    if [ "$2" != pass ]; then
        STATUS=1
        FAILED+=("$1|$2")
    fi
}

interrupted() {  # on INT/TERM/HUP: stop the running stage, write the summary, exit 130
    trap - INT TERM HUP
    if [ -n "$STAGE_PID" ]; then
        kill -TERM "$STAGE_PID" 2>/dev/null
        wait "$STAGE_PID" 2>/dev/null
        echo "gpu_check: interrupted" >>"$OUT/$STAGE_NAME.log"
        record "$STAGE_NAME" interrupted "$((SECONDS - STAGE_T0))" "$STAGE_LIMIT"
        finish_log "$STAGE_NAME" interrupted "$((SECONDS - STAGE_T0))"
    fi
    STATUS=1
    NOTE="interrupted by a signal; the stages after the last one listed did not run"
    write_summary
    echo "gpu_check: interrupted; summary in $OUT/summary.md" >&2
    exit 130
}
STAGE_PID=""
trap interrupted INT TERM HUP

gib() {  # gib BYTES: in GiB, one decimal
    awk -v b="$1" 'BEGIN { printf "%.1f GiB", b / 2^30 }'
}

host_memory_info() {
    # The host's memory as the engine's host check reads it (offload/memory.py,
    # host_available: MemAvailable, or the cgroup limit less its usage when lower). The GPU
    # machine's memory may start small and grow: these are the figures at the check's start.
    local total avail limit used where=""
    total=$(awk '/^MemTotal:/ { print $2 * 1024 }' /proc/meminfo 2>/dev/null)
    avail=$(awk '/^MemAvailable:/ { print $2 * 1024 }' /proc/meminfo 2>/dev/null)
    if [ -r /sys/fs/cgroup/memory.max ]; then  # cgroup v2
        limit=$(cat /sys/fs/cgroup/memory.max) used=$(cat /sys/fs/cgroup/memory.current 2>/dev/null)
        where="cgroup v2 memory.max"
    elif [ -r /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then  # cgroup v1
        limit=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes)
        used=$(cat /sys/fs/cgroup/memory/memory.usage_in_bytes 2>/dev/null)
        where="cgroup v1 memory.limit_in_bytes"
    fi
    local cg="no cgroup memory limit file"
    if [ -n "$where" ]; then
        if [[ "$limit" =~ ^[0-9]+$ ]] && [ "$limit" -lt $((1 << 60)) ]; then
            cg="$where $(gib "$limit") (${used:+$(gib "$used") used})"
        else
            cg="$where: no limit ($limit)"
        fi
    fi
    echo "info memory: MemTotal ${total:+$(gib "$total")}, MemAvailable" \
        "${avail:+$(gib "$avail")}; $cg"
}
export -f gib host_memory_info  # env_info runs in its own bash (stage)

env_info() {
    if command -v nvidia-smi >/dev/null; then
        echo "info driver: $(nvidia-smi --query-gpu=name,driver_version,memory.total \
            --format=csv,noheader 2>&1 | paste -sd ';')"
        nvidia-smi
    else
        echo "info driver: nvidia-smi not found"
    fi
    echo "info cc: $( (cc --version 2>&1 || echo 'no cc on PATH') | head -n 1)"
    host_memory_info
    # The host CPU, for the CPU-Adam stage: its model, logical CPUs and the SIMD the kernel uses
    echo "info cpu: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1);" \
        "$(nproc) logical CPUs; $(grep -o -w -E 'avx2|f16c|avx512f|avx512bw|avx512vl|avx512_bf16' \
        /proc/cpuinfo | sort -u | paste -sd ' ')"
    # Versions from the package metadata: importing torch or transformers here would cost
    # seconds on a machine without a GPU, where the cuda stage must fail fast.
    "$PY" - <<'EOF'
import importlib.metadata as md
import platform
import sys

print(f"info python: {sys.executable} ({platform.python_version()})")
found = []
for name in ("torch", "triton", "transformers", "accelerate", "tokenizers", "datasets", "peft",
             "Cython", "setuptools", "pytest", "numpy"):
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} missing")
print("info versions: " + ", ".join(found))
EOF
}

cuda_check() {
    "$PY" - <<'EOF'
import sys

try:
    import torch
except Exception as exc:
    sys.exit(f"no CUDA device available: cannot import torch ({exc!r})")
print(f"info torch: {torch.__version__}, built with CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit(f"no CUDA device available: torch.cuda.is_available() is False (torch "
             f"{torch.__version__}, built with CUDA {torch.version.cuda})")
p = torch.cuda.get_device_properties(0)
print(f"info gpu: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
      f"{p.multi_processor_count} SMs; {torch.cuda.device_count()} device(s) visible")
n = 1 << 20
assert torch.ones(n, device="cuda").sum().item() == n  # a kernel runs and returns
print("a kernel ran on the device")
EOF
}

gpu_tests() {
    # tests/gpu/ holds the engine checks, which the stages after this one run one at a time
    local rc out="$SCRATCH/gpu_tests.out"
    "$PY" -m pytest tests -m gpu --ignore=tests/gpu -q -p no:cacheprovider --durations=15 \
        --continue-on-collection-errors 2>&1 | tee "$out"
    rc=${PIPESTATUS[0]}
    # pytest's last line: "24 passed in 51.20s", or the failures and errors
    echo "summary: $(grep -E '[0-9]+ (passed|failed|error|errors|skipped|deselected)' "$out" \
        | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')"
    if [ "$rc" -eq 5 ]; then
        echo "gpu_check: pytest collected no gpu test (exit 5), which counts as a failure"
        return 1
    fi
    return "$rc"
}

gpu_test() {  # gpu_test [PYTEST_OPTION...] TEST...: pytest -m gpu on these tests of tests/gpu/
    # Their figures are the "summary: " lines printed after pytest's report; a test that
    # skips fails (HF_ZOFFLOAD_REQUIRE_GPU=1), and so does a run that selects none (exit 5).
    # Their tmp_path folders (run_clm's two saved models: ~0.6 GB) go into SCRATCH.
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --basetemp "$SCRATCH/pytest" "$@"
}
export -f gpu_test  # race_sanitizer calls it from its own bash

race_sanitizer() {
    # torch's CUDA stream sanitizer (torch/cuda/_sanitizer.py) prints each unsynchronized
    # access it finds to stderr, starting "CSAN detected a possible data race", and raises
    # CUDASanitizerErrors from that op. A report fails the stage even where the exception was
    # swallowed on the way (a hook, a thread); -s turns pytest's capture off, so that such a
    # report reaches the log from a test that passed too. The test checks first that the
    # sanitizer is on and reports a planted race (that report is not printed).
    local rc races out="$SCRATCH/race_sanitizer.out"
    TORCH_CUDA_SANITIZER=1 gpu_test -s \
        tests/gpu/test_race.py::test_race_under_the_cuda_sanitizer 2>&1 | tee "$out"
    rc=${PIPESTATUS[0]}
    races="$(grep -c 'CSAN detected a possible data race' "$out")"
    if [ "${races:-0}" -gt 0 ]; then
        echo "summary: **the CUDA stream sanitizer reported $races possible data race(s)**"
        echo "gpu_check: the CUDA stream sanitizer reported $races possible data race(s)"
        return 1
    fi
    return "$rc"
}

echo "gpu_check: python $PY; logs and summary.md in $OUT"
stage env 6 env_info
if ! stage cuda 12 cuda_check; then
    NOTE="no CUDA device available to $PY (see cuda.log); nothing after the cuda stage was run"
    write_summary
    echo "gpu_check: FAIL: $NOTE" >&2
    tail -n 3 "$OUT/cuda.log" >&2
    exit 1
fi
# Timeouts, env and cuda included, sum to 280 s of the 300 s budget (20 s spare: the kill
# grace and a slow start). They are estimates for one H200, not yet measured: each Python
# stage spends ~3-5 s importing torch (and transformers); Triton compiles each kernel once per
# machine (later stages reuse its cache). Correctness first, measurements last.
stage build 18 "$PY" setup.py build_ext --inplace --force  # 8-13 s on the 2-vCPU VM
# 29 s, not 25: tests/ops/test_masters.py added to both runs (issue 33), 13 CPU-s beside the
# other two files' 36 on the loaded 2-vCPU VM: ~+36%, ~3.5 s a run at the 9 s measured before.
stage kernel_tests 29 bash scripts/gpu_kernel_tests.sh
stage gpu_tests 30 gpu_tests  # 27 tests; collecting the suite took 6 s on the VM
# The engine checks: their sizes (steps, configurations) are the tests' own constants, each
# chosen there for this stage's timeout. pytest adds its start and collection to each: ~1 s
# estimated there; 3-5 s measured on the loaded 2-vCPU VM, where importing torch took 19 s.
stage race 15 gpu_test tests/gpu/test_race.py::test_race_stress
stage race_sanitizer 20 race_sanitizer
stage nccl_one_rank 11 gpu_test tests/gpu/test_nccl_one_rank.py::test_one_rank_nccl_group
stage host_memory 9 gpu_test \
    tests/gpu/test_host_memory.py::test_pinned_allocator_holds_what_the_report_counts
# 19 s, not 25 (~15 s estimated, each run's limit 16 s): 6 s went to practicality's
# offload_fraction rows (issue 25).
stage run_clm 19 gpu_test tests/gpu/test_clm_compare.py::test_run_clm_with_and_without_zero_offload
# 9 GiB: AMP AdamW is predicted to fit 1 layer of 4096 (0.46B params: 8.5 GiB at 18 B/param
# and 0.75 GiB beside) and not 2 (11.9 GiB); zoffload 20 (4.3B), whose fp32-state probe
# (59 GiB of host) and the next rung's int8 one (37 GiB) fit the 128 GiB host at once: one
# round, ~25 s estimated. At 16 GiB the two would need 175 GiB, one after the other.
# 34 s, not 40: 6 s went to practicality's offload_fraction rows (issue 25).
# --fsdp2 (issue 26): one more probe, FSDP2 parameter offload at 23 layers (4.92B params, whose
# bf16 weights alone pass the 9 GiB), bf16 master and int4 moments: ~54 GiB of host, so the
# round takes two batches, ~15 s more (estimated). No time was added (the budget is full):
# gpu_size.py starts no batch that would not end in its time limit, and names what it left.
# Issue 33: each probe's seconds are planned from its host passes (placement and the re-layout
# after step 1, at the 2-vCPU rates: the 20-layer fp32 probe ~106 s, far past the stage), so
# the ladder starts where a probe can finish and the figures are lower bounds until the first
# run's placement seconds say what --host_speed the H200's host has.
stage size 34 "$PY" scripts/bench/gpu_size.py --cap_gib 9 --fsdp2
# These two replace bench_offload.py --device cuda (the same ways on GPT-2-124M, 55 s): on a
# 1.1B model the CPU-Adam's share of a step is what a user of offload meets.
# +12 s for offload_fraction 0, 0.5 and auto (issue 25): three more ways of ~4 s each
# estimated (fractions 0 and auto keep the state on the H200: fused AdamW, no CPU-Adam).
# --fsdp2 (issue 26): two more ways, last, FSDP2 parameter offload with our CPU step and with
# torch's fused AdamW on the host, ~6 s each estimated (1.1B params built on the host, 5
# steps). No time was added: gpu_practicality.py starts no way that would not end in its
# time limit, and names the ways it left out.
stage practicality 40 "$PY" scripts/bench/gpu_practicality.py \
    --json "$SCRATCH/practicality.json" --offload_fractions 0,0.5,auto --fsdp2
stage peers 18 "$PY" scripts/bench/gpu_peers.py --wheels "$ROOT/wheels" \
    --against "$SCRATCH/practicality.json"
# 100M fp16 elements: 4 buckets of the default 25M instead of 40. Per-bucket costs (launch,
# read) and so every ratio in the table stay the same; allocation and timing take a tenth.
stage bench_scaling 7 "$PY" scripts/bench/bench_scaling.py --elements 100000000
# Last, so it never takes time from a GPU check: the CPU-Adam on the host CPU, another x86 than
# the development VM (often with AVX-512: issue 12 asks for >= 0.90 of the ceiling there too).
# 10M params (280 MB a pass in fp32, past most L3s), 1 thread and all of them, one int8 block
# size, 3 timed calls a row: 10.0 s on the 2-vCPU VM (without DeepSpeed, as there).
stage bench_cpu_adam 12 "$PY" scripts/bench/bench_cpu_adam.py --sizes 10M --threads "1,$(nproc)" \
    --repeats 3 --qblocks 256
write_summary
cat "$OUT/summary.md"
echo "gpu_check: $([ "$STATUS" -eq 0 ] && echo PASS || echo FAIL); summary in $OUT/summary.md"
exit "$STATUS"
