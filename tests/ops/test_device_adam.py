"""The device update (torch's fused AdamW, ops/device_adam.py) against the torch reference the
CPU-Adam is held to (cpu_adam.adam_update_reference), on odd sizes and every grad / output
dtype, over several steps.

Tolerance: the fused kernel computes the same fp32 formulas as torch's single-tensor AdamW but
in its own order (it divides by sqrt(bc2) where the reference multiplies by 1 / sqrt(bc2),
fuses the lerp differently): a few ulps of the update per step, the bound of
tests/ops/test_adam_kernels.py (2e-6 lr per step + 1e-6 relative per step) with room to spare; a
lost grad_scale or weight decay is off by ~lr per step, 1000x more.
"""

import pytest
import torch

from hf_zoffload.ops.adam_kernels import adam_update_reference
from hf_zoffload.ops.device_adam import adam_update_device

SIZES = [1, 7, 257, 4099]
LR, STEPS = 2e-3, 5


def _state(n, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = m * m * (1 + torch.rand(n, generator=gen))
    return [p, m, v]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_the_reference_over_steps(n, dtype, weight_decay):
    ours, ref = _state(n, 0), _state(n, 0)
    out_ours = torch.empty(n, dtype=dtype) if dtype != torch.float32 else None
    out_ref = torch.empty(n, dtype=dtype) if dtype != torch.float32 else None
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        g = (torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-4, 1, generator=gen)
             ).to(dtype)
        kw = dict(step=step + 2, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=weight_decay, grad_scale=0.37)
        before = g.clone()
        adam_update_device([ours[0]], [g], [ours[1]], [ours[2]], outs=[out_ours], **kw)
        adam_update_reference(ref[0], g, ref[1], ref[2], out16=out_ref, **kw)
        assert torch.equal(g, before)  # the grad is read, never written
    torch.testing.assert_close(ours[0], ref[0], atol=2e-6 * LR * STEPS, rtol=1e-6 * STEPS)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours[2], ref[2], atol=1e-8, rtol=1e-5)
    if out_ours is not None:  # the 16-bit params are the master rounded
        assert torch.equal(out_ours, ours[0].to(dtype))


def test_grad_scale_and_step_are_applied():
    """A dropped grad_scale or a step count read as 0 would not be caught by equal inputs."""
    a, b = _state(64, 3), _state(64, 3)
    g = torch.randn(64)
    adam_update_device([a[0]], [g], [a[1]], [a[2]], step=1, lr=LR, beta1=0.9, beta2=0.999,
                       eps=1e-8, weight_decay=0.0, grad_scale=0.5)
    adam_update_reference(b[0], g * 0.5, b[1], b[2], step=1, lr=LR, beta1=0.9, beta2=0.999,
                          eps=1e-8, weight_decay=0.0)
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(a[0], b[0], atol=2e-6 * LR, rtol=1e-6)
    assert torch.isfinite(a[0]).all()


def test_a_list_is_each_tensor_on_its_own():
    """Several tensors in one call (one launch on CUDA) update as one call each; empty ones
    and None outputs are skipped."""
    sizes = [5, 0, 300, 17]
    one = [_state(n, i) for i, n in enumerate(sizes)]
    many = [[t.clone() for t in st] for st in one]
    grads = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    outs[3] = None
    kw = dict(step=4, lr=LR, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_scale=2.0)
    adam_update_device(*[[st[k] for st in many] for k in range(1)], grads,
                       *[[st[k] for st in many] for k in (1, 2)], outs=outs, **kw)
    for st, g, o in zip(one, grads, outs):
        single = torch.empty_like(o) if o is not None else None
        adam_update_device([st[0]], [g], [st[1]], [st[2]], outs=[single], **kw)
        if o is not None:
            assert torch.equal(single, o)
    for st, st2 in zip(one, many):
        for a, b in zip(st, st2):
            assert torch.equal(a, b)
