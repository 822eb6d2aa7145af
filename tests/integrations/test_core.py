"""The integration core shared by ZeroOffloadTrainer and prepare_zero_offload (CPU).

Partly frozen (LoRA-style) models train through both paths in bf16 and fp16: the frozen float
params join the compute dtype and keep their values, the trained ones move. Both paths wire
the engine in with the same wrapper class and the same clip route."""

import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from transformers import GPT2Config, GPT2LMHeadModel

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin, prepare_zero_offload
from hf_zoffload.integrations import core
from hf_zoffload.integrations.trainer import ZeroOffloadTrainer, ZeroOffloadTrainingArguments
from tests._tiny import TokenBlocks

VOCAB, SEQ, STEPS = 64, 16, 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 2.0**10  # a loss scale this model's fp16 grads survive (no skipped step)


def Tokens(n=16, seed=0):  # noqa: N802 (was a class; same calls)
    return TokenBlocks(n, vocab=VOCAB, seq=SEQ, seed=seed)


def frozen_mlp_gpt2():
    """Tiny GPT-2 with every MLP param frozen: fp32 until someone casts them."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                       n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    for name, p in model.named_parameters():
        if ".mlp." in name:
            p.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and trained
    return model, frozen, trained


def check_frozen_and_trained(model, frozen, trained, dtype):
    """Frozen: the compute dtype, values equal to the original cast. Trained: moved."""
    params = dict(model.named_parameters())
    for name, before in frozen.items():
        p = params[name]
        assert not p.requires_grad
        assert p.dtype == dtype, name
        assert torch.equal(p.detach(), before.to(dtype)), name
    for name, before in trained.items():
        p = params[name]
        assert p.dtype == dtype, name
        assert not torch.equal(p.detach(), before.to(dtype)), f"{name} did not train"


# ------------------------------------------------------------------------ Trainer path
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_partly_frozen_model_trains_through_the_trainer(tmp_path, precision):
    model, frozen, trained = frozen_mlp_gpt2()
    kw = {precision: True}
    if precision == "fp16":
        kw["zero_offload_init_scale"] = FP16_SCALE
    args = ZeroOffloadTrainingArguments(
        output_dir=str(tmp_path), zero_offload=True, use_cpu=True, per_device_train_batch_size=2,
        max_steps=STEPS, learning_rate=1e-2, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, disable_tqdm=True, **kw)
    trainer = ZeroOffloadTrainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    engine = trainer.engine
    assert engine.plugin.compute_dtype == precision and engine.skipped_steps == 0
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == STEPS
    assert all(math.isfinite(e["loss"]) and math.isfinite(e["grad_norm"]) for e in logs)
    check_frozen_and_trained(trainer.model, frozen, trained, DTYPES[precision])
    assert {id(p) for p in core.engine_params(engine)} == \
        {id(p) for p in trainer.model.parameters() if p.requires_grad}


# ------------------------------------------------------------------------ Accelerate path
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_partly_frozen_model_trains_through_prepare_zero_offload(precision):
    dtype = DTYPES[precision]
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    model, frozen, trained = frozen_mlp_gpt2()
    teacher, _, _ = frozen_mlp_gpt2()
    teacher.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    settings = {"init_scale": FP16_SCALE} if precision == "fp16" else {}
    model, opt, teacher = prepare_zero_offload(accelerator, model, opt, teacher, **settings)
    engine = opt.optimizer
    assert engine.plugin.compute_dtype == precision  # followed accelerate's mixed_precision
    assert all(p.dtype == dtype for p in model.parameters())  # frozen ones cast on prepare
    assert all(p.dtype == torch.float32 for p in teacher.parameters())  # not ours: untouched
    assert (accelerator.scaler is engine.loss_scaler) == (precision == "fp16")
    data = Tokens()
    losses = []
    for i in range(STEPS):
        ids = data.ids[2 * i:2 * i + 2]
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and engine.skipped_steps == 0
    check_frozen_and_trained(model, frozen, trained, dtype)


# ------------------------------------------------------------------------ one core
def test_both_paths_use_the_same_core(tmp_path):
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), zero_offload=True,
                                        use_cpu=True, bf16=True, report_to=[])
    trainer = ZeroOffloadTrainer(model=frozen_mlp_gpt2()[0], args=args,
                                 train_dataset=Tokens())
    trainer.create_optimizer()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = frozen_mlp_gpt2()[0]
    model, opt = prepare_zero_offload(
        accelerator, model,
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))

    for acc, wrapped in ((trainer.accelerator, trainer.optimizer), (accelerator, opt)):
        assert type(wrapped) is core.OffloadedOptimizer
        assert core.attached_engine(acc) is wrapped.optimizer
        assert acc.clip_grad_norm_.__func__ is core.ClipRoute.clip_grad_norm_
        assert acc.clip_grad_value_.__func__ is core.ClipRoute.clip_grad_value_
        assert type(acc).clip_grad_norm_ is Accelerator.clip_grad_norm_  # no class touched
        with pytest.raises(ValueError, match="one per Accelerator"):
            core.install(acc, wrapped.optimizer)
    assert trainer.engine is trainer.optimizer.optimizer

    # the Trainer's route now has the Accelerate path's checks too
    layer = trainer.model.transformer.h[0].attn
    with pytest.raises(ValueError, match="part of the ZeRO-Offload optimizer's parameters"):
        trainer.accelerator.clip_grad_norm_(layer.parameters(), 1.0)
    with pytest.raises(NotImplementedError, match="use clip_grad_norm_"):
        trainer.accelerator.clip_grad_value_(trainer.model.parameters(), 1.0)
    other = torch.nn.Parameter(torch.ones(4))
    other.grad = torch.ones(4)
    assert float(trainer.accelerator.clip_grad_norm_([other], 1.0)) == pytest.approx(2.0)


def test_prepare_models_leaves_models_without_engine_params_alone():
    model, _, _ = frozen_mlp_gpt2()
    teacher, _, _ = frozen_mlp_gpt2()
    engine = ZeroOffloadOptimizer([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                  plugin=ZeroOffloadPlugin(compute_dtype="bf16"))
    assert core.prepare_models(engine, [teacher, model]) == [model]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in teacher.parameters()} == {torch.float32}


def test_trainer_with_model_init_trains_twice_on_one_accelerator(tmp_path):
    """model_init: each train() re-creates the model and the optimizer on the same
    accelerator; the new engine replaces the old one there (its clip route, its scaler)."""
    args = ZeroOffloadTrainingArguments(
        output_dir=str(tmp_path), zero_offload=True, use_cpu=True, fp16=True,
        zero_offload_init_scale=FP16_SCALE, per_device_train_batch_size=2, max_steps=1,
        max_grad_norm=1.0, save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = ZeroOffloadTrainer(model_init=lambda: frozen_mlp_gpt2()[0], args=args,
                                 train_dataset=Tokens())
    trainer.train()
    first = trainer.engine
    trainer.train()
    second = trainer.engine
    assert second is not first and core.attached_engine(trainer.accelerator) is second
    assert trainer.accelerator.scaler is second.loss_scaler
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float16}
    other = torch.nn.Parameter(torch.ones(4))
    other.grad = torch.ones(4)  # not the engine's: still the accelerator's own clip
    assert float(trainer.accelerator.clip_grad_norm_([other], 1.0)) == pytest.approx(2.0)
