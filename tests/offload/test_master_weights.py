"""`master_state_dict()`: the full-precision weights a user saves, one process (the data-
parallel gather is in test_partition.py)."""

import pytest
import torch

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(7, 5)
        self.b = torch.nn.Linear(5, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("counter", torch.arange(4))

    def forward(self, x):
        return self.frozen(self.b(torch.tanh(self.a(x)))).square().mean()


@pytest.mark.parametrize("delayed", [False, True])
def test_master_state_dict_is_the_masters_bit_for_bit(delayed):
    model = _Net()
    frozen_before = model.frozen.weight.detach().clone()
    plugin = ZeroOffloadPlugin(compute_dtype="bf16", delayed_update=delayed,
                               delayed_update_warmup_steps=1)
    opt = ZeroOffloadOptimizer(model.parameters(), lr=1e-2, plugin=plugin)
    model.frozen.to(torch.bfloat16)
    for i in range(4):
        model(torch.randn(6, 7, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i))
              ).backward()
        opt.step()
        opt.zero_grad()
    assert opt.update_in_flight == delayed
    sd = opt.master_state_dict(model)
    assert not opt.update_in_flight  # a pending update was finished first
    assert list(sd) == list(model.state_dict())
    for name, p in model.named_parameters():
        if p.requires_grad:
            master = opt.host_views(p)["master"]
            assert sd[name].dtype == torch.float32 and sd[name].shape == p.shape
            assert torch.equal(sd[name].reshape(-1), master), name
            assert torch.equal(sd[name].to(torch.bfloat16), p.detach()), name
            assert not torch.equal(sd[name], sd[name].to(torch.bfloat16).float()), \
                "fp32 masters hold bits a bf16 copy lacks"
            sd[name].add_(1.0)  # a copy: the optimizer's state is untouched
            assert not torch.equal(sd[name].reshape(-1), master)
    assert sd["frozen.weight"].dtype == torch.bfloat16
    assert torch.equal(sd["frozen.weight"], frozen_before.to(torch.bfloat16))
    assert torch.equal(sd["counter"], torch.arange(4))
    fresh = _Net()
    fresh.load_state_dict({k: v.float() if v.is_floating_point() else v
                           for k, v in sd.items()})


def test_master_state_dict_of_another_model_is_refused():
    model = _Net()
    opt = ZeroOffloadOptimizer(model.parameters(), plugin=ZeroOffloadPlugin(compute_dtype="fp32"))
    with pytest.raises(ValueError, match="none of the optimizer's params"):
        opt.master_state_dict(_Net())


def test_weight_decay_default_is_torch_adamws():
    model = _Net()
    opt = ZeroOffloadOptimizer(model.parameters(), plugin=ZeroOffloadPlugin(compute_dtype="fp32"))
    ref = torch.optim.AdamW(_Net().parameters())
    assert opt.defaults["weight_decay"] == ref.defaults["weight_decay"] == 0.01


def test_a_stock_adamw_checkpoint_keeps_masters_the_params_round_to():
    """Resuming from a stock AdamW checkpoint (no "master" in its state): where the 16-bit
    param is the master rounded, the fp32 master stays (the Trainer loads the fp32 weights
    before building the engine); a param that differs (edited, or another run's) wins."""
    model = _Net()
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ZeroOffloadOptimizer(model.parameters(), lr=1e-2,
                               plugin=ZeroOffloadPlugin(compute_dtype="bf16"))
    ref = torch.optim.AdamW(_Net().parameters(), lr=1e-2)
    for p in ref.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    ref.step()
    sd = ref.state_dict()
    with torch.no_grad():
        model.b.bias.add_(1.0)  # another value than the master's rounding
    opt.load_state_dict(sd)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        master = opt.host_views(p)["master"].view_as(p)
        if name == "b.bias":
            assert torch.equal(master, p.detach().float())
        else:
            assert torch.equal(master, fp32[name]), name  # not the bf16 rounding of it


