#!/usr/bin/env bash
# Set up .venv from scratch (or refresh it) and run the test suite.
# Exits non-zero on any failure, and when no test was collected.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup_env.sh
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test.sh: no tests were collected" >&2
    exit 1
fi
exit "$rc"
