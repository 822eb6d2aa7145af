import logging
import warnings

import pytest
import torch

from hf_zoffload.optim.loss_scaler import DynamicLossScaler

X, C = True, False  # overflow / clean step


def trajectory(scaler, steps):
    out = []
    for overflow in steps:
        scaler.update_scale(overflow)
        out.append(scaler.loss_scale)
    return out


def gradscaler_trajectory(steps, **kw):
    """torch.amp.GradScaler driven on the CPU with real grads holding inf or not."""
    gs = torch.amp.GradScaler("cpu", **kw)
    gs.scale(torch.ones(()))  # GradScaler creates its scale tensor on the first scale()
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.0)
    out = []
    for overflow in steps:
        p.grad = torch.full((4,), float("inf") if overflow else 3.0)
        gs.step(opt)
        gs.update()
        out.append(gs.get_scale())
    return out


SEQ = [C, C, C, X, C, C, X, X, C, C, C, C, C, C, C, X, C, C, C, C, C, C, C, X, X, X, C]


@pytest.mark.parametrize(("growth", "backoff"), [(2.0, 0.5), (3.0, 0.3), (1.5, 0.7)])
def test_hysteresis_1_equals_gradscaler(growth, backoff):
    # Non-power-of-two factors too: the scale is rounded to fp32 as GradScaler's tensor is.
    kw = dict(init_scale=2.0**10, growth_factor=growth, backoff_factor=backoff,
              growth_interval=3)
    ours = DynamicLossScaler(**kw, hysteresis=1, min_scale=1e-30)
    assert trajectory(ours, SEQ) == gradscaler_trajectory(SEQ, **kw)


def test_hysteresis_1_equals_gradscaler_through_protocol():
    # The same, driven like accelerate drives a GradScaler, with a plain torch optimizer.
    kw = dict(init_scale=2.0**10, growth_interval=3)
    ours = DynamicLossScaler(**kw, hysteresis=1)
    gs = torch.amp.GradScaler("cpu", **kw)
    gs.scale(torch.ones(()))
    ps = [torch.nn.Parameter(torch.ones(5)) for _ in range(2)]
    qs = [torch.nn.Parameter(torch.ones(5)) for _ in range(2)]
    opt_p = torch.optim.SGD(ps, lr=0.1)
    opt_q = torch.optim.SGD(qs, lr=0.1)
    for i, overflow in enumerate(SEQ):
        grad = torch.arange(5.0) * 1024 + i
        if overflow:
            grad[i % 5] = float("nan") if i % 2 else float("-inf")
        for p, q in zip(ps, qs, strict=True):
            p.grad, q.grad = grad.clone(), grad.clone()
        before = ps[0].detach().clone()
        ours.step(opt_p)
        ours.update()
        gs.step(opt_q)
        gs.update()
        assert ours.get_scale() == gs.get_scale()
        assert torch.equal(ps[0], qs[0])
        assert torch.equal(ps[0], before) == overflow
    assert ours.skipped_steps == sum(SEQ)


@pytest.mark.parametrize(("hysteresis", "steps", "want"), [
    # hysteresis 2: the 2nd overflow backs off, even with clean steps in between
    (2, [X, C, X, X, X, C, X], [64, 64, 32, 32, 16, 16, 16]),
    # hysteresis 3: every 3rd overflow since the last backoff or growth
    (3, [X, X, X, C, X, X, C, X, X, X, X], [64, 64, 32, 32, 32, 32, 32, 16, 16, 16, 8]),
])
def test_hysteresis(hysteresis, steps, want):
    s = DynamicLossScaler(init_scale=64, hysteresis=hysteresis, growth_interval=100)
    assert trajectory(s, steps) == want
    assert s.skipped_steps == sum(steps)


def test_hysteresis_refills_on_growth():
    s = DynamicLossScaler(init_scale=64, hysteresis=2, growth_interval=2)
    # X leaves 1; two clean steps grow the scale and refill the counter to 2, so the next
    # lone overflow does not back off.
    assert trajectory(s, [X, C, C, X, C]) == [64, 64, 128, 128, 128]


def test_growth_after_interval_of_clean_steps():
    s = DynamicLossScaler(init_scale=8, growth_interval=3, hysteresis=1, growth_factor=2)
    assert trajectory(s, [C, C, C, C, C, C, C]) == [8, 8, 16, 16, 16, 32, 32]
    # an overflow restarts the count of clean steps
    assert trajectory(s, [C, X, C, C, C]) == [32, 16, 16, 16, 32]


def test_growth_stops_below_fp32_max():
    s = DynamicLossScaler(init_scale=2.0**127, growth_interval=1)
    assert trajectory(s, [C, C]) == [2.0**127, 2.0**127]


