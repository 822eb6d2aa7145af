"""scripts/quickstart.sh's default path (built-in model, stdlib corpus, --zero_offload) with a
step limit small enough for CI; the venv setup is skipped, the python command is the same."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_default_path(tmp_path):
    out = tmp_path / "qs"
    env = dict(os.environ, QUICKSTART_SKIP_SETUP="1", PYTHON=sys.executable,
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # 8 steps on a 0.3 MB corpus instead of 300 on 2 MB: same path, about 20 s.
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "quickstart.sh"), "--max_steps", "8",
         "--logging_steps", "4", "--corpus_mb", "0.3", "--max_eval_samples", "16",
         "--output_dir", str(out)],
        env=env, capture_output=True, text=True, timeout=400)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "'loss':" in text or '"loss":' in text
    for needle in ("fwd_bwd_ms", "cpu_adam_ms", "plain AMP AdamW would need", "perplexity",
                   f"model saved to {out}"):
        assert needle in text, needle
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
