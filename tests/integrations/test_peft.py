"""LoRA (peft) and quantized-style frozen bases through the engine, the Trainer and Accelerate.

A tiny Llama from a config wrapped by peft's ``get_peft_model``: the offload Trainer trains what
the stock Trainer trains (fp32: the same run within fp32 rounding; bf16: plain mixed precision,
test_trainer.py's reference), holds host state for the adapter only, keeps the frozen base in
the compute dtype on the device, and saves an adapter (not a full model) that
``PeftModel.from_pretrained`` loads to the trained fp32 masters. A QLoRA-style base (frozen
packed 4-bit codes in uint8 params, as bitsandbytes' ``Params4bit``, dequantized in forward) is
left as it is while its adapters train; a trainable non-float param is refused in one line."""

import copy
import math
import os

import pytest
import torch
from accelerate import Accelerator
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin, prepare_zero_offload
from hf_zoffload.integrations import core
from hf_zoffload.offload.memory import estimate, format_report
from tests._tiny import TokenBlocks, batches, tiny_llama
from tests.integrations.test_trainer import COMMON, Tokens, column, llama, reference_bf16, run

# Tiny models on 2 busy cores: torch's 2 threads spin against each other (a tiny Llama's
# forward measured 1.5 s at load 9, 30 ms on one thread). Both sides of every comparison run
# on the same thread count.
pytestmark = pytest.mark.usefixtures("torch_one_thread")

ADAPTER_FILES = {"adapter_model.safetensors", "adapter_config.json"}
FULL_MODEL_FILES = {"model.safetensors", "pytorch_model.bin", "config.json"}


def lora(make=llama):
    """A tiny Llama with LoRA on every linear layer but the head (peft's "all-linear"). B
    starts random (peft's default zero would give A no gradient in the first step). Its
    gradient norms, 0.33-0.73 over COMMON's 6 steps, cross max_grad_norm (0.5), so clipping
    bites. alpha / r = 2: at 8 (on q, k, v, o) the run is ill-conditioned: the stock and
    the offload grad norms drifted 1e-6, 1e-5, 5e-5 apart over steps 3-6 (losses bitwise
    equal, with clipping and without: fp32 rounding amplified); at 2: within 1.6e-7."""
    model = make()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules="all-linear",
                                            init_lora_weights=False))


