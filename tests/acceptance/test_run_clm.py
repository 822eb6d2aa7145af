"""scripts/run_clm.py --zero_offload end to end: tiny model from a config, a tokenizer built
here, local text files, no network."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def offline_env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_run_clm_zero_offload_end_to_end(tmp_path):
    from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

    docs = stdlib_corpus(max_mb=0.15)
    (tmp_path / "train.txt").write_text("\n".join(docs[:-2]))
    (tmp_path / "valid.txt").write_text("\n".join(docs[-2:]))
    train_tokenizer(docs, vocab_size=300).save_pretrained(tmp_path / "tok")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "run_clm.py"),
           "--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=32,n_head=2",
           "--tokenizer_name", str(tmp_path / "tok"),
           "--train_file", str(tmp_path / "train.txt"),
           "--validation_file", str(tmp_path / "valid.txt"),
           "--block_size", "32", "--max_train_samples", "64", "--max_eval_samples", "16",
           "--do_train", "--do_eval", "--zero_offload", "--max_steps", "6",
           "--per_device_train_batch_size", "4", "--logging_steps", "2",
           "--learning_rate", "3e-3", "--output_dir", str(out), "--report_to", "none",
           "--use_cpu", "--disable_tqdm", "true", "--save_strategy", "no"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=offline_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "perplexity" in text and f"model saved to {out}" in text
    assert "cpu_adam_ms" in text and "plain AMP AdamW would need" in text
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training_args.bin",
                 "eval_results.json", "train_results.json"):
        assert (out / name).is_file(), name
    evals = json.loads((out / "eval_results.json").read_text())
    assert 1.0 < evals["perplexity"] < 1e4
    assert evals["perplexity"] == pytest.approx(2.718281828 ** evals["eval_loss"], rel=1e-6)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.n_layer == 2 and model.config.vocab_size == 300


def test_help_says_what_it_does(capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import run_clm
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    with pytest.raises(SystemExit) as exit_info:
        run_clm.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "causal language model" in text and "--zero_offload" in text
    for option in ("--model_name_or_path", "--config_name", "--model_type", "--config_overrides",
                   "--tokenizer_name", "--dataset_name", "--train_file", "--validation_file",
                   "--block_size", "--max_train_samples", "--validation_split_percentage"):
        assert option in text, option
