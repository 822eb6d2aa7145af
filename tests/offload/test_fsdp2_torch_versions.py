"""The engine's FSDP2 mode on the torch versions it meets (offload/modes/fsdp2_offload.py):
torch 2.11's FSDP2 records (one param group per module state) beside 2.13's (a list), and 2.11's
non-blocking copy of each gradient shard to the host, which the engine's grad hook must wait
for ([Note: FSDP2's grad copy to the host]). A CPU has no pinned copy in flight, so a stub
event stands in for it: the gradient's pages hold NaN until the event is waited for, as a
recycled pinned block would hold stale values."""

import types

import torch

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.offload.modes.fsdp2_offload import fsdp2_param_groups, fsdp2_params, fsdp2_states
from tests.offload import _fsdp2_worker as w
from tests.offload._dp_worker import one_rank


def test_param_groups_in_both_torch_layouts():
    a, b, c = object(), object(), object()
    # torch 2.13: a list; its singular property raises beside several groups, so it is not read
    assert fsdp2_param_groups(types.SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    # torch 2.11: one group, or None for a module without params of its own
    assert fsdp2_param_groups(types.SimpleNamespace(_fsdp_param_group=c)) == [c]
    assert fsdp2_param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []


def test_every_sharded_param_is_found_on_the_installed_torch(torch_one_thread):
    with one_rank():
        model = w.shard(w.Net(), 1)
        found = fsdp2_params(fsdp2_states(model))
        assert {id(p) for p in model.parameters()} == set(found)
        assert all(found[id(p)].sharded_param is p for p in model.parameters())


class InFlight:
    """torch 2.11's ``grad_offload_event`` for a copy not finished yet: the gradient holds
    NaN until ``synchronize`` lands the real values (idempotent: FSDP2's
    ``finalize_backward`` waits for it again)."""

    def __init__(self, local: torch.Tensor, log: list, name: str):
        self.local, self.values, self.log, self.name = local, local.clone(), log, name
        local.fill_(float("nan"))
        self.done = False

    def synchronize(self):
        if not self.done:
            self.local.copy_(self.values)
            self.done = True
            self.log.append(("wait", self.name))


def _step(stub: bool):
    """One engine step on the one-rank FSDP2 net; ``stub``: every gradient's copy is in
    flight when the hooks run (a hook registered before the engine's runs first and
    plays FSDP2 2.11's part). Returns the new params and the order of hooks and waits."""
    log: list = []
    with one_rank():
        model = w.shard(w.Net(), 1)
        records = fsdp2_params(fsdp2_states(model))
        names = {id(p): n for n, p in model.named_parameters()}
        if stub:
            def in_flight(p):
                records[id(p)].grad_offload_event = InFlight(p.grad._local_tensor, log,
                                                             names[id(p)])
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(in_flight)
        opt = ZeroOffloadOptimizer(w.decay_groups(model), lr=w.LR, model=model,
                                   plugin=ZeroOffloadPlugin(bucket_size_mb=0.01))
        hook = type(opt)._grad_hook

        def noted(self, p):  # the engine's hook, noting when it starts
            log.append(("hook", names[id(p)]))
            return hook(self, p)
        opt._grad_hook = types.MethodType(noted, opt)
        model(w.batches(1)[0]).backward()
        opt.step()
        new = [p.full_tensor().detach().clone() for p in model.parameters()]
        opt.close()
    return new, log


def test_the_grad_hook_waits_for_fsdp2s_copy_before_reading(torch_one_thread):
    want, _ = _step(stub=False)
    got, log = _step(stub=True)
    n = len(want)
    # the step equals the one without a copy in flight, bit for bit (a read before the wait
    # takes NaN); each param's copy is waited for inside the engine's hook, before the next
    # param's hook
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    hooks = [name for what, name in log if what == "hook"]
    assert len(hooks) == n and log == [x for h in hooks for x in (("hook", h), ("wait", h))]
