"""Issue 14, item 2: with --zero_offload every Trainer option either takes effect (shown
here against the stock Trainer or by what reached the engine) or stops the run with one
error naming it, before the model is touched."""

import dataclasses

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.training_args import OptimizerNames

from hf_zoffload.integrations.arguments import ALLOWED_OPTIMS, UNUSED
from hf_zoffload.integrations.trainer import ZeroOffloadTrainer, ZeroOffloadTrainingArguments
from tests.integrations.test_trainer import COMMON, Tokens, column, gpt2

FAST = dict(COMMON, gradient_accumulation_steps=1, max_steps=4)


class EngineLR(TrainerCallback):
    """The lr of every param group of the optimizer as each step is about to apply it."""

    def __init__(self):
        self.trainer, self.seen = None, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        opt = self.trainer.optimizer
        opt = getattr(opt, "optimizer", opt)  # the engine, or the stock AdamW
        self.seen.append([g["lr"] for g in opt.param_groups])


def train(tmp_path, model, *, offload, eval_data=None, **kw):
    """Train ``model``; return (trainer, per-step log entries, EngineLR)."""
    opts = dict(FAST, output_dir=str(tmp_path), **kw)
    if offload:
        args, cls = ZeroOffloadTrainingArguments(zero_offload=True, **opts), ZeroOffloadTrainer
    else:
        args, cls = TrainingArguments(**opts), Trainer
    lrs = EngineLR()
    trainer = cls(model=model, args=args, train_dataset=Tokens(), eval_dataset=eval_data,
                  callbacks=[lrs])
    lrs.trainer = trainer
    trainer.train()
    return trainer, [e for e in trainer.state.log_history if "loss" in e], lrs


# ------------------------------------------------------------------ a stock Trainer
def test_a_stock_trainer_refuses_offload_arguments(tmp_path):
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True,
                                        use_cpu=True, report_to=[])
    assert isinstance(args.get_process_log_level(), int)  # still a method for scripts

    class MyTrainer(Trainer):
        pass

    for cls in (Trainer, MyTrainer):
        model = gpt2()
        with pytest.raises(ValueError, match=rf"^{cls.__name__} was given "
                                             r"ZeroOffloadTrainingArguments with zero_offload="
                                             r"True.*would train without offload\. Use "
                                             rf"hf_zoffload\.zero_offload_trainer\({cls.__name__}"
                                             r"\) \(hf_zoffload\.ZeroOffloadTrainer for "):
            cls(model=model, args=args, train_dataset=Tokens())
        assert next(model.parameters()).dtype == torch.float32  # nothing was touched

    class MyOffloadTrainer(ZeroOffloadTrainer):
        pass

    assert MyOffloadTrainer(model=gpt2(), args=args, train_dataset=Tokens()).zero_offload
    off = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=False,
                                       use_cpu=True, report_to=[])
    Trainer(model=gpt2(), args=off, train_dataset=Tokens())  # offload off: the stock one


# ------------------------------------------------------------------ refused options
# Refused when the Trainer is built (it needs the process count): --auto_find_batch_size with
# several processes (test_trainer_features.py, which also covers the other Trainer features).
REFUSED = [
    (dict(optim_args="betas=(0.8,0.9)"), r"^--optim_args 'betas=\(0.8,0.9\)' has no effect "
                                         r"with --zero_offload: .*--adam_beta1"),
    (dict(optim_target_modules=["attn"]), r"^--optim_target_modules \['attn'\] has no effect"),
    (dict(ddp_find_unused_parameters=True), r"^--ddp_find_unused_parameters True has no effect"
                                            r".*not wrapped in DDP"),
    (dict(ddp_bucket_cap_mb=25), r"^--ddp_bucket_cap_mb 25 has no effect.*"
                                 r"--zero_offload_bucket_size_mb"),
    (dict(ddp_broadcast_buffers=False), r"^--ddp_broadcast_buffers False has no effect"),
    (dict(ddp_static_graph=True), r"^--ddp_static_graph True has no effect"),
    (dict(max_grad_norm=-1.0), r"^--max_grad_norm -1.0 is not allowed with --zero_offload; "
                               r"allowed: a number >= 0 \(0 turns clipping off\)"),
    (dict(max_grad_norm=None), r"^--max_grad_norm None is not allowed"),
    (dict(adam_beta1=1.0), r"^--adam_beta1 of --zero_offload's AdamW must be < 1.0, got 1.0"),
    (dict(adam_beta2=-0.1), r"^--adam_beta2 of --zero_offload's AdamW must be >= 0.0"),
    (dict(adam_epsilon=-1e-8), r"^eps of --zero_offload's AdamW must be >= 0.0, got -1e-08 "
                               r"\(.*eps: --adam_epsilon"),
    (dict(weight_decay=-0.1), r"^weight_decay of .* must be >= 0.0.*weight_decay: "
                              r"--weight_decay"),
    (dict(learning_rate=float("nan")), r"^lr of --zero_offload's AdamW must be finite, got nan "
                                       r"\(lr: --learning_rate"),
    (dict(adam_beta1=0.99, adam_beta2=0.98, zero_offload_state_dtype="int8"),
     r"^--adam_beta1 0.99 / --adam_beta2 0.98 with --zero_offload_state_dtype int8: "
     r"state_dtype='int8' needs beta1\*\*2 < beta2"),
]