def adapters(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def base(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if not p.requires_grad}


def trained_by(engine) -> set[int]:
    """The params the engine lays out and steps (its groups may list frozen ones too)."""
    return {id(s.param) for b in engine.buckets for s in b.layout.slots}


def check_adapter_only_state(engine, model, *, accumulation: bool):
    """The engine trains the adapter params and nothing else; its host state is theirs."""
    ours = adapters(model)
    assert ours and all("lora_" in n for n in ours)
    assert trained_by(engine) == {id(p) for p in ours.values()}
    n = sum(p.numel() for p in ours.values())
    host = engine.memory_report()["host"]
    # fp32 moments, one process, one bucket (no padding): 4 B each of master, exp_avg,
    # exp_avg_sq, and the compute-dtype landing buffer; + 4 B of fp32 sum with accumulation
    w = engine.dtype.itemsize
    assert host == {"master": 4 * n, "exp_avg": 4 * n, "exp_avg_sq": 4 * n,
                    "grad_staging": w * n, "grad_accumulation": 4 * n if accumulation else 0}
    held = sum(t.numel() * t.element_size() for b in engine.buckets
               for t in (b.state.master, b.state.exp_avg, b.state.exp_avg_sq))
    assert held == 12 * n  # what the buffers hold, not what the report says


def check_saved_adapter(folder, model, engine):
    """``folder`` holds a peft adapter (as stock peft saves one) whose tensors are the fp32
    masters, and ``PeftModel.from_pretrained`` over a fresh base loads them bit for bit."""
    names = set(os.listdir(folder))
    assert ADAPTER_FILES <= names and not names & FULL_MODEL_FILES, names
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    ours = adapters(model)
    assert len(saved) == len(ours)
    assert all(t.dtype == torch.float32 for t in saved.values())
    loaded = PeftModel.from_pretrained(llama(), folder)
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert got.keys() == ours.keys()
    for name, p in ours.items():
        master = engine.host_views(p)["master"].view_as(p)
        assert torch.equal(got[name].detach(), master), name


# ------------------------------------------------------------------------ the Trainer
@pytest.mark.slow
def test_fp32_lora_matches_the_stock_trainer(tmp_path):
    stock, ref = run(tmp_path / "stock", lora())
    trainer, got = run(tmp_path / "offload", lora(), offload=True)
    engine = trainer.engine
    assert engine.plugin.compute_dtype == "fp32"
    assert len(got) == len(ref) == COMMON["max_steps"]
    assert max(column(ref, "grad_norm")) > COMMON["max_grad_norm"]  # clipping was active
    # test_trainer.py's fp32 bounds (fp32 rounding of two op orders, 1e-7 relative per op)
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-5)
    # the adapters: 6 steps of lr 1e-2 moved them by ~1e-2; fp32 op order differs by ulps
    want = adapters(stock.model)
    for name, p in adapters(trainer.model).items():
        torch.testing.assert_close(p.detach(), want[name].detach(), atol=1e-6, rtol=1e-5,
                                   msg=name)
    fresh = base(lora())
    for name, p in base(trainer.model).items():  # untouched, still fp32
        assert p.dtype == torch.float32 and torch.equal(p, fresh[name]), name
    check_adapter_only_state(engine, trainer.model, accumulation=True)
    trainer.save_model(str(tmp_path / "saved"))
    check_saved_adapter(tmp_path / "saved", trainer.model, engine)


@pytest.mark.slow
def test_bf16_lora_matches_plain_mixed_precision(tmp_path, caplog):
    caplog.set_level("INFO", logger="hf_zoffload")
    data = Tokens()
    trainer, got = run(tmp_path / "offload", lora(), offload=True, bf16=True, data=data,
                       train_sampling_strategy="sequential")
    ref_model = lora()
    ref = reference_bf16(ref_model, data, steps=COMMON["max_steps"],
                         shifted_count=trainer._loss_shifts_labels)
    engine = trainer.engine
    assert engine.plugin.compute_dtype == "bf16"
    assert max(column(ref, "grad_norm")) > COMMON["max_grad_norm"]
    # test_trainer.py's bf16 bounds: the same bf16 forward/backward, the fp32 AdamW's op
    # order now and then flipping a param's bf16 rounding by one ulp.
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=5e-4)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=2e-3)
    want = adapters(ref_model)
    for name, p in adapters(trainer.model).items():
        # bf16 params both, rounded from masters that agree to fp32 rounding: at most one
        # bf16 ulp apart (2**-7 relative at most) where a master sat by a rounding boundary.
        # Measured: all 4,352 equal (losses within 5.7e-8, grad norms 2.1e-7).
        torch.testing.assert_close(p.detach(), want[name].detach(), atol=0, rtol=2**-7,
                                   msg=name)
    device = trainer.args.device
    for name, p in base(trainer.model).items():  # the frozen base: compute dtype, device
        assert p.dtype == torch.bfloat16 and p.device == device, name
    check_adapter_only_state(engine, trainer.model, accumulation=True)
    # the logged report shows the base: bf16 bytes on the frozen line, and the device total
    n_base = sum(p.numel() for p in base(trainer.model).values())
    report = engine.memory_report()
    assert report["n_frozen"] == n_base and report["frozen"] == {"bf16": 2 * n_base}
    line = next(x for x in format_report(report).splitlines() if x.startswith("  frozen "))
    assert f"(+{n_base:,} frozen)" in caplog.text and line in caplog.text
    trainer.save_model(str(tmp_path / "saved"))
    check_saved_adapter(tmp_path / "saved", trainer.model, engine)