def test_floor_and_warns_once():
    s = DynamicLossScaler(init_scale=16, min_scale=4, hysteresis=1)
    with pytest.warns(RuntimeWarning, match="min_scale=4") as record:
        assert trajectory(s, [X, X, X, X, X]) == [8, 4, 4, 4, 4]
    assert len([w for w in record if "min_scale" in str(w.message)]) == 1
    s2 = DynamicLossScaler(init_scale=16, min_scale=3, hysteresis=1, backoff_factor=0.5)
    with pytest.warns(RuntimeWarning):
        assert trajectory(s2, [X, X, X]) == [8, 4, 3]  # clamped to a non-power floor


def test_no_floor_warning_above_floor():
    s = DynamicLossScaler(init_scale=64, min_scale=1, hysteresis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trajectory(s, [X, X, X])


def test_device_tensors_follow_the_scale():
    s = DynamicLossScaler(init_scale=1024, hysteresis=1)
    t, inv = s.scale_tensor("cpu"), s.inv_scale_tensor(torch.device("cpu"))
    assert t is s.scale_tensor("cpu") and t.dtype == torch.float32 and t.shape == (1,)
    assert (t.item(), inv.item()) == (1024.0, 1 / 1024)
    s.update_scale(True)
    assert (t.item(), inv.item()) == (512.0, 1 / 512)
    s.update(new_scale=8.0)
    assert (t.item(), inv.item(), s.get_scale()) == (8.0, 0.125, 8.0)


def test_skip_logging_is_rate_limited(caplog):
    s = DynamicLossScaler(init_scale=2.0**16, hysteresis=1, min_scale=2.0**-120, log_every=50)
    with caplog.at_level(logging.INFO, logger="hf_zoffload.optim.loss_scaler"):
        trajectory(s, [X] * 120)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3  # skips 1, 50 and 100: never one line per skip
    assert lines[0].startswith("fp16 overflow: 1 of 1 steps skipped")
    assert lines[2].startswith("fp16 overflow: 100 of 100 steps skipped")


# ------------------------------------------------------------------- state_dict
def test_state_round_trip_mid_hysteresis():
    kw = dict(init_scale=256, hysteresis=3, growth_interval=4)
    a = DynamicLossScaler(**kw)
    trajectory(a, [C, X, C, X, C])  # one overflow left before backoff, tracker at 1
    sd = a.state_dict()
    assert sd["_hysteresis_left"] == 1 and sd["_growth_tracker"] == 1
    b = DynamicLossScaler()  # defaults differ: everything comes from the state
    b.load_state_dict(sd)
    assert b.state_dict() == sd
    rest = [C, X, C, C, C, C, X, X, X, C, X]
    assert trajectory(b, rest) == trajectory(a, rest)
    assert b.state_dict() == a.state_dict()
    assert b.scale_tensor("cpu").item() == a.loss_scale


def test_load_gradscaler_state_dict():
    gs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7, backoff_factor=0.25)
    gs.scale(torch.ones(()))
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=0.0)
    gs.step(opt)
    gs.update()
    s = DynamicLossScaler(hysteresis=2)
    t = s.scale_tensor("cpu")
    s.load_state_dict(gs.state_dict())
    assert s.get_scale() == 512.0 and t.item() == 512.0
    sd = s.state_dict()
    assert (sd["growth_interval"], sd["backoff_factor"], sd["_growth_tracker"]) == (7, 0.25, 1)
    assert (sd["hysteresis"], sd["_hysteresis_left"], sd["skipped_steps"]) == (2, 2, 0)
    # and GradScaler takes ours (it reads its own keys)
    gs2 = torch.amp.GradScaler("cpu")
    gs2.load_state_dict(sd)
    assert gs2.get_scale() == 512.0


def test_load_rejects_empty_and_bad_values():
    s = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="empty"):
        s.load_state_dict({})
    before = s.state_dict()
    with pytest.raises(ValueError, match="backoff_factor"):
        s.load_state_dict({**before, "scale": 8.0, "backoff_factor": 2.0})
    assert s.state_dict() == before  # a bad checkpoint changes nothing


# ----------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(("kw", "name"), [
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(growth_factor=0.5), "growth_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=1.5), "backoff_factor"),
    (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=-1.0), "init_scale"),
    (dict(init_scale=float("inf")), "init_scale"),
    (dict(init_scale=float("nan")), "init_scale"),
    (dict(init_scale=0.5), "init_scale"),  # below min_scale=1
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(min_scale=0.0), "min_scale"),
    (dict(log_every=0), "log_every"),
])
def test_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kw)


