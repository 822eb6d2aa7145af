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
