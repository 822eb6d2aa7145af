"""ZeroOffloadTrainer against the stock Trainer and a plain mixed-precision reference (CPU)."""

import logging
import math
import os
import pickle

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_scheduler,
)

from hf_zoffload.config import ZeroOffloadPlugin
from hf_zoffload.integrations import core
from hf_zoffload.integrations.trainer import ZeroOffloadTrainer, ZeroOffloadTrainingArguments
from tests._tiny import TokenBlocks

VOCAB, SEQ = 64, 16


def Tokens(n=32, seed=0):  # noqa: N802 (was a class; same calls)
    return TokenBlocks(n, vocab=VOCAB, seq=SEQ, seed=seed)


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=2, max_position_embeddings=SEQ))


# gradient accumulation 2, clipping that bites (norms start near 1.5-3) and cosine with warm-up
COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
              learning_rate=1e-2, weight_decay=0.1, lr_scheduler_type="cosine",
              warmup_steps=2, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
              report_to=[], use_cpu=True, seed=0, disable_tqdm=True, optim="adamw_torch")


def run(tmp_path, model, *, offload=None, trainer_cls=None, data=None, resume=None,
        callbacks=None, **kw):
    """Train; return (trainer, [per-step log entries])."""
    opts = dict(COMMON, output_dir=str(tmp_path), **kw)
    if offload is None:
        args, trainer_cls = TrainingArguments(**opts), trainer_cls or Trainer
    else:
        args = ZeroOffloadTrainingArguments(zero_offload=offload, **opts)
        trainer_cls = trainer_cls or ZeroOffloadTrainer
    trainer = trainer_cls(model=model, args=args, train_dataset=data or Tokens(),
                          callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [e for e in trainer.state.log_history if "loss" in e]


def column(logs, key):
    return [e[key] for e in logs]


# ------------------------------------------------------------------------ equivalence
@pytest.mark.slow
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_fp32_matches_stock_adamw(tmp_path, make):
    _, ref = run(tmp_path / "stock", make())
    trainer, got = run(tmp_path / "offload", make(), offload=True)
    assert trainer.engine is not None and trainer.engine.plugin.compute_dtype == "fp32"
    assert len(got) == len(ref) == COMMON["max_steps"]
    assert max(column(ref, "grad_norm")) > COMMON["max_grad_norm"]  # clipping was active
    # fp32 rounding: the CPU-Adam and torch's AdamW order their float ops differently (1e-7
    # relative per op). Measured over these 6 steps: losses equal, grad norms within 1.3e-6.
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-5)
    assert column(got, "learning_rate") == column(ref, "learning_rate")


@pytest.mark.slow
def test_off_is_the_stock_trainer(tmp_path):
    _, ref = run(tmp_path / "stock", gpt2(), max_steps=2)
    trainer, got = run(tmp_path / "off", gpt2(), offload=False, max_steps=2)
    assert trainer.engine is None
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW
    assert got == ref  # bit for bit, every logged key


def reference_bf16(model, data, *, steps, shifted_count):
    """Plain mixed precision: bf16 params for forward/backward, fp32 master weights and
    AdamW state, micro-batch grads summed in fp32, global-norm clipping, cosine warm-up.
    ``shifted_count``: whether the Trainer counts the loss's items over ``labels[:, 1:]``
    (it decides per model class; the GPT-2 and Llama classes differ)."""
    a = COMMON
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # LoRA: adapters
    master = {n: p.detach().float().clone() for n, p in named}
    for p in model.parameters():  # params only, as the engine and prepare_models cast: buffers
        p.data = p.data.to(torch.bfloat16)  # (Llama's rotary inv_freq) stay fp32
    opt = torch.optim.AdamW(
        [{"params": [master[n] for n, _ in named if n in decay], "weight_decay": a["weight_decay"]},
         {"params": [master[n] for n, _ in named if n not in decay], "weight_decay": 0.0}],
        lr=a["learning_rate"], betas=(0.9, 0.999), eps=1e-8)
    sched = get_scheduler("cosine", opt, num_warmup_steps=a["warmup_steps"],
                          num_training_steps=steps)
    bsz, gas, logs, i = a["per_device_train_batch_size"], a["gradient_accumulation_steps"], [], 0
    for _ in range(steps):
        micro = []
        for _ in range(gas):
            micro.append(data.ids[i:i + bsz])
            i += bsz
        n_items = sum(int(m[:, int(shifted_count):].numel()) for m in micro)
        acc = {n: torch.zeros_like(master[n]) for n, _ in named}
        loss_sum = 0.0
        for ids in micro:
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=n_items).loss
            loss.backward()
            loss_sum += loss.item()
            for n, p in named:
                acc[n] += p.grad.float()
                p.grad = None
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                     for g in acc.values()])).item()
        coef = min(1.0, a["max_grad_norm"] / (norm + 1e-6))
        for n, _ in named:
            master[n].grad = acc[n] * coef
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        with torch.no_grad():
            for n, p in named:
                p.copy_(master[n])
        logs.append({"loss": loss_sum, "grad_norm": norm, "learning_rate": lr})
    return logs