@pytest.mark.slow
def test_lora_resume_continues_exactly(tmp_path):
    kw = {"bf16": True, "save_strategy": "steps", "save_steps": 3}
    _, full = run(tmp_path / "full", lora(), offload=True, **kw)
    ckpt = tmp_path / "full" / "checkpoint-3"
    names = set(os.listdir(ckpt))
    assert ADAPTER_FILES | {"optimizer.pt", "scheduler.pt"} <= names
    assert not names & FULL_MODEL_FILES
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    n_adapters = len(adapters(lora()))
    assert len(state["state"]) == n_adapters  # the adapters' state, no base param's
    trainer, resumed = run(tmp_path / "resumed", lora(), offload=True, resume=str(ckpt), **kw)
    resumed = [e for e in resumed if e["step"] > 3]
    assert column(resumed, "loss") == column(full, "loss")[3:]  # bit for bit
    assert column(resumed, "grad_norm") == column(full, "grad_norm")[3:]


# ------------------------------------------------------------------------ Accelerate
def test_lora_through_prepare_zero_offload(tmp_path):
    """peft's usual loop: AdamW over model.parameters() (the frozen base too). fp32 against
    torch's AdamW; saving through accelerate's get_state_dict gives the adapter's masters."""
    data = batches(3, seq=16)
    ref = lora(tiny_llama)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    accelerator = Accelerator(cpu=True)
    model = lora(tiny_llama)
    model, opt = prepare_zero_offload(accelerator, model,
                                      torch.optim.AdamW(model.parameters(), lr=1e-2))
    engine = opt.optimizer
    assert engine.plugin.compute_dtype == "fp32"
    check_adapter_only_state(engine, model, accumulation=False)
    for ids in data:
        losses = []
        for m, o, back in ((ref, ref_opt, torch.Tensor.backward),
                           (model, opt, accelerator.backward)):
            loss = m(input_ids=ids, labels=ids).loss
            back(loss)
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    want = adapters(ref)
    for name, p in adapters(model).items():
        torch.testing.assert_close(p.detach(), want[name].detach(), atol=1e-6, rtol=1e-5)
    folder = tmp_path / "adapter"
    accelerator.unwrap_model(model).save_pretrained(
        folder, state_dict=accelerator.get_state_dict(model))
    names = set(os.listdir(folder))
    assert ADAPTER_FILES <= names and not names & FULL_MODEL_FILES
    saved = load_file(folder / "adapter_model.safetensors")
    for name, p in adapters(model).items():
        key = name.replace(".default", "")
        assert torch.equal(saved[key], engine.host_views(p)["master"].view_as(p)), name


# ------------------------------------------------------------------------ memory report
def test_memory_report_counts_the_frozen_base_by_dtype():
    model = lora(tiny_llama)
    engine = ZeroOffloadOptimizer([p for p in model.parameters() if p.requires_grad],
                                  plugin=ZeroOffloadPlugin(compute_dtype="bf16"), model=model)
    core.prepare_models(engine, [model])  # the frozen base joins bf16, as both paths do
    n_ad = sum(p.numel() for p in adapters(model).values())
    n_base = sum(p.numel() for p in base(model).values())
    report = engine.memory_report()
    assert report["n_params"] == n_ad and report["n_frozen"] == n_base
    assert report["frozen"] == {"bf16": 2 * n_base}
    assert report["device"]["params"] == 2 * n_ad + 2 * n_base
    assert report["plain_adamw_device_total"] == 16 * n_ad + 2 * n_base
    lines = format_report(report).splitlines()
    assert lines[0].startswith(f"model states for {n_ad:,} trainable parameters "
                               f"(+{n_base:,} frozen)")
    assert lines[1].startswith("  device ") and lines[3].startswith("  host ")
    assert lines[2].startswith("  frozen ") and f"(bf16 {2 * n_base / 1024:.2f} KiB)" in lines[2]
    # the estimate says the same for a base in the compute dtype
    est = estimate(n_ad, n_frozen=n_base, compute_dtype="bf16")
    assert est["frozen"] == report["frozen"] and est["n_frozen"] == n_base
    assert format_report(est).splitlines()[2] == lines[2]
    assert "frozen" not in format_report(estimate(n_ad))


