"""Issue 24, item 3: every other Trainer feature a user may combine with --zero_offload works
(shown against the stock Trainer, or by what the engine holds) or is refused in one line.
One test per feature, named after it; docs/usage.md says the outcome of each."""

import gc
import os
import weakref

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState

from hf_zoffload.integrations.trainer import ZeroOffloadTrainer, ZeroOffloadTrainingArguments
from tests.integrations.test_trainer import COMMON, Tokens, column, gpt2, llama

FAST = dict(COMMON, gradient_accumulation_steps=1, max_steps=3)


def make(tmp_path, model, *, offload, callbacks=None, data=None, eval_data=None, **kw):
    opts = dict(FAST, output_dir=str(tmp_path), **kw)
    if offload:
        args, cls = ZeroOffloadTrainingArguments(zero_offload=True, **opts), ZeroOffloadTrainer
    else:
        args, cls = TrainingArguments(**opts), Trainer
    return cls(model=model, args=args, train_dataset=data or Tokens(), eval_dataset=eval_data,
               callbacks=callbacks)


def train(tmp_path, model, *, offload, resume=None, **kw):
    """Train; return (trainer, per-step log entries)."""
    trainer = make(tmp_path, model, offload=offload, **kw)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [e for e in trainer.state.log_history if "loss" in e]