@pytest.mark.slow
@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_bf16_matches_plain_mixed_precision(tmp_path, make):
    data = Tokens()
    trainer, got = run(tmp_path, make(), offload=True, bf16=True, data=data,
                       train_sampling_strategy="sequential")
    ref = reference_bf16(make(), data, steps=COMMON["max_steps"],
                         shifted_count=trainer._loss_shifts_labels)
    assert trainer.engine.plugin.compute_dtype == "bf16"
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    # Same bf16 forward/backward on the same bf16 params; the only difference is the fp32
    # AdamW's op order (1e-7 relative), which now and then flips the bf16 rounding of a param
    # by one ulp (2**-8 relative). Measured (2-vCPU EPYC): losses within 5.1e-6, grad norms
    # within 2.4e-4 (GPT-2; Llama 4.4e-6 and 2.9e-5; Llama was 4.3e-5 and 4.5e-4 while the
    # reference also cast the rotary inv_freq buffer to bf16). Bounds: far below a real bug
    # (a wrong scale, clip or missed micro-batch moves the first steps' losses by 1e-2 or more).
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=5e-4)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=2e-3)
    assert column(got, "learning_rate") == pytest.approx(column(ref, "learning_rate"))


# ------------------------------------------------------------------------ checkpoints
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_continues_the_same_run(tmp_path, precision):
    kw = {precision: True, "save_strategy": "steps", "save_steps": 3}
    if precision == "fp16":
        kw["zero_offload_init_scale"] = 2.0**10  # a scale fp16 grads of this model survive
    _, full = run(tmp_path / "full", gpt2(), offload=True, **kw)
    ckpt = tmp_path / "full" / "checkpoint-3"
    names = set(os.listdir(ckpt))
    assert {"optimizer.pt", "scheduler.pt"} <= names
    # the loss scale is in optimizer.pt: a scaler.pt would stop a bf16/fp32 or stock resume
    assert "scaler.pt" not in names
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert bool(state["zero_offload"]["loss_scaler"]) == (precision == "fp16")
    assert all("master" in s and s["exp_avg"].device.type == "cpu"
               for s in state["state"].values())

    trainer, resumed = run(tmp_path / "resumed", gpt2(), offload=True, resume=str(ckpt), **kw)
    resumed = [e for e in resumed if e["step"] > 3]  # the checkpoint's history comes first
    assert column(resumed, "loss") == column(full, "loss")[3:]  # bit for bit
    assert column(resumed, "grad_norm") == column(full, "grad_norm")[3:]
    engine = trainer.engine
    assert all(engine.host_views(p)["master"].device.type == "cpu"
               for p in trainer.model.parameters())