# ------------------------------------------------------------------------ quantized bases
class Packed4bit(torch.nn.Parameter):
    """A frozen 4-bit weight held as bitsandbytes' ``Params4bit`` holds one: a Parameter
    subclass of dtype uint8, two codes per byte, requires_grad=False."""


class QLoRALinear(torch.nn.Module):
    """A linear layer whose frozen weight is 4-bit codes (a per-row absmax scale, a buffer),
    dequantized to the input's dtype in forward, plus a trainable LoRA pair."""

    def __init__(self, linear: torch.nn.Linear, r: int = 2):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1, keepdim=True) / 7
        codes = (torch.round(w / scale).clamp(-8, 7) + 8).to(torch.uint8)  # 0..15
        self.weight = Packed4bit(codes[:, 0::2] | (codes[:, 1::2] << 4), requires_grad=False)
        self.register_buffer("scale", scale)
        g = torch.Generator().manual_seed(w.shape[0] * 31 + w.shape[1])
        self.lora_A = torch.nn.Parameter(torch.randn(r, w.shape[1], generator=g) * 0.1)
        self.lora_B = torch.nn.Parameter(torch.randn(w.shape[0], r, generator=g) * 0.1)

    def dequantized(self, dtype) -> torch.Tensor:
        lo, hi = self.weight & 15, self.weight >> 4
        codes = torch.stack([lo, hi], dim=-1).flatten(1).to(dtype) - 8
        return codes * self.scale.to(dtype)

    def forward(self, x):
        w = self.dequantized(x.dtype)
        return x @ w.t() + (x @ self.lora_A.t()) @ self.lora_B.t()


def qlora_llama() -> torch.nn.Module:
    """tests._tiny's Llama with every decoder projection a `QLoRALinear`; embeddings, norms and
    the head frozen (float), the LoRA pairs trainable."""
    model = tiny_llama()
    model.requires_grad_(False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, QLoRALinear(child))
    return model


def packed(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if isinstance(p, Packed4bit)}


def check_quantized_left_alone(model, before):
    now = {n: p for n, p in model.named_parameters() if isinstance(p, Packed4bit)}
    assert now.keys() == before.keys() and before
    for name, p in now.items():
        assert p.dtype == torch.uint8 and not p.requires_grad, name
        assert torch.equal(p.detach(), before[name]), name


def test_quantized_base_engine_fp32_matches_adamw():
    """Frozen uint8 params in the engine's param groups and in ``model=``: not laid out, not
    cast, unchanged; the adapters train as torch's AdamW trains them."""
    ref = qlora_llama()
    ours = copy.deepcopy(ref)
    before = packed(ours)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = ZeroOffloadOptimizer(ours.parameters(), lr=1e-2, model=ours,
                               plugin=ZeroOffloadPlugin(compute_dtype="fp32"))
    trained = [p for p in ours.parameters() if p.requires_grad]
    assert trained_by(opt) == set(map(id, trained))
    assert sum(b.layout.numel for b in opt.buckets) == sum(p.numel() for p in trained)
    for ids in batches(3):
        losses = []
        for m, o in ((ref, ref_opt), (ours, opt)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
    check_quantized_left_alone(ours, before)
    report = opt.memory_report()
    codes = sum(t.numel() for t in before.values())  # one byte each
    floats = sum(p.numel() for p in ours.parameters() if not p.requires_grad) - codes
    assert report["frozen"] == {"fp32": 4 * floats, "uint8": codes}
    assert report["device"]["params"] == 4 * sum(p.numel() for p in trained) + 4 * floats + codes


def test_quantized_base_through_the_trainer(tmp_path, caplog):
    """bf16: the frozen float params join bf16, the packed codes stay uint8 and unchanged,
    the adapters train; the memory report the Trainer logs counts the codes as uint8."""
    caplog.set_level("INFO", logger="hf_zoffload")
    model = qlora_llama()
    before = packed(model)
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters()
                   if p.requires_grad}
    data = TokenBlocks(8, vocab=97, seq=16)
    trainer, logs = run(tmp_path, model, offload=True, bf16=True, data=data, max_steps=2,
                        gradient_accumulation_steps=1)
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) for e in logs)
    check_quantized_left_alone(trainer.model, before)
    for name, p in trainer.model.named_parameters():
        if name in lora_before:
            assert p.dtype == torch.bfloat16
            assert not torch.equal(p.detach(), lora_before[name].to(p.dtype)), name
        elif name not in before:
            assert p.dtype == torch.bfloat16 and not p.requires_grad, name
    frozen = trainer.engine.memory_report()["frozen"]
    assert frozen["uint8"] == sum(t.numel() for t in before.values())
    assert set(frozen) == {"bf16", "uint8"}
    logged = [line for line in caplog.text.splitlines() if line.startswith("  frozen ")]
    assert len(logged) == 1 and "bf16 " in logged[0] and "uint8 " in logged[0]