def trained(engine):
    return [p for g in engine.param_groups for p in g["params"]]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The run the features are compared with: offload, FAST, no feature."""
    trainer, logs = train(tmp_path_factory.mktemp("plain"), gpt2(), offload=True)
    return trainer, logs


# ------------------------------------------------------------ callbacks that read the optimizer
class ReadsTheOptimizer(TrainerCallback):
    """What a callback sees of the optimizer around each step."""

    def __init__(self):
        self.pre, self.post = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self.pre.append([p.grad is not None for p in model.parameters()])

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        inner = optimizer.optimizer  # the engine, or the stock AdamW
        seen = {"grads": [p.grad is not None for p in model.parameters()],
                "lr": [g["lr"] for g in inner.param_groups], "optimizer": inner}
        if hasattr(inner, "host_views"):
            views = [inner.host_views(p) for p in trained(inner)]
            seen.update(grad_norm=inner.grad_norm, skipped=inner.last_step_skipped,
                        master_is_param=all(torch.equal(v["master"], p.detach().reshape(-1))
                                            for v, p in zip(views, trained(inner))),
                        moments=all(bool(v["exp_avg"].abs().sum() > 0) for v in views))
        self.post.append(seen)


def test_on_optimizer_step(tmp_path):
    """A callback gets the engine as ``optimizer.optimizer``: its lr per group (the stock
    AdamW's), ``grad_norm`` and ``last_step_skipped`` of the step, and through
    ``host_views(param)`` the fp32 master and the moments, updated by then. ``param.grad``
    is None before and after the step: the grads went to the host during backward."""
    ours, stock = ReadsTheOptimizer(), ReadsTheOptimizer()
    trainer, logs = train(tmp_path / "offload", gpt2(), offload=True, callbacks=[ours])
    _, ref = train(tmp_path / "stock", gpt2(), offload=False, callbacks=[stock])
    assert len(ours.post) == len(stock.post) == FAST["max_steps"]
    assert all(all(step) for step in stock.pre)  # the stock callback reads grads here
    assert not any(any(step) for step in ours.pre)
    for got, want, log in zip(ours.post, stock.post, logs):
        assert got["optimizer"] is trainer.engine
        assert not any(got["grads"])
        assert got["lr"] == want["lr"]
        assert got["grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-6)
        assert got["skipped"] is False and got["master_is_param"] and got["moments"]
    assert column(logs, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)


# ------------------------------------------------------------ the best model, rotation
BEST = dict(max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
            load_best_model_at_end=True, metric_for_best_model="eval_loss", save_total_limit=2)


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "bf16",
                                       pytest.param("bf16-delayed", marks=pytest.mark.slow)])
def test_load_best_model_at_end(tmp_path, precision):
    """The best checkpoint's weights go into the model and into the engine's masters, bit
    for bit in every precision: save_model after training writes the best checkpoint's
    weights, and a further step starts from them. (Without the masters following, the
    saved weights were the last step's; with the delayed update, the pending update landed
    over the loaded weights.) save_total_limit keeps the best and the newest checkpoint."""
    kw = dict(BEST)
    if precision != "fp32":
        kw["bf16"] = True
    if precision.endswith("delayed"):
        kw.update(zero_offload_delayed_update=True, zero_offload_delayed_update_warmup_steps=1)
    trainer, _ = train(tmp_path / "run", gpt2(), offload=True, eval_data=Tokens(4, seed=3),
                       **kw)
    best = trainer.state.best_model_checkpoint
    # lr 1e-2 on 32 random blocks: the held-out loss is lowest after the first step
    assert os.path.basename(best) == "checkpoint-1"
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-1", "checkpoint-4"]
    assert all((tmp_path / "run" / c / trainer.COMPLETE_NAME).exists()
               for c in ("checkpoint-1", "checkpoint-4"))
    want = load_file(os.path.join(best, "model.safetensors"))
    last = load_file(str(tmp_path / "run" / "checkpoint-4" / "model.safetensors"))
    engine = trainer.engine
    masters = engine.master_state_dict(trainer.model)
    assert masters.keys() >= want.keys()
    params = dict(trainer.model.named_parameters())
    assert params.keys() & want.keys()
    for name, w in want.items():
        assert torch.equal(masters[name], w), name
        if name in params:  # the device params: the masters rounded
            assert torch.equal(params[name].detach(), w.to(engine.dtype)), name
    assert any(not torch.equal(want[n], last[n]) for n in want)  # so the test can fail
    if precision != "fp32":  # the masters hold more than the bf16 params could
        assert any(not torch.equal(w, w.bfloat16().float()) for w in want.values())
    trainer.save_model(str(tmp_path / "final"))
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert saved.keys() == want.keys()
    assert all(torch.equal(saved[n], want[n]) for n in want)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        control.should_training_stop = state.global_step >= self.step


@pytest.mark.slow
def test_save_total_limit(tmp_path):
    """Rotation (save_total_limit=2) leaves the newest complete checkpoints, and a resume
    from the newest after rotation continues the uninterrupted run bit for bit."""
    kw = dict(save_strategy="steps", save_steps=1, save_total_limit=2, max_steps=6)
    trainer, _ = train(tmp_path / "a", gpt2(), offload=True, callbacks=[StopAt(4)], **kw)
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoint-3", "checkpoint-4"]
    assert all((tmp_path / "a" / c / trainer.COMPLETE_NAME).exists()
               for c in ("checkpoint-3", "checkpoint-4"))
    _, full = train(tmp_path / "full", gpt2(), offload=True, max_steps=6)
    _, resumed = train(tmp_path / "a", gpt2(), offload=True, resume=True, **kw)
    resumed = [e for e in resumed if e["step"] > 4]
    assert column(resumed, "loss") == column(full, "loss")[4:]
    assert column(resumed, "grad_norm") == column(full, "grad_norm")[4:]
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoint-5", "checkpoint-6"]


# ------------------------------------------------------------ evaluation, caches, tokens
def test_eval_on_start(tmp_path, plain):
    """The evaluation before the first step sees the initial weights (the stock one's loss),
    and changes nothing in training: the same losses, the first backward's bucket order
    adopted at the first step, the memory figures on the first log entry (the eval's)."""
    trainer, logs = train(tmp_path / "on", gpt2(), offload=True, eval_on_start=True,
                          eval_data=Tokens(4, seed=3), zero_offload_log_history_extras=True)
    before = make(tmp_path / "stock", gpt2(), offload=False,
                  eval_data=Tokens(4, seed=3)).evaluate()  # the initial weights
    first = trainer.state.log_history[0]
    assert first["step"] == 0 and "offload_host_mib" in first
    assert first["eval_loss"] == pytest.approx(before["eval_loss"], rel=1e-6)
    ref_trainer, ref = plain
    assert column(logs, "loss") == column(ref, "loss")
    assert column(logs, "grad_norm") == column(ref, "grad_norm")
    assert trainer.engine.bucket_order == ref_trainer.engine.bucket_order
    assert (trainer.engine.relayout_seconds is None) == \
        (ref_trainer.engine.relayout_seconds is None)


def test_torch_empty_cache_steps(tmp_path, monkeypatch, plain):
    """The Trainer empties the device cache every N steps; on the CPU that frees nothing,
    and it changes nothing in the engine's training."""
    import transformers.trainer as stock_trainer

    calls = []
    real = stock_trainer.clear_device_cache
    monkeypatch.setattr(stock_trainer, "clear_device_cache",
                        lambda *a, **k: (calls.append(1), real(*a, **k)))
    _, logs = train(tmp_path / "on", gpt2(), offload=True, torch_empty_cache_steps=1)
    assert len(calls) == FAST["max_steps"]  # it ran at every step
    _, ref = plain
    assert column(logs, "loss") == column(ref, "loss")
    assert column(logs, "grad_norm") == column(ref, "grad_norm")


def test_average_tokens_across_devices(tmp_path, plain):
    """With one process there is nothing to average over: on (the default, as in ``plain``)
    and off train alike, as the stock Trainer's do. With N processes the Trainer sums the
    token counts over the ranks before any gradient reaches the engine."""
    _, off = train(tmp_path, gpt2(), offload=True, average_tokens_across_devices=False)
    trainer, on = plain
    assert trainer.args.average_tokens_across_devices is True
    assert column(on, "loss") == column(off, "loss")
    assert column(on, "grad_norm") == column(off, "grad_norm")


@pytest.fixture(scope="module")
def llama_without_checkpointing(tmp_path_factory):
    _, logs = train(tmp_path_factory.mktemp("nogc"), llama(), offload=True, max_steps=3)
    return logs


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_kwargs(tmp_path, reentrant, llama_without_checkpointing):
    """Recomputing the forward changes nothing on the CPU: the same losses and grad norms,
    bit for bit, as without checkpointing; a block whose grads went missing (a nested
    backward ended early) would change the norms."""
    trainer, logs = train(tmp_path, llama(), offload=True, max_steps=3,
                          gradient_checkpointing=True,
                          gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    layer = trainer.model.model.layers[0]
    assert trainer.model.is_gradient_checkpointing and layer.gradient_checkpointing
    assert layer._gradient_checkpointing_func.keywords["use_reentrant"] is reentrant
    ref = llama_without_checkpointing
    assert column(logs, "loss") == column(ref, "loss")
    assert column(logs, "grad_norm") == column(ref, "grad_norm")


# ------------------------------------------------------------ the loss
def test_neftune_noise_alpha(tmp_path, plain):
    """NEFTune's noise on the input embeddings is in the training forward only: the losses
    are the stock Trainer's (the same noise from the same seed), not those without noise,
    and after training the hook is gone (evaluation is deterministic)."""
    trainer, logs = train(tmp_path / "offload", gpt2(), offload=True, neftune_noise_alpha=5.0,
                          eval_data=Tokens(4, seed=3))
    _, ref = train(tmp_path / "stock", gpt2(), offload=False, neftune_noise_alpha=5.0)
    assert column(logs, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(logs, "grad_norm") != pytest.approx(column(plain[1], "grad_norm"), rel=1e-3)
    embeddings = trainer.model.get_input_embeddings()
    assert not embeddings._forward_hooks  # deactivated at the end of train()
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first["eval_loss"] == second["eval_loss"]


def test_label_smoothing_factor(tmp_path, plain):
    """The Trainer's label smoother computes the loss the engine's grads come from: the
    stock Trainer's losses, which differ from those without smoothing."""
    _, logs = train(tmp_path / "offload", gpt2(), offload=True, label_smoothing_factor=0.1)
    _, ref = train(tmp_path / "stock", gpt2(), offload=False, label_smoothing_factor=0.1)
    assert column(logs, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(logs, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-5)
    # near the start the smoothed loss is close to the plain one; its gradient is not
    assert column(logs, "grad_norm") != pytest.approx(column(plain[1], "grad_norm"), rel=1e-3)


def test_optim_adamw_torch_fused(tmp_path, plain):
    """Both allowed --optim values are the same AdamW rule: the same engine, bit for bit."""
    a, got = train(tmp_path, gpt2(), offload=True, optim="adamw_torch_fused")
    b, ref = plain
    assert (a.args.optim, b.args.optim) == ("adamw_torch_fused", "adamw_torch")
    assert type(a.engine) is type(b.engine) and a.engine.plugin == b.engine.plugin
    assert [{k: v for k, v in g.items() if k != "params"} for g in a.engine.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b.engine.param_groups]
    assert got == ref  # every key of every step's entry


# ------------------------------------------------------------ auto_find_batch_size
class OutOfMemoryOnce:
    """Raises CUDA's out-of-memory error in the middle of the first backward: after the
    last block's grads reached the engine, before the first block's."""

    def __init__(self, model):
        self.raised = 0
        model.transformer.h[0].register_forward_hook(self.hook)

    def hook(self, module, args, out):
        if self.raised == 0 and torch.is_grad_enabled():
            (out[0] if isinstance(out, tuple) else out).register_hook(self.fail)

    def fail(self, grad):
        self.raised += 1
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "bf16"])
def test_auto_find_batch_size(tmp_path, precision):
    """An out-of-memory error in the first backward: the Trainer retries with 90% of the
    batch (4 -> 3). The engine of the first try is closed (its hooks and host state gone,
    the object freed) and a new one built with its fp32 masters, so the retry trains as a
    run started at batch 3 does, bit for bit, and as the stock Trainer's retry does."""
    kw = dict(auto_find_batch_size=True, per_device_train_batch_size=4,
              train_sampling_strategy="sequential", **({"bf16": True} if precision == "bf16"
                                                       else {}))
    trainer = make(tmp_path / "retry", gpt2(), offload=True, **kw)
    oom = OutOfMemoryOnce(trainer.model)
    first = {}

    class Watch(TrainerCallback):  # the first try's engine, once built
        def on_train_begin(self, args, state, control, **kw):
            if trainer.engine is not None and "engine" not in first:
                first["engine"] = weakref.ref(trainer.engine)

    trainer.add_callback(Watch())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert oom.raised == 1 and trainer._train_batch_size == 3
    gc.collect()
    assert first["engine"]() is None  # freed: nothing holds the first engine
    engine = trainer.engine
    for p in trained(engine):  # one grad hook per param: the new engine's
        assert len(p._post_accumulate_grad_hooks) == 1
    assert engine.applied_steps == FAST["max_steps"]

    fresh_kw = {k: v for k, v in kw.items() if k != "auto_find_batch_size"}
    _, fresh = train(tmp_path / "fresh", gpt2(), offload=True,
                     **{**fresh_kw, "per_device_train_batch_size": 3})
    assert column(logs, "loss") == column(fresh, "loss")
    assert column(logs, "grad_norm") == column(fresh, "grad_norm")
    if precision == "fp32":
        stock = make(tmp_path / "stock", gpt2(), offload=False, **kw)
        OutOfMemoryOnce(stock.model)
        stock.train()
        ref = [e for e in stock.state.log_history if "loss" in e]
        assert column(logs, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)


def test_auto_find_batch_size_with_several_processes_is_refused(tmp_path, monkeypatch):
    args = ZeroOffloadTrainingArguments(zero_offload=True, output_dir=str(tmp_path),
                                        auto_find_batch_size=True, use_cpu=True, report_to=[])
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 2))
    model = gpt2()
    with pytest.raises(ValueError, match=r"^--auto_find_batch_size with --zero_offload and 2 "
                                         r"processes: the ranks would retry apart\. Find the "
                                         r"batch size in one process"):
        ZeroOffloadTrainer(model=model, args=args, train_dataset=Tokens())
    assert next(model.parameters()).dtype == torch.float32  # nothing was touched


# ------------------------------------------------------------ callback state on resume
class CountsSteps(TrainerCallback, ExportableState):
    def __init__(self, count=0):
        self.count = count

    def on_step_end(self, args, state, control, **kw):
        self.count += 1

    def state(self):
        return {"args": {}, "attributes": {"count": self.count}}


SAVES = dict(save_strategy="steps", save_steps=2, max_steps=4)


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """A run with a stateful callback, saved at step 2: (its folder, its step logs)."""
    out = tmp_path_factory.mktemp("counted")
    _, logs = train(out, gpt2(), offload=True, callbacks=[CountsSteps()], **SAVES)
    return out, logs


@pytest.mark.parametrize("restore", [True, False])
def test_restore_callback_states_from_checkpoint(tmp_path, restore, counted):
    """A stateful callback's state comes back from the checkpoint when asked (and only
    then), while the engine resumes the run bit for bit."""
    folder, full = counted
    trainer, resumed = train(tmp_path, gpt2(), offload=True, callbacks=[CountsSteps()],
                             resume=str(folder / "checkpoint-2"),
                             restore_callback_states_from_checkpoint=restore, **SAVES)
    counter = next(c for c in trainer.callback_handler.callbacks if isinstance(c, CountsSteps))
    assert counter.count == (4 if restore else 2)
    resumed = [e for e in resumed if e["step"] > 2]
    assert column(resumed, "loss") == column(full, "loss")[2:]