# ------------------------------------------------------------------------ logging, scaler
class OnLog(TrainerCallback):
    """What each ``on_log`` received (the channel of the printed line and of report_to)."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


STEP_EXTRAS = ("skipped_steps", "fwd_bwd_ms", "grad_wait_ms", "cpu_adam_ms", "upload_host_ms")
MEMORY = ("offload_device_mib", "offload_host_mib", "plain_adamw_device_mib")
WALL_CLOCK = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def test_logs_scale_skips_time_split_and_memory(tmp_path, caplog):
    caplog.set_level("INFO", logger="hf_zoffload")
    # 2**40 overflows fp16 grads: the first step is skipped and the scale backs off to 2**10,
    # which the later steps survive.
    on_log = OnLog()
    trainer, logs = run(tmp_path, gpt2(), offload=True, fp16=True, max_steps=4,
                        zero_offload_init_scale=2.0**40, zero_offload_hysteresis=1,
                        zero_offload_backoff_factor=2.0**-30, callbacks=[on_log])
    assert trainer.accelerator.scaler is trainer.engine.loss_scaler
    steps = [e for e in on_log.seen if "loss" in e]
    assert len(steps) == len(logs) == 4
    first = steps[0]
    for key in ("loss_scale", "skipped_steps", "grad_wait_ms", "cpu_adam_ms", "upload_host_ms",
                *MEMORY):
        assert key in first, key
    assert first["skipped_steps"] == 1 and first["loss_scale"] == 2.0**10
    assert not math.isfinite(first["grad_norm"])
    assert [e["skipped_steps"] for e in steps] == [1, 1, 1, 1]
    # the first step has no step before it to time fwd_bwd from: left out, not logged as 0
    assert "fwd_bwd_ms" not in first and all(e["fwd_bwd_ms"] > 0 for e in steps[1:])
    assert first["plain_adamw_device_mib"] > first["offload_device_mib"]
    assert not any(k in e for e in steps[1:] for k in MEMORY)  # once
    assert "plain AMP AdamW would need" in caplog.text  # the table, at INFO
    # log_history: none of it (test_log_history_is_the_stock_trainers: exactly the stock keys)
    assert not any(k in e for e in trainer.state.log_history
                   for k in ("loss_scale", *STEP_EXTRAS, *MEMORY))
    assert len(trainer.state.log_history) == len(on_log.seen) == 5  # 4 steps, the summary
    # the scheduler held on the skipped step: step 2 uses the warm-up's first lr again
    assert logs[1]["learning_rate"] == logs[0]["learning_rate"] < logs[2]["learning_rate"]


@pytest.fixture
def no_logging_setup():
    """The package's logger untouched; what `core.show_info_logs` adds is removed afterwards.
    (The test sets pytest's root handlers aside itself: pytest adds them as the test body
    starts, after the fixtures.)"""
    pkg = logging.getLogger("hf_zoffload")
    level, handlers = pkg.level, list(pkg.handlers)
    pkg.setLevel(logging.NOTSET)
    yield pkg
    pkg.handlers[:] = handlers
    pkg.setLevel(level)


def test_memory_report_shows_at_the_default_log_level(tmp_path, capsys, monkeypatch,
                                                      no_logging_setup):
    """No logging set up: the host check's line and the report print once, on stderr; the
    report counts the accumulation sum (gradient_accumulation_steps=2) that the second
    micro-step allocates, at the bytes the engine then holds."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as a plain script
    on_log = OnLog()
    trainer, _ = run(tmp_path, gpt2(), offload=True, max_steps=2, callbacks=[on_log])
    err = capsys.readouterr().err
    assert err.count("ZeRO-Offload host memory check passed: ") == 1, err
    assert err.count("ZeRO-Offload memory (model states)") == 1, err
    assert "gradient accumulation keeps an fp32 sum of each bucket shard: " in err
    held = trainer.engine.memory_report()["host_total"]
    assert trainer.engine.memory_report()["host"]["grad_accumulation"] > 0
    assert on_log.seen[0]["offload_host_mib"] == round(held / 2**20, 3)
    # logging set up by the user (a root handler, as logging.basicConfig adds): left as it is
    no_logging_setup.handlers.clear()
    no_logging_setup.setLevel(logging.NOTSET)
    logging.getLogger().handlers.append(logging.NullHandler())
    assert not core.show_info_logs(main_process=True) and not no_logging_setup.handlers
    logging.getLogger().handlers.clear()
    assert not core.show_info_logs(main_process=False) and not no_logging_setup.handlers