@pytest.mark.parametrize("kw, match", REFUSED, ids=[next(iter(k)) + ("=" + str(
    next(iter(k.values())))) for k, _ in REFUSED])
def test_options_without_effect_raise_when_the_arguments_are_built(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True, use_cpu=True,
                                     **kw)
    opts = {**kw, "zero_offload_state_dtype": None}
    TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **{  # the stock one takes them
        k: v for k, v in opts.items() if not k.startswith("zero_offload")})


def test_every_list_of_unused_options_is_a_training_argument():
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(UNUSED) <= names  # a renamed option would otherwise never be checked


def test_every_other_optimizer_is_refused(tmp_path):
    refused = [o.value for o in OptimizerNames if o.value not in ALLOWED_OPTIMS]
    assert len(refused) > 30
    for optim in refused:
        with pytest.raises(ValueError, match=rf"--optim '{optim}' cannot be used with it; "
                                             "allowed: adamw_torch, adamw_torch_fused"):
            ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True,
                                         use_cpu=True, optim=optim)
    for optim in ALLOWED_OPTIMS:
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True, use_cpu=True,
                                     optim=optim)


def test_offload_settings_without_offload(tmp_path, caplog):
    """--zero_offload_<name> with offload off by default: a forgotten --zero_offload, refused;
    turned off on purpose: said in the log. A bad value fails either way."""
    base = dict(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(ValueError, match=r"^--zero_offload_state_dtype set, but ZeRO-Offload "
                                         r"is off: add --zero_offload"):
        ZeroOffloadTrainingArguments(**base, zero_offload_state_dtype="bf16")
    with pytest.raises(ValueError, match=r"^--zero_offload_bucket_size_mb: ZeRO-Offload "
                                         r"setting 'bucket_size_mb': -1 is not allowed"):
        ZeroOffloadTrainingArguments(**base, zero_offload=False, zero_offload_bucket_size_mb=-1)
    caplog.set_level("WARNING", logger="hf_zoffload")
    ZeroOffloadTrainingArguments(**base, zero_offload=False, zero_offload_state_dtype="bf16")
    assert "ZeRO-Offload is off" in caplog.text and "--zero_offload_state_dtype" in caplog.text


# ------------------------------------------------------------------ options that work
def test_adam_hyperparameters_and_weight_decay_reach_the_engine(tmp_path):
    # Far from the defaults, so that a default in their place changes the losses.
    kw = dict(learning_rate=3e-2, adam_beta1=0.5, adam_beta2=0.6, adam_epsilon=1e-3,
              weight_decay=0.3, lr_scheduler_type="constant", optim="adamw_torch_fused")
    trainer, got, _ = train(tmp_path / "offload", gpt2(), offload=True, **kw)
    decay, no_decay = trainer.engine.param_groups
    for group, wd in ((decay, 0.3), (no_decay, 0.0)):
        assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
            (3e-2, (0.5, 0.6), 1e-3, wd)
    _, ref, _ = train(tmp_path / "stock", gpt2(), offload=False, **{**kw, "optim": "adamw_torch"})
    _, default, _ = train(tmp_path / "default", gpt2(), offload=True, learning_rate=3e-2,
                          lr_scheduler_type="constant")
    # fp32: the CPU-Adam and torch's AdamW differ by float op order only (test_trainer.py)
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(got, "loss")[1:] != pytest.approx(column(default, "loss")[1:], rel=1e-3)


SCHEDULERS = {
    "linear": {}, "cosine": {}, "cosine_with_restarts": {"num_cycles": 2}, "polynomial":
    {"power": 2.0, "lr_end": 1e-4}, "constant": {}, "constant_with_warmup": {},
    "inverse_sqrt": {}, "reduce_lr_on_plateau": {"patience": 0, "factor": 0.5},
    "cosine_with_min_lr": {"min_lr": 1e-3}, "cosine_warmup_with_min_lr": {"min_lr": 1e-3},
    "warmup_stable_decay": {"num_decay_steps": 2}, "greedy": {"patience": 1, "factor": 0.5},
}


def test_every_scheduler_type_is_covered():
    from transformers import SchedulerType

    assert set(SCHEDULERS) == {s.value for s in SchedulerType}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_schedulers_drive_the_engine(tmp_path, name):
    """Each scheduler sets the lr the engine applies, step by step, as it sets the stock
    AdamW's; the losses (fp32) agree, so the engine used it."""
    kw = dict(lr_scheduler_type=name, lr_scheduler_kwargs=SCHEDULERS[name], warmup_steps=1)
    if name in ("reduce_lr_on_plateau", "greedy"):  # they step on the evaluation loss
        kw.update(eval_strategy="steps", eval_steps=1, eval_data=Tokens(4, seed=3))
    trainer, got, lrs = train(tmp_path / "offload", gpt2(), offload=True, **kw)
    _, ref, ref_lrs = train(tmp_path / "stock", gpt2(), offload=False, **kw)
    assert trainer.engine is not None
    assert len(lrs.seen) == FAST["max_steps"]
    assert lrs.seen == ref_lrs.seen  # every group, every step
    if name != "constant":
        assert len({lr for step in lrs.seen for lr in step}) > 1  # it did schedule
    assert column(got, "learning_rate") == column(ref, "learning_rate")
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)


