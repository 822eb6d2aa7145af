"""Saved weights are the fp32 master weights (issue 15, item 3), and checkpoints resume
across precisions and between the stock and the offload Trainer (item 5). CPU."""

import json

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_zoffload import ZeroOffloadOptimizer, prepare_zero_offload
from hf_zoffload.integrations import core
from tests.integrations.test_trainer import Tokens, gpt2, run

FP16 = {"zero_offload_init_scale": 2.0**10}
INDEX = "model.safetensors.index.json"  # a scale this model's fp16 grads survive


def _masters(engine, model):
    return engine.master_state_dict(model)


def _check_saved(folder, masters, model, dtype="float32"):
    """Every saved tensor is the master weight, bit for bit; the config names its dtype, and
    from_pretrained gives the same fp32 weights back."""
    saved = load_file(str(folder / "model.safetensors"))
    assert saved and all(t.dtype == getattr(torch, dtype) for t in saved.values())
    for name, t in saved.items():
        assert torch.equal(t, masters[name].to(t.dtype)), name
    # the masters hold more than the 16-bit params: saving those would have lost it
    params = dict(model.named_parameters())
    assert any(not torch.equal(masters[n], p.detach().float()) for n, p in params.items())
    assert json.loads((folder / "config.json").read_text())["dtype"] == dtype
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for name, t in loaded.state_dict().items():
        if name in masters and masters[name].is_floating_point():
            assert t.dtype == getattr(torch, dtype), name
            assert torch.equal(t, masters[name].to(t.dtype)), name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_saves_the_fp32_masters(tmp_path, precision):
    trainer, _ = run(tmp_path / "run", gpt2(), offload=True, max_steps=3,
                     **{precision: True}, **(FP16 if precision == "fp16" else {}))
    model = trainer.model
    assert next(model.parameters()).dtype != torch.float32  # trained in 16 bit
    trainer.save_model(str(tmp_path / "out"))
    _check_saved(tmp_path / "out", _masters(trainer.engine, model), model)
    assert next(model.parameters()).dtype != torch.float32  # the live model is untouched