# ---------------------------------------------------------------------- protocol
def test_plain_optimizer_skips_on_inf_and_unscales_otherwise():
    s = DynamicLossScaler(init_scale=4.0, hysteresis=1)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    loss = s.scale((p * torch.tensor([1.0, 2.0, 3.0])).sum())
    loss.backward()
    assert torch.equal(p.grad, torch.tensor([4.0, 8.0, 12.0]))
    s.unscale_(opt)
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(RuntimeError, match="unscale_"):
        s.unscale_(opt)
    assert s.step(opt) is None  # SGD returns None too; check the params instead
    assert torch.equal(p.detach(), torch.tensor([0.0, -1.0, -2.0]))
    with pytest.raises(RuntimeError, match="step"):
        s.step(opt)
    s.update()
    assert s.get_scale() == 4.0
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    s.step(opt)
    s.update()
    assert torch.equal(p.detach(), torch.tensor([0.0, -1.0, -2.0]))  # skipped
    assert s.get_scale() == 2.0 and s.skipped_steps == 1


def test_plain_optimizer_rejects_fp16_grads():
    s = DynamicLossScaler()
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    p.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(ValueError, match="float32"):
        s.unscale_(torch.optim.SGD([p], lr=1.0))


def test_noncontiguous_grad_is_unscaled_in_place():
    s = DynamicLossScaler(init_scale=2.0)
    p = torch.nn.Parameter(torch.ones(3, 4))
    p.grad = torch.full((4, 3), 8.0).t()
    s.unscale_(torch.optim.SGD([p], lr=1.0))
    assert torch.equal(p.grad, torch.full((3, 4), 4.0))


class FusedOptimizer:
    """Stands in for the offload engine: checks and unscales inside its own step."""
    fused_loss_scaling = True

    def __init__(self, scaler, overflow):
        self.scaler, self.overflow, self.calls = scaler, overflow, []
        self.param_groups = [{"params": [torch.nn.Parameter(torch.ones(2))]}]
        self.param_groups[0]["params"][0].grad = torch.full((2,), float("inf"))

    def step(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        self.scaler.update_scale(self.overflow)
        return "stepped"


@pytest.mark.parametrize("overflow", [False, True])
def test_fused_optimizer_protocol(overflow):
    s = DynamicLossScaler(init_scale=64, hysteresis=1)
    opt = FusedOptimizer(s, overflow)
    grad = opt.param_groups[0]["params"][0].grad
    s.unscale_(opt)
    s.unscale_(opt)  # no-op, so no double-unscale error either
    assert torch.equal(grad, torch.full((2,), float("inf")))  # untouched
    assert s.step(opt, None, lr=1) == "stepped"
    assert opt.calls == [((None,), {"lr": 1})]
    s.update()  # the engine already updated
    assert s.get_scale() == (32.0 if overflow else 64.0)
    assert s.skipped_steps == int(overflow)


def test_disabled_scaler_is_transparent():
    s = DynamicLossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert s.scale(loss) is loss and s.get_scale() == 1.0 and not s.is_enabled()
    p = torch.nn.Parameter(torch.ones(1))
    p.grad = torch.full((1,), float("inf"))
    opt = torch.optim.SGD([p], lr=1.0)
    s.unscale_(opt)
    s.step(opt)
    s.update()
    assert torch.isinf(p).all()  # stepped: nothing checked
    assert s.state_dict() == {}
    s.load_state_dict({})


def test_scale_nested_outputs_and_getters():
    s = DynamicLossScaler(init_scale=8.0)
    a, b = s.scale([torch.tensor(1.0), (torch.tensor(2.0),)])
    assert a.item() == 8.0 and isinstance(b, tuple) and b[0].item() == 16.0
    with pytest.raises(ValueError):
        s.scale("loss")
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == \
        (2.0, 0.5, 2000)


# ------------------------------------------------------------------- no host sync
def test_update_and_scale_never_read_device_values(monkeypatch):
    s = DynamicLossScaler(init_scale=1024, hysteresis=1)
    t = s.scale_tensor("cpu")
    loss = torch.tensor(2.0, requires_grad=True)

    def boom(*_a, **_k):
        raise AssertionError("host read of a device tensor")
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    s.update_scale(True)
    scaled = s.scale(loss)
    scaled.backward()
    monkeypatch.undo()
    assert t.item() == 512.0 and scaled.item() == 1024.0 and loss.grad.item() == 512.0


@pytest.mark.gpu
def test_gpu_scale_tensors_refresh_without_sync():
    s = DynamicLossScaler(init_scale=1024, hysteresis=1)
    t, inv = s.scale_tensor("cuda"), s.inv_scale_tensor("cuda")
    x = torch.ones((), device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s.update_scale(True)
        scaled = s.scale(x * 3)
        scaled.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (t.item(), inv.item(), scaled.item(), x.grad.item()) == (512, 1 / 512, 1536, 1536)
