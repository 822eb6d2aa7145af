"""scripts/run_clm.py --zero_offload end to end: tiny model from a config, a tokenizer built
here, local text files, no network."""

import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._preloaded import Preloaded

ROOT = Path(__file__).resolve().parents[2]


def offline_env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_env(**extra):
    """A run's environment: offline, no GPU, one torch thread, none of the caller's
    ZeRO-Offload, accelerate or FSDP settings."""
    env = {k: v for k, v in offline_env().items()
           if not k.startswith(("HF_ZOFFLOAD_", "ACCELERATE_", "FSDP_"))}
    return dict(env, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **extra)


@pytest.fixture(scope="module")
def clm():
    """run_clm.py imported once; the runs of this file fork from it (tests/_preloaded.py: a
    run started afresh spends ~8 of its ~10 CPU-s importing). The runs a user's command is
    about (`python scripts/run_clm.py`, `accelerate launch`, torchrun) stay real processes."""
    with Preloaded(ROOT / "scripts" / "run_clm.py", run_env(),
                   "import datasets; from transformers import GPT2LMHeadModel, "
                   "LlamaForCausalLM") as server:
        yield server


def _fork(clm, argv, *, cwd, env=None, name="run"):
    """One forked run of run_clm.py: (exit status, its stdout and stderr)."""
    log = Path(cwd) / f"{name}.log"
    rc = clm.start(argv, out=log, cwd=cwd, env=env).wait(timeout=400)
    return rc, log.read_text()


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


@pytest.mark.slow
def test_run_clm_two_processes_save_and_resume(tmp_path, clm):
    """ZeroOffloadTrainer on 2 CPU ranks (gloo) started as torchrun starts them (forked from
    ``clm``; the launchers themselves: from_config's torchrun, and `hf-zoffload launch
    --multi_gpu` in tests/commands/test_launch.py): trains unwrapped (the engine partitions
    the host state), saves a checkpoint whose optimizer.pt holds the whole state, and
    resumes from it with one process."""
    import torch

    from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

    docs = stdlib_corpus(max_mb=0.1)
    (tmp_path / "train.txt").write_text("\n".join(docs[:-2]))
    (tmp_path / "valid.txt").write_text("\n".join(docs[-2:]))
    train_tokenizer(docs, vocab_size=300).save_pretrained(tmp_path / "tok")
    out = tmp_path / "out"
    common = ["--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=32,n_head=2",
              "--tokenizer_name", str(tmp_path / "tok"), "--train_file",
              str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "valid.txt"),
              "--block_size", "32", "--max_train_samples", "64", "--zero_offload",
              "--do_train", "--max_steps", "4", "--per_device_train_batch_size", "2",
              "--learning_rate", "3e-3", "--output_dir", str(out), "--report_to", "none",
              "--use_cpu", "--disable_tqdm", "true", "--save_strategy", "steps",
              "--save_steps", "2", "--ddp_timeout", "60", "--logging_steps", "1"]
    env = run_env(HF_ZOFFLOAD_COMPUTE_DTYPE="fp32")
    (tmp_path / "ranks").mkdir()
    rc, text = clm.torchrun(2, common, out_dir=tmp_path / "ranks", cwd=tmp_path, env=env,
                            timeout=600)
    assert rc == 0, text[-6000:]
    ckpt = out / "checkpoint-2"
    state = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    n_params = sum(len(g["params"]) for g in state["param_groups"])
    assert len(state["state"]) == n_params  # gathered from both ranks: every param's state
    assert state["zero_offload"]["world_size"] == 2
    # the saved weights are the masters gathered from both ranks' shards, bit for bit (the
    # optimizer state gathers them by another path)
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model.safetensors"))
    masters = [s["master"] for s in state["state"].values()]
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert all(any(m.shape == t.shape and torch.equal(m, t) for m in masters)
               for t in weights.values())

    # resume the 2-rank checkpoint with one process
    rc, text = _fork(clm, [*common, "--resume_from_checkpoint", str(ckpt)], cwd=tmp_path,
                     env=env, name="resume")
    assert rc == 0, text[-6000:]
    assert (out / "checkpoint-4" / "optimizer.pt").is_file()


