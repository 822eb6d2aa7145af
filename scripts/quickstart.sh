#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup_env.sh
echo "training arrives with the offload engine"
