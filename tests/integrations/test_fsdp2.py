"""`prepare_zero_offload` over a model sharded by ``fully_shard`` with ``CPUOffloadPolicy``
(one gloo rank in this process). accelerate 1.15 applies its FSDP plugin only on GPU
processes (``DistributedType.FSDP`` comes from the MULTI_GPU-like types; on CPUs the plugin
is not used), so on CPUs the model is sharded by hand, as here."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from hf_zoffload import prepare_zero_offload
from hf_zoffload.offload.fsdp2 import Fsdp2Exchange
from tests.offload import _fsdp2_worker as w
from tests.offload.test_fsdp2 import _close_every_step, one_rank, reference


@pytest.fixture
def accelerator(torch_one_thread):
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with one_rank():
        yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_prepare_zero_offload_trains_an_fsdp2_model_like_adamw(accelerator):
    """fp32 (accelerate's mixed_precision "no"), 4 steps of 2 micro-steps, clipping through
    ``accelerator.clip_grad_norm_``; the saved weights are the whole fp32 masters."""
    model = w.shard(w.Net(), 1)
    opt = torch.optim.AdamW(w.decay_groups(model), lr=w.LR)
    model, opt = prepare_zero_offload(accelerator, model, opt)
    assert isinstance(opt.optimizer.exchange, Fsdp2Exchange)
    data, got = w.batches(4), {"params": [], "norms": []}
    for step in range(4):
        for micro in range(w.ACCUM):
            accelerator.backward(model(data[step * w.ACCUM + micro]) / w.ACCUM)
        got["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(),
                                                              w.MAX_NORM)))
        opt.step()
        opt.zero_grad()
        got["params"].append(w.full_params(model))
    _close_every_step(got, reference(4))
    saved = accelerator.get_state_dict(model)
    names = [n for n, _ in model.named_parameters()]
    assert list(saved) == names
    for n, p in zip(names, got["params"][-1]):
        assert type(saved[n]) is torch.Tensor and torch.equal(saved[n], p)


def test_prepare_zero_offload_refuses_fsdp2_without_cpu_offload(accelerator):
    model = w.shard(w.Net(), 1, offload=False)
    opt = torch.optim.AdamW(w.decay_groups(model), lr=w.LR)
    with pytest.raises(ValueError, match="FSDP2 without CPU offload"):
        prepare_zero_offload(accelerator, model, opt)
    assert all(p.dtype == torch.float32 for p in model.parameters())