def _same_history(got, ref):
    """The same entries with the same keys in the same order; values equal, but losses and
    norms within fp32 rounding (test_fp32_matches_stock_adamw) and wall-clock figures free."""
    assert [list(e) for e in got] == [list(e) for e in ref]
    for g, r in zip(got, ref):
        for key in g:
            if key in ("loss", "grad_norm", "train_loss"):
                assert g[key] == pytest.approx(r[key], rel=1e-5), (key, g, r)
            elif key not in WALL_CLOCK:
                assert g[key] == r[key], (key, g, r)


def test_log_history_is_the_stock_trainers(tmp_path):
    """Code that reads log_history (the best checkpoint, a resumed run's history against the
    uninterrupted one, [h["loss"] for h in log_history[:-1]]) gets the stock Trainer's."""
    kw = dict(save_strategy="steps", save_steps=3)
    stock, _ = run(tmp_path / "stock", gpt2(), **kw)
    offload, _ = run(tmp_path / "offload", gpt2(), offload=True, **kw)
    assert len(offload.state.log_history) == COMMON["max_steps"] + 1  # + the summary
    _same_history(offload.state.log_history, stock.state.log_history)
    assert [h["loss"] for h in offload.state.log_history[:-1]] == pytest.approx(
        [h["loss"] for h in stock.state.log_history[:-1]], rel=1e-5)

    # Each resumed from its own checkpoint at step 3: no entry added by the resume.
    stock_r, _ = run(tmp_path / "stock_r", gpt2(), resume=str(tmp_path / "stock" / "checkpoint-3"),
                     **kw)
    offload_r, _ = run(tmp_path / "offload_r", gpt2(), offload=True,
                       resume=str(tmp_path / "offload" / "checkpoint-3"), **kw)
    _same_history(offload_r.state.log_history, stock_r.state.log_history)
    # and the resumed history is the uninterrupted one's, bit for bit but for the summary
    # (the entries read back from trainer_state.json have their keys sorted, stock too)
    got, want = offload_r.state.log_history, offload.state.log_history
    assert [set(e) for e in got] == [set(e) for e in want]
    assert got[:-1] == want[:-1]


def test_log_history_extras_keep_what_on_log_got(tmp_path):
    on_log = OnLog()
    trainer, logs = run(tmp_path, gpt2(), offload=True, max_steps=3, callbacks=[on_log],
                        zero_offload_log_history_extras=True)
    history = trainer.state.log_history
    assert history == [{**e, "step": h["step"]} for e, h in zip(on_log.seen, history)]
    assert len(history) == len(on_log.seen) == 4
    assert all(k in logs[0] for k in MEMORY) and all("fwd_bwd_ms" in e for e in logs[1:])


# ------------------------------------------------------------------------ arguments
def test_arguments_reach_the_plugin(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ZOFFLOAD_GROWTH_INTERVAL", "7")
    monkeypatch.setenv("HF_ZOFFLOAD_BUCKET_SIZE_MB", "4")
    parser = HfArgumentParser(ZeroOffloadTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path), "--zero_offload", "--bf16", "--use_cpu",
        "--zero_offload_bucket_size_mb", "0.5", "--zero_offload_pin_memory", "false",
        "--zero_offload_state_dtype", "int8", "--max_grad_norm", "0.25"])
    plugin = args.zero_offload_plugin()
    assert (plugin.compute_dtype, plugin.bucket_size_mb, plugin.pin_memory) == ("bf16", 0.5, False)
    assert plugin.state_dtype == "int8"
    assert (plugin.growth_interval, plugin.max_grad_norm) == (7, 0.25)  # env; Trainer's norm
    assert pickle.loads(pickle.dumps(args)).zero_offload_bucket_size_mb == 0.5
    help_text = parser.format_help()
    for name in ZeroOffloadPlugin.names():
        assert f"--zero_offload_{name}" in help_text
    plain = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True)
    assert plain.zero_offload_plugin().compute_dtype == "fp32"


