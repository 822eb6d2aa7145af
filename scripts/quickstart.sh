#!/usr/bin/env bash
# Set up .venv (as test.sh does), then train the built-in small GPT-2 on the Python standard
# library's sources with --zero_offload and report what happened: the falling loss and the
# per-step time split (log lines), the memory report, eval perplexity, where the model went.
# Extra arguments go to scripts/run_clm.py and override the ones below, e.g.
#   bash scripts/quickstart.sh --max_steps 100 --output_dir /tmp/qs
# QUICKSTART_SKIP_SETUP=1 skips the venv setup (the test suite uses it; python = $PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${QUICKSTART_SKIP_SETUP:-}" ]; then
    source scripts/_setup_env.sh
    PY=python
else
    PY="${PYTHON:-python}"
fi

# bf16 on a GPU; on a CPU the model computes in fp32 (no --fp16/--bf16 means fp32) and the
# data loader has no device memory to pin.
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    DEVICE_ARGS=(--bf16)
else
    DEVICE_ARGS=(--dataloader_pin_memory false)
fi

# 300 steps of 8 x 64 tokens: about 30 s of training on 2 idle CPU cores (80 ms a step).
"$PY" scripts/run_clm.py \
    --zero_offload \
    --do_train --do_eval \
    --output_dir quickstart_output \
    --max_steps 300 \
    --per_device_train_batch_size 8 --per_device_eval_batch_size 16 \
    --learning_rate 2e-3 --weight_decay 0.01 \
    --lr_scheduler_type cosine --warmup_steps 30 \
    --logging_steps 25 --save_strategy no --report_to none --disable_tqdm true \
    --max_eval_samples 200 \
    "${DEVICE_ARGS[@]}" "$@"