# gradient_checkpointing_kwargs (both modes): tests/integrations/test_trainer_features.py


def test_num_input_tokens_seen(tmp_path):
    trainer, logs, _ = train(tmp_path, gpt2(), offload=True, max_steps=2,
                             include_num_input_tokens_seen="all")
    per_step = FAST["per_device_train_batch_size"] * 16  # Tokens(): blocks of 16, no padding
    assert column(logs, "num_input_tokens_seen") == [per_step, 2 * per_step]
    assert trainer.state.num_input_tokens_seen == 2 * per_step


def test_max_grad_norm_zero_turns_clipping_off(tmp_path):
    trainer, got, _ = train(tmp_path / "offload", gpt2(), offload=True, max_grad_norm=0.0)
    _, ref, _ = train(tmp_path / "stock", gpt2(), offload=False, max_grad_norm=0.0)
    _, clipped, _ = train(tmp_path / "clipped", gpt2(), offload=True, max_grad_norm=0.5)
    assert trainer.engine.plugin.max_grad_norm == 0.0
    assert max(column(clipped, "grad_norm")) > 0.5  # so clipping would have changed the run
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(got, "loss")[1:] != pytest.approx(column(clipped, "loss")[1:], rel=1e-4)


def test_gradient_accumulation_keeps_every_micro_step(tmp_path):
    """3 micro-batches per step over 5 per epoch: each epoch ends with a step of 2. Every
    step, full or short, matches the stock Trainer's (a dropped or doubled micro-batch moves
    the loss and the norm by far more than 1e-5)."""
    kw = dict(gradient_accumulation_steps=3, max_steps=-1, num_train_epochs=2,
              lr_scheduler_type="constant")
    data = Tokens(10)
    opts = dict(FAST, output_dir=str(tmp_path / "offload"), **kw)
    trainer = ZeroOffloadTrainer(model=gpt2(), train_dataset=data,
                                 args=ZeroOffloadTrainingArguments(zero_offload=True, **opts))
    trainer.train()
    stock = Trainer(model=gpt2(), train_dataset=data, args=TrainingArguments(
        **{**opts, "output_dir": str(tmp_path / "stock")}))
    stock.train()
    got, ref = ([e for e in t.state.log_history if "loss" in e] for t in (trainer, stock))
    assert trainer.engine.applied_steps == len(got) == len(ref) == 4
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-5)


@pytest.mark.slow
def test_torch_compile(tmp_path):
    """--torch_compile compiles the model (accelerate, also for the unwrapped model the
    offload path prepares); the engine's grad hooks still see every gradient. The backend is
    aot_eager: dynamo's graphs and AOTAutograd's compiled backward, which produces the
    gradients the hooks see, as inductor's does, without inductor's C++ code generation
    (55 s of this test's 60 on 2 cores)."""
    trainer, got, _ = train(tmp_path / "offload", gpt2(), offload=True, max_steps=3,
                            torch_compile=True, torch_compile_backend="aot_eager")
    _, ref, _ = train(tmp_path / "stock", gpt2(), offload=False, max_steps=3)
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert trainer.engine.applied_steps == 3
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-5)