def test_zero_offload_switch_follows_launch_settings(tmp_path, monkeypatch):
    """Unset, --zero_offload follows HF_ZOFFLOAD_ENABLED, then the sidecar's zero_offload
    (what `hf-zoffload launch` passes); an explicit value wins; nothing set means off."""
    parser = HfArgumentParser(ZeroOffloadTrainingArguments)

    def parse(*extra):
        return parser.parse_args_into_dataclasses(
            args=["--output_dir", str(tmp_path), "--use_cpu", *extra])[0].zero_offload

    monkeypatch.delenv("HF_ZOFFLOAD_ENABLED", raising=False)
    monkeypatch.delenv("HF_ZOFFLOAD_CONFIG", raising=False)
    assert parse() is False and parse("--zero_offload") is True
    side = tmp_path / "cfg_zoffload.yaml"
    side.write_text("zero_offload: true\nzoffload: {compute_dtype: fp32}\n")
    monkeypatch.setenv("HF_ZOFFLOAD_CONFIG", str(side))
    assert parse() is True and parse("--zero_offload", "false") is False
    monkeypatch.setenv("HF_ZOFFLOAD_ENABLED", "false")
    assert parse() is False
    monkeypatch.setenv("HF_ZOFFLOAD_ENABLED", "maybe")
    with pytest.raises(ValueError, match="HF_ZOFFLOAD_ENABLED='maybe'"):
        parse()


@pytest.mark.parametrize("kw, match", [
    (dict(deepspeed="ds_config.json"), "--deepspeed"),
    (dict(fsdp="full_shard"), "--fsdp 'full_shard': FSDP2 without CPU offload"),
    (dict(optim="sgd"), "adamw_torch, adamw_torch_fused"),
    (dict(fp16=True, bf16=True), "--fp16 and --bf16"),
    (dict(bf16=True, zero_offload_compute_dtype="fp16"), "--bf16 conflicts with"),
    (dict(max_grad_norm=1.0, zero_offload_max_grad_norm=2.0), "--max_grad_norm"),
    (dict(zero_offload_bucket_size_mb=0), "bucket_size_mb"),
], ids=["deepspeed", "fsdp", "optim", "fp16+bf16", "dtype", "clip", "bad-value"])
def test_argument_errors(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True, use_cpu=True,
                                     **kw)


def test_unknown_zero_offload_option_names_the_closest(tmp_path):
    from hf_zoffload.integrations.trainer import check_argv

    check_argv(["--zero_offload", "--zero_offload_state_dtype=bf16", "--fp16"])  # all known
    for bad in ("--zero_offload_bucket_size", "--zero-offload-bucket-size=4"):
        with pytest.raises(ValueError, match=r"unknown option --zero_offload_bucket_size; the "
                                             r".*did you mean '--zero_offload_bucket_size_mb'"):
            check_argv(["--output_dir", "x", bad])
    with pytest.raises(ValueError, match="unknown option --zero_offload_state_dtypes"):
        check_argv(["--zero_offload_state_dtypes", "bf16"])


def test_log_history_extras_is_a_trainer_option(tmp_path, monkeypatch):
    from hf_zoffload.integrations.trainer import check_argv

    parser = HfArgumentParser(ZeroOffloadTrainingArguments)
    base = ["--output_dir", str(tmp_path), "--zero_offload", "--use_cpu"]
    check_argv([*base, "--zero_offload_log_history_extras"])  # known to the typo check
    for extra, want in (([], False), (["--zero_offload_log_history_extras"], True),
                        (["--zero_offload_log_history_extras", "false"], False)):
        (args,) = parser.parse_args_into_dataclasses(args=[*base, *extra])
        assert args.zero_offload_log_history_extras is want, extra
    assert "--zero_offload_log_history_extras" in parser.format_help()
    with pytest.raises(ValueError, match=r"^--zero_offload_log_history_extras: 'false' is not "
                                         r"allowed; allowed: True, False$"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True, use_cpu=True,
                                     zero_offload_log_history_extras="false")
    # not an engine setting: no variable of its own (HF_ZOFFLOAD_* names only settings)
    monkeypatch.setenv("HF_ZOFFLOAD_LOG_HISTORY_EXTRAS", "true")
    with pytest.raises(ValueError, match="unknown environment variable "
                                         "HF_ZOFFLOAD_LOG_HISTORY_EXTRAS"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True, use_cpu=True)
    monkeypatch.delenv("HF_ZOFFLOAD_LOG_HISTORY_EXTRAS")
    # with offload off it would do nothing: refused, as a --zero_offload_<setting> is
    monkeypatch.delenv("HF_ZOFFLOAD_ENABLED", raising=False)
    monkeypatch.delenv("HF_ZOFFLOAD_CONFIG", raising=False)
    with pytest.raises(ValueError, match="--zero_offload_log_history_extras set, but "
                                         "ZeRO-Offload is off"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                     zero_offload_log_history_extras=True)


