"""The non-finite stop (integrations/nonfinite.py): real Trainer runs of a tiny GPT-2 whose
forward turns NaN from a given step stop with one error naming that step, save no checkpoint
from it on (rotation keeps the last finite one), in fp32, bf16 and fp16; fp16's overflow skips
still back off and train; the counting rules on their own."""

import math
import os
import re
import types

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from hf_zoffload.integrations.completeness import nonfinite_problem, why_incomplete
from hf_zoffload.integrations.nonfinite import NonFiniteError, NonFiniteStop
from hf_zoffload.integrations.trainer import ZeroOffloadTrainer, ZeroOffloadTrainingArguments
from tests._tiny import VOCAB, TokenBlocks, tiny_gpt2


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _poison_from(model, step: int) -> None:
    """The embeddings' output is NaN from the ``step``-th training forward on (one forward
    per optimizer step here): a model that diverged at that step."""
    seen = [0]

    def hook(module, args, out):
        if not module.training:
            return out
        seen[0] += 1
        return out * float("nan") if seen[0] >= step else out

    model.transformer.wte.register_forward_hook(hook)


def _trainer(out, *, steps=10, **kw):
    args = ZeroOffloadTrainingArguments(
        output_dir=str(out), zero_offload=True, max_steps=steps, save_strategy="steps",
        save_steps=2, save_total_limit=2, logging_steps=1, per_device_train_batch_size=2,
        learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
        zero_offload_cpu_threads=1, **kw)
    model = tiny_gpt2()
    return model, ZeroOffloadTrainer(model=model, args=args,
                                     train_dataset=TokenBlocks(32, vocab=VOCAB, seq=16))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_run_turning_nan_stops_and_keeps_the_last_finite_checkpoint(tmp_path, precision,
                                                                      caplog):
    kw = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True}}[precision]
    model, trainer = _trainer(tmp_path, **kw)
    _poison_from(model, 5)
    # steps 5, 6, 7 non-finite: the third stops the run (max_nonfinite_steps 3, the default);
    # in fp16 the inf gradients are overflow skips the scaler still backs off from, so the
    # loss alone counts
    what = "a non-finite loss" + ("" if precision == "fp16" else ", grad_norm nan")
    with pytest.raises(NonFiniteError, match=rf"^ZeRO-Offload: 3 consecutive optimizer steps "
                       rf"with a non-finite loss or gradient norm, from step 5 \({what}\); "
                       r"stopped at step 7 \(max_nonfinite_steps=3\), "
                       r"with no checkpoint saved from step 5 on\."):
        trainer.train()
    if precision == "fp16":
        assert trainer.engine.skipped_steps == 3
    # checkpoint-6 was not saved, so rotation (save_total_limit 2) kept checkpoint-4
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    assert any("checkpoint of step 6 not saved: the loss or gradient norm has been "
               "non-finite since step 5" in r.getMessage() for r in caplog.records)
    for c in ("checkpoint-2", "checkpoint-4"):
        assert why_incomplete(str(tmp_path / c)) is None
        assert nonfinite_problem(str(tmp_path / c)) is None  # finite masters and moments
    # the stop is after step 7, before its log: the history ends at step 6
    assert trainer.state.global_step == 6


def test_the_limit_is_one_setting_and_zero_never_stops(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ZOFFLOAD_MAX_NONFINITE_STEPS", "1")
    model, trainer = _trainer(tmp_path / "one", steps=6)
    _poison_from(model, 4)
    with pytest.raises(NonFiniteError, match=r"1 consecutive optimizer steps .* from step 4 "
                       r".*stopped at step 4 \(max_nonfinite_steps=1\)"):
        trainer.train()
    assert sorted(os.listdir(tmp_path / "one")) == ["checkpoint-2"]
    monkeypatch.delenv("HF_ZOFFLOAD_MAX_NONFINITE_STEPS")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    # 0: the stock behaviour, trained through (and saved) as any Trainer would
    model, trainer = _trainer(tmp_path / "off", steps=6, zero_offload_max_nonfinite_steps=0)
    _poison_from(model, 4)
    trainer.train()
    assert "checkpoint-6" in os.listdir(tmp_path / "off")


def test_training_that_ends_inside_a_streak_raises(tmp_path):
    model, trainer = _trainer(tmp_path, steps=6)
    _poison_from(model, 5)  # steps 5, 6: two of three
    with pytest.raises(NonFiniteError, match=r"training ended 2 step\(s\) into a run of "
                       r"non-finite steps from step 5"):
        trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]