def test_trainable_non_float_param_is_refused_in_one_line(tmp_path):
    """torch lets complex params require grad; the engine trains float ones only. Refused
    before anything changes, naming the param, through the engine and through the Trainer."""
    model = qlora_llama()
    model.model.layers[0].phase = torch.nn.Parameter(torch.ones(4, dtype=torch.complex64))
    with pytest.raises(TypeError) as e:
        ZeroOffloadOptimizer(model.parameters(), model=model,
                             plugin=ZeroOffloadPlugin(compute_dtype="bf16"))
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.0.phase" in msg and "complex64" in msg
    assert "floating-point params only" in msg and "requires_grad_(False)" in msg
    assert all(p.dtype in (torch.float32, torch.uint8, torch.complex64)
               for p in model.parameters())  # nothing was cast
    with pytest.raises(TypeError, match=r"model\.layers\.0\.phase.*complex64"):
        run(tmp_path, model, offload=True, bf16=True, max_steps=1,
            data=TokenBlocks(4, vocab=97, seq=16))
    assert all(p.dtype in (torch.float32, torch.uint8, torch.complex64)
               for p in model.parameters())


@pytest.mark.slow
def test_bitsandbytes_4bit_base_trains_through_the_trainer(tmp_path):
    """A real 4-bit base (bitsandbytes' CPU backend, nf4) with peft's LoRA: what the
    hand-built `QLoRALinear` tests check, on bitsandbytes' own ``Params4bit``."""
    pytest.importorskip(
        "bitsandbytes", reason="bitsandbytes (an optional quantization backend, a 43 MB "
        "wheel) is not installed; test_quantized_base_* cover the same engine path")
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    tiny_llama().save_pretrained(tmp_path / "base")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = LlamaForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant,
                                             device_map="cpu")
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj",
                                                                                "v_proj"]))
    codes = {n: p.detach().clone() for n, p in model.named_parameters()
             if type(p).__name__ == "Params4bit"}
    assert codes and all(t.dtype == torch.uint8 for t in codes.values())
    trainer, logs = run(tmp_path / "out", model, offload=True, bf16=True, max_steps=2,
                        gradient_accumulation_steps=1, data=TokenBlocks(8, vocab=97, seq=16))
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) for e in logs)
    params = dict(trainer.model.named_parameters())
    for name, before in codes.items():
        assert params[name].dtype == torch.uint8 and torch.equal(params[name].detach(), before)
    assert trainer.engine.memory_report()["frozen"]["uint8"] == sum(
        t.numel() for t in codes.values())
    trainer.save_model(str(tmp_path / "saved"))
    assert ADAPTER_FILES <= set(os.listdir(tmp_path / "saved"))

