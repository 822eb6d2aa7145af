#!/usr/bin/env bash
# Set up .venv from scratch (or refresh it) and run the test suite.
#   bash scripts/test.sh            # every test (what CI runs)
#   bash scripts/test.sh --fast     # every test not marked `slow` (the developers' tier)
#   bash scripts/test.sh [--fast] PYTEST_ARGS...   # e.g. tests/offload -k relayout
#   bash scripts/test.sh --stack device [--fast] ... # the same in a second venv with the GPU
#                                   # machine's stack (scripts/gpu/setup_stack.sh), built once
# Runs the tests in one worker process per core (pytest-xdist, each test file on one worker so
# that its module fixtures run once); `-n 0` among the arguments runs them in this process.
# Prints the 15 slowest tests at the end. Exits non-zero on any failure, and when no test was
# collected.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
stack=""
while [ $# -gt 0 ]; do
    case "$1" in
        --fast) tier=(-m "not slow"); shift ;;
        --stack)
            if [ "${2:-}" != "device" ]; then
                echo "test.sh: --stack takes one value, device (the GPU machine's versions);" \
                    "got '${2:-}'" >&2
                exit 2
            fi
            stack=device; shift 2 ;;
        *) break ;;
    esac
done
if [ "$stack" = device ]; then
    source scripts/gpu/setup_stack.sh
else
    source scripts/_setup_env.sh
fi
# One torch thread per worker and per process a test starts without its own setting (the
# caller's OMP_* win): beside a second worker, two threads each oversubscribe the cores and
# OpenMP's spinning waits burn the other worker's time. Measured on 2 cores, 10 in-process
# files on 2 workers: 112 s wall and 200 CPU-s with torch's default threads, 82 s and 134 with
# one, 75 s and 123 with one that sleeps when it waits (PASSIVE). Tests that need several
# threads ask for them (the kernels' num_threads, the engine's cpu_threads).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
set +e
# --no-loadscope-reorder: the files go out in collection order, tests/acceptance/ (the longest,
# end to end) first. xdist's default order, most tests first, sent the 5-test fidelity file
# (165 s) last: measured, the other worker sat idle for its last 60 s.
python -m pytest -n auto --dist loadfile --no-loadscope-reorder --durations=15 \
    ${tier[@]+"${tier[@]}"} "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test.sh: no tests were collected" >&2
    exit 1
fi
exit "$rc"