def test_fp16_overflow_skips_keep_working(tmp_path):
    # 2**60 overflows every fp16 gradient; backing off by 1e-3 per skipped step takes the
    # scale to a workable one in a few steps: more than the limit, never counted (the loss
    # is finite and the scale above its floor), then trained
    model, trainer = _trainer(tmp_path, steps=10, fp16=True,
                              zero_offload_init_scale=2.0**60, zero_offload_backoff_factor=1e-3,
                              zero_offload_hysteresis=1)
    trainer.train()
    assert trainer.engine.skipped_steps > 3
    assert trainer.engine.applied_steps == 10 - trainer.engine.skipped_steps > 0
    assert "checkpoint-10" in os.listdir(tmp_path)


# ------------------------------------------------------------------ the counting rules
def _engine(norm, *, skipped=False, scale=1.0, floor=1.0):
    return types.SimpleNamespace(grad_norm=norm, last_step_skipped=skipped,
                                 loss_scaler=types.SimpleNamespace(loss_scale=scale,
                                                                   min_scale=floor))


def test_counting_rules():
    stop = NonFiniteStop(2)
    stop.after_step(_engine(math.nan))
    assert stop.in_streak and stop.first_bad == 1
    stop.after_step(_engine(1.0))  # a finite step ends the streak
    assert not stop.in_streak and stop.first_bad is None
    # an fp16 skip above the floor is the scaler's; at the floor it counts
    for _ in range(5):
        stop.after_step(_engine(math.inf, skipped=True, scale=8.0))
    assert not stop.in_streak
    stop.after_step(_engine(math.inf, skipped=True, scale=1.0))
    with pytest.raises(NonFiniteError, match=r"from step 8 \(grad_norm inf\); stopped at "
                                             r"step 9"):
        stop.after_step(_engine(math.inf, skipped=True, scale=1.0))
    # a non-finite loss counts even on a finite norm, over every micro-step of the window
    stop = NonFiniteStop(1, step_number=lambda: 41)
    stop.observe_loss(torch.tensor(2.0))
    stop.observe_loss(torch.tensor(float("inf")))
    stop.observe_loss(torch.tensor(3.0))
    with pytest.raises(NonFiniteError, match=re.escape("from step 41 (a non-finite loss)")):
        stop.after_step(_engine(0.5))
    off = NonFiniteStop(0)
    for _ in range(10):
        off.observe_loss(torch.tensor(float("nan")))
        off.after_step(_engine(math.nan))
    assert not off.in_streak


def test_an_accelerate_loop_stops_on_the_gradient_norm():
    """prepare_zero_offload: the loop's own loss is not seen; the engine's gradient norm is,
    and the third non-finite step raises from optimizer.step()."""
    from accelerate import Accelerator

    from hf_zoffload import prepare_zero_offload

    model = tiny_gpt2()
    _poison_from(model, 3)
    model.train()
    model, opt = prepare_zero_offload(Accelerator(cpu=True), model,
                                      torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = TokenBlocks(4, vocab=VOCAB, seq=16).ids
    for step in range(1, 6):
        model(input_ids=ids, labels=ids).loss.backward()
        if step < 5:
            opt.step()
            opt.zero_grad()
            assert opt.nonfinite.in_streak is (step >= 3)
        else:
            with pytest.raises(NonFiniteError, match=r"from step 3 \(grad_norm nan\); "
                                                     r"stopped at step 5"):
                opt.step()