def test_bad_state_dtype_argument(tmp_path):
    with pytest.raises(ValueError, match="'state_dtype': 'fp16' is not allowed; allowed: fp32, "
                                         "bf16, int8"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True, use_cpu=True,
                                     zero_offload_state_dtype="fp16")


def test_compute_dtype_follows_accelerate_launch(tmp_path, monkeypatch):
    """Under `accelerate launch` with mixed_precision bf16 the stock Trainer trains in bf16
    without --bf16; so does the offload one, and a different explicit dtype conflicts."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True,
                                        use_cpu=True)
    assert args.zero_offload_plugin().compute_dtype == "bf16"
    with pytest.raises(ValueError, match="accelerate's mixed_precision bf16 "
                                         r"\(ACCELERATE_MIXED_PRECISION\) conflicts with"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True, use_cpu=True,
                                     zero_offload_compute_dtype="fp16")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True,
                                        use_cpu=True)
    assert args.zero_offload_plugin().compute_dtype == "fp32"


def test_triton_kernels_refused_with_the_arguments(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the suite's interpreter mode
    with pytest.raises(ValueError, match="setting 'kernels': 'triton' needs a CUDA device"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True, use_cpu=True,
                                     zero_offload_kernels="triton")


def test_env_dtype_conflict_names_both(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ZOFFLOAD_COMPUTE_DTYPE", "fp16")
    with pytest.raises(ValueError, match="--bf16 conflicts with compute_dtype in"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True, bf16=True,
                                     use_cpu=True)


def test_trainer_errors(tmp_path, monkeypatch):
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True,
                                        use_cpu=True, report_to=[])
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="optimizers="):
        ZeroOffloadTrainer(model=model, args=args, optimizers=(opt, None))
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs="):
        ZeroOffloadTrainer(model=model, args=args,
                           optimizer_cls_and_kwargs=(torch.optim.AdamW, {}))
    monkeypatch.setattr(ZeroOffloadTrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError, match="2 GPUs in one process.*DataParallel"):
        ZeroOffloadTrainer(model=model, args=args)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_mixed_precision_runs_through_the_engine(tmp_path, precision):
    from tests.gpu._common import async_problems

    trainer, logs = run(tmp_path, gpt2(), offload=True, use_cpu=False, max_steps=6,
                        save_strategy="steps", save_steps=6, **{precision: True})
    engine = trainer.engine
    assert async_problems(engine) == []  # CPU twin: tests/gpu/test_race.py
    assert next(trainer.model.parameters()).dtype == engine.plugin.torch_dtype
    # ours, never accelerate's torch GradScaler; none at all for bf16
    assert trainer.accelerator.scaler is (engine.loss_scaler if precision == "fp16" else None)
    assert len(logs) == 6 and all(math.isfinite(e["loss"]) for e in logs)
    state = torch.load(tmp_path / "checkpoint-6" / "optimizer.pt", weights_only=True)
    assert all(s["master"].device.type == "cpu" for s in state["state"].values())


@pytest.mark.slow
def test_delayed_update_lands_before_saving_and_at_the_end(tmp_path):
    """With delayed_update the last step's params arrive one step late: the Trainer lands
    them at the end of training and before anything reads the weights."""
    trainer, _ = run(tmp_path, gpt2(), offload=True, zero_offload_delayed_update=True,
                     zero_offload_delayed_update_warmup_steps=0)
    engine = trainer.engine
    assert not engine.update_in_flight and engine.applied_steps == COMMON["max_steps"]
    for p in trainer.model.parameters():
        assert torch.equal(p.detach().reshape(-1), engine.host_views(p)["master"])