def test_trainer_save_dtype_compute_saves_the_device_copy(tmp_path):
    trainer, _ = run(tmp_path / "run", gpt2(), offload=True, max_steps=2, bf16=True,
                     zero_offload_save_dtype="compute")
    trainer.save_model(str(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(t, params[n].detach()) for n, t in saved.items() if n in params)
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_accelerate_saves_the_fp32_masters(tmp_path):
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = prepare_zero_offload(accelerator, model, opt)
    for ids in Tokens(4).ids.split(2):
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    masters = _masters(opt.optimizer, model)
    accelerator.save_model(model, str(tmp_path / "saved"))
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert all(torch.equal(t, masters[n]) for n, t in saved.items())
    accelerator.save_state(str(tmp_path / "state"))
    saved = load_file(str(tmp_path / "state" / "model.safetensors"))
    assert all(torch.equal(t, masters[n]) for n, t in saved.items())
    # the transformers way: save_pretrained with the accelerator's state dict
    accelerator.unwrap_model(model).save_pretrained(
        str(tmp_path / "pretrained"), state_dict=accelerator.get_state_dict(model))
    _check_saved(tmp_path / "pretrained", masters, model)
    # and a state_dict a stock loop would read is still the model's own
    assert next(iter(model.state_dict().values())).dtype == torch.bfloat16


# ------------------------------------------------------------------------ resume (item 5)
def _train(tmp_path, kind, *, resume=None, max_steps=3):
    """kind: 'offload-<precision>' or 'stock-<precision>'; saves a checkpoint at step 3."""
    who, precision = kind.split("-")
    kw = {"max_steps": max_steps, "save_strategy": "steps", "save_steps": 3}
    if precision != "fp32":
        kw[precision] = True
    if who == "offload":
        kw.update(FP16 if precision == "fp16" else {})
        # loss_scale in the log entries (the test below reads the resumed run's first)
        return run(tmp_path, gpt2(), offload=True, resume=resume,
                   zero_offload_log_history_extras=True, **kw)
    return run(tmp_path, gpt2(), resume=resume, **kw)


CASES = [("offload-fp16", "offload-bf16"), ("offload-fp16", "offload-fp32"),
         ("offload-bf16", "offload-fp16"), ("offload-fp16", "stock-fp32"),
         ("offload-fp16", "stock-bf16"), ("stock-bf16", "offload-fp16")]


@pytest.mark.parametrize("saved_by, resumed_by", CASES, ids=[f"{a}->{b}" for a, b in CASES])
def test_resume_across_precisions_and_trainers(tmp_path, saved_by, resumed_by):
    first, _ = _train(tmp_path / "a", saved_by)
    ckpt = tmp_path / "a" / "checkpoint-3"
    assert not (ckpt / "scaler.pt").exists() or saved_by.startswith("stock")
    weights = load_file(str(ckpt / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    if saved_by.startswith("offload"):  # the saved weights are the optimizer's masters
        name = {id(p): n for n, p in first.model.named_parameters()}
        order = [name[id(p)] for g in first.engine.param_groups for p in g["params"]]
        compared = [n for n in order if n in weights]
        assert len(compared) == len(weights)  # every saved weight is a trained param here
        assert all(torch.equal(weights[n], optim["state"][order.index(n)]["master"])
                   for n in compared)

    trainer, logs = _train(tmp_path / "b", resumed_by, resume=str(ckpt), max_steps=5)
    after = [e for e in logs if e["step"] > 3]
    assert [e["step"] for e in after] == [4, 5]
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in after)
    if resumed_by.startswith("offload"):
        engine = trainer.engine
        assert engine.applied_steps == (5 if saved_by.startswith("offload") else 2)
        if resumed_by == "offload-fp16":  # a fresh scale: the checkpoint had none to give
            assert after[0]["loss_scale"] == FP16["zero_offload_init_scale"]
    else:
        state = trainer.optimizer.optimizer.state
        assert {float(s["step"]) for s in state.values()} == {5.0}  # AdamW's counts resumed


# ------------------------------------------------- a save over a save of the other layout
def _weight_names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir()
                  if p.name.startswith(("model", "pytorch_model")))


def test_a_save_removes_the_other_layouts_weights(tmp_path):
    """Sharded over one file, one file over shards, safetensors over a .bin: only the new
    layout's weights stay, so a load (the Trainer's resume reads model.safetensors, else
    pytorch_model.bin, before any index) reads what was saved last. The stock save_pretrained
    leaves model.safetensors under new shards: the reason this exists."""
    model = gpt2()
    engine = ZeroOffloadOptimizer(model.parameters(), lr=1e-2)
    stock = gpt2()
    stock.save_pretrained(tmp_path / "stock")
    stock.save_pretrained(tmp_path / "stock", max_shard_size="40KB")
    assert "model.safetensors" in _weight_names(tmp_path / "stock")  # stale, and read first

    core.prepare_models(engine, [model])
    out = tmp_path / "ours"
    out.mkdir()
    torch.save({"stale": torch.ones(1)}, out / "pytorch_model.bin")
    (out / "pytorch_model-00001-of-00002.bin").write_bytes(b"stale")
    (out / "model.fp16.safetensors").write_bytes(b"another variant: left alone")
    model.save_pretrained(out)
    assert _weight_names(out) == ["model.fp16.safetensors", "model.safetensors"]
    model.save_pretrained(out, max_shard_size="40KB")
    shards = [n for n in _weight_names(out) if n.startswith("model-")]
    assert len(shards) >= 2
    assert _weight_names(out) == sorted(["model.fp16.safetensors", *shards, INDEX])
    model.save_pretrained(out)
    assert _weight_names(out) == ["model.fp16.safetensors", "model.safetensors"]
    saved, now = load_file(str(out / "model.safetensors")), model.state_dict()
    assert saved and all(torch.equal(t, now[n]) for n, t in saved.items())
    model.save_pretrained(out, is_main_process=False)  # another rank: touches nothing
    assert _weight_names(out) == ["model.fp16.safetensors", "model.safetensors"]