@pytest.mark.parametrize("argv, match", [
    (["--dataset_name", "x", "--train_file", "t.txt"], "give one data source"),
    (["--model_name_or_path", "m", "--config_overrides", "n_layer=2"], "brings its own config"),
    (["--config_name", "c", "--model_type", "gpt2"], "--config_name with --model_type"),
    (["--tp_size", "2"], "--tp_size needs --zero_offload"),
    (["--tp_size", "0", "--zero_offload"], "--tp_size must be >= 1, got 0"),
    (["--tp_size", "2", "--zero_offload"], "--tp_size 2 does not divide the 1 launched"),
    (["--model_type", "gpt2", "--config_overrides", "n_positions=512", "--block_size", "1024"],
     "--block_size 1024 exceeds the model's 512 positions: give --block_size 512 or less"),
    (["--block_size", "0"], "--block_size must be >= 1, got 0"),
    (["--model_type", "gpt3"], "unknown --model_type 'gpt3'"),
])
def test_options_that_would_be_ignored_raise(argv, match, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import run_clm
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    with pytest.raises(ValueError, match=match):
        run_clm.main([*argv, "--output_dir", str(tmp_path), "--use_cpu"])


def _run_clm_module():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import run_clm
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return run_clm


def test_block_size_defaults_to_the_model_positions():
    """Issue 24: the default block of 1024 ran past a 512-position model's embedding."""
    from transformers import GPT2Config, LlamaConfig

    choose = _run_clm_module().choose_block_size
    huge = int(1e30)  # a tokenizer trained here has no limit
    assert choose(None, GPT2Config(n_positions=512), huge) == 512
    assert choose(None, LlamaConfig(max_position_embeddings=256), huge) == 256
    assert choose(None, LlamaConfig(max_position_embeddings=4096), huge) == 1024
    assert choose(None, GPT2Config(n_positions=512), 128) == 128  # the tokenizer's limit
    assert choose(None, None, huge) == 64  # the built-in model
    assert choose(512, GPT2Config(n_positions=512), huge) == 512
    with pytest.raises(ValueError, match="--block_size 513 exceeds the model's 512 positions"):
        choose(513, GPT2Config(n_positions=512), huge)


def test_torchrun_on_cpus_adds_use_cpu():
    """Issue 24: torchrun on a machine without a GPU and without --use_cpu: accelerate set up
    no process group, so each rank trained alone; run_clm adds --use_cpu then."""
    launched = {"WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    decide = _run_clm_module().cpu_launch
    assert decide([], launched, None) is True
    assert decide(["--use_cpu"], launched, None) is False  # given: the user's choice
    assert decide(["--use_cpu=false"], launched, None) is False
    assert decide([], dict(launched, ACCELERATE_USE_CPU="true"), None) is False
    assert decide([], launched, torch.device("cuda")) is False  # accelerate sets up NCCL
    assert decide([], {}, None) is False  # not launched: nothing to set up
    assert decide([], {"WORLD_SIZE": "1"}, None) is False
    # one launched process: distributed for accelerate only with --use_cpu (--fsdp needs it)
    assert decide([], {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, None) is True


@pytest.mark.parametrize("argv, line", [
    (["--model_name_or_path", "./no-such-model"], "FileNotFoundError: --model_name_or_path "
     "./no-such-model: no such file or directory (a local path must exist; a hub id is "
     "'name' or 'org/name')"),
    (["--tokenizer_name", "./tokenizer"], "FileNotFoundError: --tokenizer_name ./tokenizer: "
     "no such file or directory"),
    (["--config_name", "configs/missing.json"], "FileNotFoundError: --config_name "
     "configs/missing.json: no such file or directory"),
    (["--config_name", "a/b/c"], "FileNotFoundError: --config_name a/b/c: no such file"),
    (["--model_name_or_path", "empty"], "FileNotFoundError: --model_name_or_path empty: no "
     "config.json in that directory"),
    (["--tokenizer_name", "train.txt"], "NotADirectoryError: --tokenizer_name train.txt: a "
     "file; expected a directory"),
    (["--train_file", "data.parquet"], "ValueError: --train_file data.parquet: unsupported "
     "extension .parquet; allowed: .txt, .json, .jsonl, .csv"),
    (["--train_file", "data"], "ValueError: --train_file data: unsupported extension (none)"),
    (["--train_file", "missing.txt"], "FileNotFoundError: --train_file missing.txt: no such "
     "file"),
    (["--train_file", "train.txt", "--validation_file", "valid.csv"], "ValueError: "
     "--train_file and --validation_file of different kinds"),
    (["--zero_offload", "--fsdp", "full_shard offload"], "ValueError: --fsdp needs a "
     "distributed launch"),
])
def test_local_paths_are_checked_before_anything_loads(argv, line, tmp_path, monkeypatch,
                                                       capsys):
    """Issue 35, item 4: a missing or mistyped local path went to the hub (34-53 s offline,
    40-110 lines, exit 1). Now one line, exit 2, no connection tried, nothing written; and
    --fsdp in a process that is not distributed is refused before any work (item 6)."""
    import socket

    run_clm = _run_clm_module()
    tried = []

    def connect(self, address):
        tried.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.delenv("HF_ZOFFLOAD_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "train.txt").write_text("some text\n")
    (tmp_path / "valid.csv").write_text("text\nsome text\n")
    rc = run_clm.cli([*argv, "--output_dir", str(tmp_path / "out"), "--use_cpu",
                      "--report_to", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"run_clm.py: error: {line}"), err[0]
    assert tried == [] and not (tmp_path / "out").exists()


def test_hub_ids_still_go_to_the_hub(tmp_path, monkeypatch):
    """A value that is no local path and can be a hub id passes the check and is read from
    the hub (here a stand-in for it: AutoConfig.from_pretrained mocked)."""
    import transformers
    from transformers import GPT2Config

    run_clm = _run_clm_module()
    monkeypatch.chdir(tmp_path)
    asked = []
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda name, **kw: asked.append(name) or GPT2Config(n_layer=1))
    for hub_id in ("gpt2", "openai-community/gpt2"):
        margs = run_clm.ModelArguments(model_name_or_path=hub_id, tokenizer_name=hub_id)
        run_clm.check_paths(margs, run_clm.DataArguments())
        assert run_clm.model_config(margs).n_layer == 1
    assert asked == ["gpt2", "openai-community/gpt2"]


@pytest.mark.parametrize("argv, line", [
    (["--zero_offload", "--zero_offload_bucket_size_mb", "-1"],
     "run_clm.py: error: ValueError: --zero_offload_bucket_size_mb: ZeRO-Offload setting "
     "'bucket_size_mb': -1.0 is not allowed"),
    (["--model_type", "gpt3"], "run_clm.py: error: ValueError: unknown --model_type 'gpt3'"),
])
@pytest.mark.slow
def test_configuration_errors_are_one_line(argv, line, tmp_path, clm):
    """Issue 24: a bad value arrived after 9-29 lines of traceback; now one line and exit
    status 2, the traceback only with HF_ZOFFLOAD_TRACEBACK=1."""
    argv = [*argv, "--output_dir", str(tmp_path / "out"), "--use_cpu", "--report_to", "none"]
    rc, text = _fork(clm, argv, cwd=tmp_path, name="one_line")
    assert rc == 2, text[-3000:]
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), text[-3000:]
    assert not (tmp_path / "out").exists()  # refused before any work
    rc, text = _fork(clm, argv, cwd=tmp_path, env=run_env(HF_ZOFFLOAD_TRACEBACK="1"),
                     name="traceback")
    assert rc == 1 and "Traceback (most recent call last)" in text


@pytest.mark.slow
def test_a_configuration_error_is_one_line_from_a_fresh_process(tmp_path):
    """What `python scripts/run_clm.py` prints, imports included: the one line alone."""
    cmd = [sys.executable, str(ROOT / "scripts" / "run_clm.py"), "--zero_offload",
           "--zero_offload_bucket_size_mb", "-1", "--output_dir", str(tmp_path / "out"),
           "--use_cpu", "--report_to", "none"]
    env = offline_env()
    env.pop("HF_ZOFFLOAD_TRACEBACK", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "run_clm.py: error: ValueError: --zero_offload_bucket_size_mb"), proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_evaluation_only_needs_only_the_validation_data(tmp_path):
    """--do_eval --model_name_or_path M --validation_file V: no train file (issue 15, item
    10); an unknown --zero_offload_<name> is one line naming the closest setting."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

    docs = stdlib_corpus(max_mb=0.05)
    (tmp_path / "valid.txt").write_text("\n".join(docs))
    tok = train_tokenizer(docs, vocab_size=300)
    model_dir = tmp_path / "model"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=2,
                               n_head=2)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import run_clm
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    common = ["--model_name_or_path", str(model_dir), "--validation_file",
              str(tmp_path / "valid.txt"), "--block_size", "32", "--max_eval_samples", "8",
              "--output_dir", str(tmp_path / "out"), "--use_cpu", "--report_to", "none"]
    with pytest.raises(ValueError, match="--do_train with --validation_file needs --train_file"):
        run_clm.main(["--do_train", *common])
    with pytest.raises(ValueError, match="did you mean '--zero_offload_bucket_size_mb'"):
        run_clm.main(["--do_eval", "--zero_offload_bucket_size", "4", *common])
    results = run_clm.main(["--do_eval", *common])
    assert results["eval_samples"] == 8 and 1.0 < results["perplexity"] < 1e4
    assert (tmp_path / "out" / "eval_results.json").is_file()


# ------------------------------------------------------------- tensor parallelism (--tp_size)
LLAMA = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2," \
        "num_key_value_heads=2,max_position_embeddings=32"


def _tp_data(tmp_path):
    from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

    docs = stdlib_corpus(max_mb=0.1)
    (tmp_path / "train.txt").write_text("\n".join(docs[:-2]))
    (tmp_path / "valid.txt").write_text("\n".join(docs[-2:]))
    tok = train_tokenizer(docs, vocab_size=300)
    tok.save_pretrained(tmp_path / "tok")
    return tok


def _clm(clm, tmp_path, name, argv, *, ranks=1, use_cpu=True, output=None, torchrun=False):
    """run_clm.py forked from ``clm``: one process, or ``ranks`` started as torchrun starts
    them (``torchrun``: under torchrun itself, real processes); its log entries (and its
    stdout and stderr appended to ``output`` if given)."""
    out = tmp_path / name
    args = [*argv, "--train_file", str(tmp_path / "train.txt"), "--validation_file",
           str(tmp_path / "valid.txt"), "--block_size", "32", "--max_train_samples", "64",
           "--max_eval_samples", "8", "--do_train", "--do_eval", "--zero_offload",
           "--max_steps", "4", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
           "--report_to", "none", *(["--use_cpu"] if use_cpu else []), "--disable_tqdm",
           "true", "--save_strategy", "no", "--logging_steps", "1", "--output_dir", str(out),
           # the memory figures in log_history: on its first entry (off: the stock entries)
           "--zero_offload_log_history_extras"]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(ranks), str(ROOT / "scripts" / "run_clm.py"), *args]
        proc = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True,
                              text=True, timeout=400)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    elif ranks == 1:
        rc, text = _fork(clm, args, cwd=tmp_path, name=name)
    else:
        logs = tmp_path / f"{name}_logs"
        logs.mkdir()
        rc, text = clm.torchrun(ranks, args, out_dir=logs, cwd=tmp_path)
    assert rc == 0, text[-6000:]
    if output is not None:
        output.append(text)
    state = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = json.loads((out / "eval_results.json").read_text())
    return [e for e in state if "loss" in e], state[0]["offload_host_mib"], evals


def _same_run(one, two):
    (logs1, host1, eval1), (logs2, host2, eval2) = one, two
    assert len(logs1) == len(logs2) == 4
    for a, b in zip(logs1, logs2):  # fp32: rounding apart (the row-parallel all-reduces)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert eval2["eval_loss"] == pytest.approx(eval1["eval_loss"], rel=1e-5)
    # each rank holds its shards' host state: about half. The norms are whole, and so is the
    # embedding where the model's plan leaves it whole (5.17's Llama plan does, 5.21 on shard
    # it): by param count a rank holds 0.501 of one process's, or 0.550 (the embedding is
    # 9,600 of 97,184 params; LlamaConfig's head_dim of 128 stays with hidden_size=32).
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300)
    config.update_from_string(LLAMA)
    shards_embedding = "model.embed_tokens" in LlamaForCausalLM(config).tp_plan
    assert 0.45 * host1 < host2 < (0.55 if shards_embedding else 0.6) * host1


@pytest.fixture(scope="module")
def from_config(tmp_path_factory, clm):
    """--model_type llama: one process, and --tp_size 2 under torchrun itself without
    --use_cpu (run_clm adds it on CPUs; the run of
    test_tp_size_from_pretrained_equals_one_process gives it): (their log entries, host MiB,
    eval results) and the torchrun run's output."""
    tmp_path = tmp_path_factory.mktemp("from_config")
    _tp_data(tmp_path)
    argv = ["--model_type", "llama", "--config_overrides", LLAMA, "--tokenizer_name",
            str(tmp_path / "tok")]
    output = []
    one = _clm(clm, tmp_path, "one", argv)
    two = _clm(clm, tmp_path, "two", [*argv, "--tp_size", "2"], ranks=2, use_cpu=False,
               output=output, torchrun=True)
    return one, two, output[0]


@pytest.mark.slow
def test_tp_size_from_a_config_equals_one_process(from_config):
    """--model_type llama --tp_size 2 under torchrun: every rank builds the same weights,
    the Trainer shards them; losses, norms and eval loss are one process's."""
    one, two, _ = from_config
    _same_run(one, two)


@pytest.mark.slow
def test_tp_size_from_pretrained_equals_one_process(tmp_path, clm):
    """--model_name_or_path M --tp_size 2: each rank loads its shards (transformers'
    sharded loading, every rank tensor parallel); one process's run; the model saved whole
    loads in one process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tp_data(tmp_path)
    model_dir = tmp_path / "model"
    config = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False)
    config.update_from_string(LLAMA)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    argv = ["--model_name_or_path", str(model_dir)]
    one = _clm(clm, tmp_path, "one", argv)
    _same_run(one, _clm(clm, tmp_path, "two", [*argv, "--tp_size", "2"], ranks=2))
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "one" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.slow
def test_torchrun_without_use_cpu_is_two_ranks(from_config):
    """Issue 24: docs/tensor_parallel.md's command without --use_cpu on CPUs: it failed with
    '--tp_size 2 does not divide the 1 launched processes'; now run_clm adds --use_cpu, says
    so once (rank 0), and the two ranks shard the model as with it (the run that
    test_tp_size_from_a_config_equals_one_process compares with one process)."""
    _, (logs, _, evals), output = from_config
    assert output.count("2 launched processes and no GPU: added --use_cpu") == 1, output
    assert len(logs) == 4 and evals["eval_loss"] > 0


@pytest.mark.slow
def test_run_clm_fsdp_full_shard_offload_equals_the_plain_mode(tmp_path, clm):
    """run_clm.py --zero_offload --fsdp --fsdp_config '{"version": 2, "cpu_offload": true}'
    (one rank, as torchrun starts it: transformers refuses FSDP outside distributed training)
    on GPT-2 with its tied head:
    the Trainer shards it with accelerate's FSDP2 policy and the engine trains the shards;
    the losses and the eval loss are the plain --zero_offload run's."""
    from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

    docs = stdlib_corpus(max_mb=0.1)
    (tmp_path / "train.txt").write_text("\n".join(docs[:-2]))
    (tmp_path / "valid.txt").write_text("\n".join(docs[-2:]))
    train_tokenizer(docs, vocab_size=300).save_pretrained(tmp_path / "tok")
    argv = ["--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=32,n_head=2",
            "--tokenizer_name", str(tmp_path / "tok"), "--train_file", str(tmp_path / "train.txt"),
            "--validation_file", str(tmp_path / "valid.txt"), "--block_size", "32",
            "--max_train_samples", "64", "--max_eval_samples", "8", "--do_train", "--do_eval",
            "--zero_offload", "--max_steps", "4", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3",
            "--report_to", "none", "--disable_tqdm", "true",
            "--save_strategy", "no", "--logging_steps", "1",
            "--zero_offload_log_history_extras"]
    got = {}
    # the FSDP2 run as a user types it on a CPU machine: no --use_cpu (issue 35, item 6: the
    # one launched process was not distributed, and transformers refused --fsdp)
    fsdp = ["--fsdp", "--fsdp_config", '{"version": 2, "cpu_offload": true}']  # the README's
    for name, extra in (("fsdp", fsdp), ("plain", ["--use_cpu"])):
        out = tmp_path / name
        logs = tmp_path / f"{name}_logs"
        logs.mkdir()
        rc, text = clm.torchrun(1, [*argv, *extra, "--output_dir", str(out)], out_dir=logs,
                                cwd=tmp_path)
        assert rc == 0, text[-4000:]
        state = json.loads((out / "trainer_state.json").read_text())["log_history"]
        got[name] = ([e for e in state if "loss" in e],
                     json.loads((out / "eval_results.json").read_text()), text)
    (fsdp, fsdp_eval, text), (plain, plain_eval, plain_text) = got["fsdp"], got["plain"]
    # the memory report's host line counts FSDP2's sharded params (the engine's 16-bit copy)
    host_params = re.compile(r"host .*\bparams [\d.]+ KiB")
    assert host_params.search(text) and not host_params.search(plain_text)
    assert len(fsdp) == len(plain) == 4
    for a, b in zip(fsdp, plain):  # fp32: a rounding or two apart per step
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert fsdp_eval["eval_loss"] == pytest.approx(plain_eval["eval_loss"], rel=1e-5)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp")  # whole, fp32
    assert saved.config.n_layer == 2 and saved.lm_head.weight is saved.transformer.wte.weight


def test_do_eval_without_validation_data_says_what_it_evaluates(tmp_path, monkeypatch, caplog):
    """Issue 35, item 5: --do_eval without --validation_file evaluated the built-in corpus's
    held-out part without a word."""
    from tests._env import fresh_accelerate_state

    run_clm = _run_clm_module()
    with fresh_accelerate_state(monkeypatch), caplog.at_level(logging.INFO, logger="run_clm"):
        got = run_clm.main(["--do_eval", "--model_type", "gpt2", "--config_overrides",
                            "n_layer=1,n_embd=16,n_head=2", "--corpus_mb", "0.02",
                            "--vocab_size", "300", "--block_size", "16",
                            "--max_eval_samples", "4", "--output_dir", str(tmp_path),
                            "--use_cpu", "--report_to", "none", "--disable_tqdm", "true"])
    said = [r.getMessage() for r in caplog.records if "--do_eval without" in r.getMessage()]
    assert said == ["--do_eval without --validation_file: evaluating on the last 5% of the "
                    "built-in standard-library corpus, held out of training"], said
    assert got["eval_samples"] == 4 and math.isfinite(got["eval_loss"])
