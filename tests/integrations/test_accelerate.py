"""prepare_zero_offload in plain Accelerate loops, on the CPU."""

import importlib
import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState

from hf_zoffload import prepare_zero_offload
from hf_zoffload.integrations.accelerate import zero_offload_enabled

ROOT = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_accelerate",
                                                  ROOT / "scripts" / "train_accelerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny(n_in=8, n_out=4, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(n_in, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, n_out))


# ------------------------------------------------------------ the training loop
@pytest.mark.parametrize("grad_accum,max_grad_norm", [(2, 0.5), (1, 0.0)],
                         ids=["accumulate2-clip", "plain"])
@pytest.mark.slow
def test_losses_equal_plain_adamw_at_fp32(monkeypatch, grad_accum, max_grad_norm):
    script = _load_script()
    argv = ["--grad_accum", str(grad_accum), "--max_grad_norm", str(max_grad_norm)]
    plain = script.main(argv)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    monkeypatch.setenv("HF_ZOFFLOAD_COMPUTE_DTYPE", "fp32")
    offload = script.main(argv + ["--zero_offload"])
    assert len(offload["losses"]) == 6 * grad_accum
    # Same math in another order (one-pass CPU-Adam, host-side norm): fp32 rounding only.
    torch.testing.assert_close(offload["losses"], plain["losses"], rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(offload["grad_norms"], plain["grad_norms"], rtol=2e-5, atol=1e-6)
    assert offload["lr"] == plain["lr"]  # the linear schedule drove the engine to 0
    if max_grad_norm:
        assert min(plain["grad_norms"]) > max_grad_norm  # clipping was active every step
    assert plain["losses"][-1] < plain["losses"][0] - 0.2  # and it learned


def test_bf16_from_accelerate_mixed_precision_and_frozen_params():
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = _tiny()
    model[0].bias.requires_grad_(False)  # frozen: cast too, or the matmul would mix dtypes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    teacher = _tiny().requires_grad_(False)
    model, opt, teacher = prepare_zero_offload(accelerator, model, opt, teacher)
    engine = opt.optimizer
    assert engine.plugin.compute_dtype == "bf16"  # followed accelerate's mixed_precision
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in teacher.parameters()} == {torch.float32}  # not ours: untouched
    assert accelerator.scaler is None  # bf16 needs no loss scale
    x = torch.randn(32, 8)
    losses = []
    for _ in range(5):
        loss = model(x).float().pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_no_mixed_precision_trains_in_fp32():
    """mixed_precision "no" is fp32, as the stock accelerator.prepare trains (it used to
    become pure bf16, the plugin's default, without a word); compute_dtype set wins."""
    model = _tiny()
    model, opt = prepare_zero_offload(Accelerator(cpu=True), model,
                                      torch.optim.AdamW(model.parameters()))
    assert opt.optimizer.plugin.compute_dtype == "fp32"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    AcceleratorState._reset_state(reset_partial_state=True)
    model = _tiny()
    model, opt = prepare_zero_offload(Accelerator(cpu=True), model,
                                      torch.optim.AdamW(model.parameters()), compute_dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_triton_kernels_refused_before_any_work(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the suite's interpreter mode
    model = _tiny()
    with pytest.raises(ValueError, match="'kernels': 'triton' needs a CUDA device"):
        prepare_zero_offload(Accelerator(cpu=True), model,
                             torch.optim.AdamW(model.parameters()), kernels="triton")
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # nothing was cast


def test_fp16_installs_loss_scaler_and_skipped_steps_skip_the_scheduler():
    accelerator = Accelerator(cpu=True)
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = prepare_zero_offload(accelerator, model, opt, sched,
                                             compute_dtype="fp16", init_scale=1024.0,
                                             hysteresis=1)
    engine = opt.optimizer
    assert accelerator.scaler is engine.loss_scaler and engine.loss_scaler.is_enabled()
    assert sched.scheduler.optimizer is engine
    x = torch.randn(4, 8, dtype=torch.float16)  # no autocast with mixed_precision "no"
    before = [p.detach().clone() for p in model.parameters()]
    accelerator.backward(model(x).float().sum() * float("inf"))  # every gradient overflows
    opt.step()
    sched.step()
    opt.zero_grad()
    assert opt.step_was_skipped and engine.skipped_steps == 1
    assert engine.param_groups[0]["lr"] == 1e-2  # the scheduler skipped with the step
    assert engine.loss_scaler.get_scale() == 512.0  # backed off (hysteresis 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    accelerator.backward(model(x).float().pow(2).mean())
    opt.step()
    sched.step()
    assert not opt.step_was_skipped and engine.param_groups[0]["lr"] == 5e-3


def test_a_built_engine_is_taken_as_is():
    from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin

    accelerator = Accelerator(cpu=True)
    model = _tiny()
    engine = ZeroOffloadOptimizer(model.parameters(), lr=1e-2,
                                  plugin=ZeroOffloadPlugin(compute_dtype="fp32"))
    model, opt = prepare_zero_offload(accelerator, model, engine)
    assert isinstance(opt, AcceleratedOptimizer) and opt.optimizer is engine
    with pytest.raises(TypeError, match="has its plugin already"):
        prepare_zero_offload(Accelerator(cpu=True), model, engine, bucket_size_mb=1)


# --------------------------------------------------------------------- switches
def test_disabled_is_plain_accelerate(monkeypatch, tmp_path):
    side = tmp_path / "acc_zoffload.yaml"
    side.write_text(yaml.safe_dump({"zero_offload": False, "zoffload": {}}))
    monkeypatch.setenv("HF_ZOFFLOAD_CONFIG", str(side))
    accelerator = Accelerator(cpu=True)
    model = _tiny()
    adamw = torch.optim.AdamW(model.parameters())
    _, opt = prepare_zero_offload(accelerator, model, adamw)
    assert opt.optimizer is adamw
    assert accelerator.clip_grad_norm_.__func__ is Accelerator.clip_grad_norm_  # untouched


def test_enabled_precedence(tmp_path):
    side = tmp_path / "s_zoffload.yaml"
    side.write_text(yaml.safe_dump({"zero_offload": False, "zoffload": {}}))
    assert zero_offload_enabled(environ={}) is True
    assert zero_offload_enabled(environ={"HF_ZOFFLOAD_CONFIG": str(side)}) is False
    assert zero_offload_enabled(environ={"HF_ZOFFLOAD_CONFIG": str(side),
                                         "HF_ZOFFLOAD_ENABLED": "yes"}) is True
    with pytest.raises(ValueError, match="HF_ZOFFLOAD_ENABLED='sure'.*allowed:.*true"):
        zero_offload_enabled(environ={"HF_ZOFFLOAD_ENABLED": "sure"})
    side.write_text(yaml.safe_dump({"zero_offload": "maybe", "zoffload": {}}))
    with pytest.raises(ValueError, match="'zero_offload' must be true or false"):
        zero_offload_enabled(environ={"HF_ZOFFLOAD_CONFIG": str(side)})


def test_settings_precedence_argument_env_yaml(monkeypatch, tmp_path):
    side = tmp_path / "s_zoffload.yaml"
    side.write_text(yaml.safe_dump({"zoffload": {"compute_dtype": "fp32", "bucket_size_mb": 1,
                                                 "cpu_threads": 1}}))
    monkeypatch.setenv("HF_ZOFFLOAD_CONFIG", str(side))
    monkeypatch.setenv("HF_ZOFFLOAD_BUCKET_SIZE_MB", "2")
    model = _tiny()
    _, opt = prepare_zero_offload(Accelerator(cpu=True), model,
                                  torch.optim.AdamW(model.parameters()), cpu_threads=2)
    p = opt.optimizer.plugin
    assert (p.compute_dtype, p.bucket_size_mb, p.cpu_threads) == ("fp32", 2.0, 2)


# ----------------------------------------------------------------------- errors
def test_deepspeed_or_fsdp_accelerator_is_a_clear_error():
    from accelerate.utils import DistributedType

    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        fake = SimpleNamespace(num_processes=2, distributed_type=kind, mixed_precision="no")
        model = _tiny()
        with pytest.raises(ValueError, match="NO, MULTI_CPU or MULTI_GPU"):
            prepare_zero_offload(fake, model, torch.optim.AdamW(model.parameters()))
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bad_settings_and_optimizers(monkeypatch):
    model = _tiny()
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="unknown ZeRO-Offload argument 'bucket_mb'"):
        prepare_zero_offload(acc, model, torch.optim.AdamW(model.parameters()), bucket_mb=2)
    with pytest.raises(ValueError, match="'compute_dtype'.*allowed: fp16, bf16, fp32"):
        prepare_zero_offload(acc, model, torch.optim.AdamW(model.parameters()),
                             compute_dtype="fp8")
    with pytest.raises(ValueError, match="L2 term.*Use torch.optim.AdamW"):
        prepare_zero_offload(acc, model, torch.optim.Adam(model.parameters(), weight_decay=0.1))
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        prepare_zero_offload(acc, model, torch.optim.AdamW(model.parameters(), amsgrad=True))
    with pytest.raises(TypeError, match="SGD cannot be offloaded; allowed: torch.optim.AdamW"):
        prepare_zero_offload(acc, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="exactly one optimizer"):
        prepare_zero_offload(acc, model)
    adamw = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.StepLR(adamw, step_size=1)
    with pytest.raises(ValueError, match="scheduler was built on this optimizer but is not"):
        prepare_zero_offload(acc, model, adamw, compute_dtype="fp32")


def test_dtype_conflict_with_accelerate(monkeypatch):
    monkeypatch.setenv("HF_ZOFFLOAD_COMPUTE_DTYPE", "fp16")
    model = _tiny()
    with pytest.raises(ValueError, match="mixed_precision is bf16 but ZeRO-Offload "
                                         "compute_dtype is fp16"):
        prepare_zero_offload(Accelerator(mixed_precision="bf16", cpu=True), model,
                             torch.optim.AdamW(model.parameters()))


def test_clip_routes_to_the_engine_and_rejects_parts():
    accelerator = Accelerator(cpu=True)
    model = _tiny()
    model, opt = prepare_zero_offload(accelerator, model, torch.optim.AdamW(model.parameters()),
                                      compute_dtype="fp32")
    accelerator.backward(model(torch.randn(4, 8)).pow(2).sum())
    assert all(p.grad is None for p in model.parameters())  # streamed to the host
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e-3)
    assert float(norm) > 1e-3
    with pytest.raises(ValueError, match="part of the ZeRO-Offload optimizer's parameters"):
        accelerator.clip_grad_norm_(model[0].parameters(), 1.0)
    with pytest.raises(NotImplementedError, match="use clip_grad_norm_"):
        accelerator.clip_grad_value_(model.parameters(), 1.0)
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.ones(3)
    assert float(accelerator.clip_grad_norm_([other], 1.0)) == pytest.approx(3**0.5)