def test_a_checkpoint_of_another_model_or_param_order_changes_nothing():
    model = _Net()
    opt = ZeroOffloadOptimizer(model.parameters(), lr=1e-2,
                               plugin=ZeroOffloadPlugin(compute_dtype="fp32"))
    model(torch.randn(6, 7)).backward()
    opt.step()
    sd = opt.state_dict()
    before = {k: v.clone() for k, v in opt.host_views(model.a.weight).items()}
    swapped = dict(sd, state=dict(sd["state"]))
    swapped["state"][0], swapped["state"][2] = sd["state"][2], sd["state"][0]  # a.weight, b.weight
    with pytest.raises(ValueError, match="another model, or of the same model with its params "
                                         "in another order"):
        opt.load_state_dict(swapped)
    other = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    with pytest.raises(ValueError, match="param groups|params"):
        opt.load_state_dict(other.state_dict())
    for k, v in opt.host_views(model.a.weight).items():
        assert torch.equal(v, before[k]), k  # nothing changed


def _trained_bf16(steps=2, **plugin):
    model = _Net()
    opt = ZeroOffloadOptimizer(model.parameters(), lr=1e-2, plugin=ZeroOffloadPlugin(
        compute_dtype="bf16", **plugin))
    model.frozen.to(torch.bfloat16)
    for i in range(steps):
        model(torch.randn(6, 7, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i))
              ).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("delayed", [False, True])
def test_load_master_state_dict_is_master_state_dicts_inverse(delayed):
    """fp32 weights with bits a bf16 param lacks become the masters bit for bit, the params
    their rounding; moments and steps stay; entries of frozen params are the caller's."""
    kw = dict(delayed_update=delayed, delayed_update_warmup_steps=1)
    model, opt = _trained_bf16(**kw)
    twin, twin_opt = _trained_bf16(**kw)  # the same steps, landed: its moments are theirs
    twin_opt.flush()
    moments = {n: twin_opt.host_views(p)["exp_avg"] for n, p in twin.named_parameters()
               if p.requires_grad}
    g = torch.Generator().manual_seed(7)
    given = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    steps = dict(opt.param_steps)
    assert opt.update_in_flight == delayed
    frozen = model.frozen.weight.detach().clone()
    opt.load_master_state_dict(model, given)
    assert not opt.update_in_flight  # a pending update landed first, not over the loaded
    sd = opt.master_state_dict(model)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(sd[name], given[name]), name
            assert torch.equal(p.detach(), given[name].to(torch.bfloat16)), name
            assert torch.equal(opt.host_views(p)["exp_avg"], moments[name]), name
    assert opt.param_steps == steps
    assert torch.equal(model.frozen.weight, frozen)  # not the engine's to load
    opt.step()  # no gradient: nothing moves, and the loaded params are no edit to adopt
    sd = opt.master_state_dict(model)
    assert all(torch.equal(sd[n], given[n]) for n in moments)


def test_load_master_state_dict_refuses_a_wrong_shape_before_writing():
    model, opt = _trained_bf16()
    before = opt.master_state_dict(model)
    bad = {"a.weight": torch.zeros(5, 7), "b.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=r"^master weights for 'b.weight': got \(2, 2\), "
                                         r"the param has shape \(3, 5\)"):
        opt.load_master_state_dict(model, bad)
    after = opt.master_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_close_removes_the_hooks_and_the_host_state():
    """A second engine over the same params after close() gets every gradient, and the
    first one raises rather than step over nothing."""
    model, opt = _trained_bf16()
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in params)
    opt.close()
    assert all(len(p._post_accumulate_grad_hooks) == 0 for p in params)
    assert opt.buckets == [] and opt.host_pool is None
    opt.close()  # twice is fine
    for call in (opt.step, opt.zero_grad, opt.state_dict):
        with pytest.raises(RuntimeError, match=r"^this ZeroOffloadOptimizer was closed"):
            call()
    second = ZeroOffloadOptimizer(params, lr=1e-2, plugin=ZeroOffloadPlugin(
        compute_dtype="bf16"))
    model(torch.randn(6, 7, dtype=torch.bfloat16)).backward()
    assert all(p.grad is None for p in params)  # the new engine took them all
    second.step()
    assert second.applied_steps == 1 and second.grad_norm > 0