def test_accelerate_internals_relied_on():
    """What prepare_zero_offload relies on in accelerate (pinned; not all documented API)."""
    params = list(inspect.signature(AcceleratedOptimizer.__init__).parameters)
    assert params[:4] == ["self", "optimizer", "device_placement", "scaler"]
    assert isinstance(inspect.getattr_static(AcceleratedOptimizer, "step_was_skipped"), property)
    assert "_is_accelerate_prepared" in inspect.getsource(Accelerator.prepare_optimizer)
    assert "self.scaler.scale(loss).backward" in inspect.getsource(Accelerator.backward)
    assert "step_was_skipped" in inspect.getsource(
        importlib.import_module("accelerate.scheduler").AcceleratedScheduler.step)


# ------------------------------------------------------------------ checkpoints
def _trained(compute_dtype):
    accelerator = Accelerator(cpu=True)
    model = _tiny()
    model, opt = prepare_zero_offload(accelerator, model, torch.optim.AdamW(model.parameters()),
                                      compute_dtype=compute_dtype)
    x = torch.randn(4, 8, dtype=model[0].weight.dtype)
    accelerator.backward(model(x).float().pow(2).mean())
    opt.step()
    opt.zero_grad()
    return accelerator, model, opt, x


def test_save_state_round_trip_pickle(tmp_path):
    accelerator, model, opt, x = _trained("fp16")
    accelerator.save_state(str(tmp_path / "ckpt"), safe_serialization=False)
    saved = [p.detach().clone() for p in model.parameters()]
    accelerator.backward(model(x).float().pow(2).mean())
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    assert (tmp_path / "ckpt" / "scaler.pt").exists()  # our loss scaler's state


def test_save_state_safetensors_keeps_every_weight(tmp_path):
    accelerator, model, _, _ = _trained("fp32")
    accelerator.save_state(str(tmp_path / "ckpt"))
    from safetensors.torch import load_file

    assert len(load_file(str(tmp_path / "ckpt" / "model.safetensors"))) == 4


def test_scheduler_keys_move_with_the_groups():
    """A scheduler that keeps its own keys in the param groups (OneCycleLR: max_lr, min_lr)
    keeps working once its optimizer is replaced by the engine."""
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    _, engine, sched = prepare_zero_offload(Accelerator(cpu=True), model, opt, sched,
                                            compute_dtype="fp32")
    assert engine.optimizer.param_groups[0]["max_lr"] == 1e-2
    model(torch.ones(2, 8)).sum().backward()
    engine.step()
    sched.step()
    assert engine.optimizer.param_groups[0]["lr"] != opt.param_groups[0]["initial_lr"]
