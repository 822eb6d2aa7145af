"""scripts/bench/_placement.py: restripe moves a benchmark's buffers to new memory in place,
keeping their values, every reference (a param, its grad, an optimizer's state) seeing the new
storage; views are refused before anything moves."""

import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = str(Path(__file__).resolve().parents[2] / "scripts" / "bench")
sys.path.insert(0, SCRIPTS)
try:
    import _placement as pl
finally:
    sys.path.remove(SCRIPTS)

STRIPE = 4096


def test_moves_large_buffers_keeping_values_and_references():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(10_000, generator=gen)  # 40 000 B: ten stripes
    b = torch.randint(0, 255, (3 * STRIPE + 7,), dtype=torch.uint8, generator=gen)
    small = torch.randn(100, generator=gen)  # under a stripe: left where it is
    param = torch.nn.Parameter(torch.randn(2000, 3, generator=gen))
    param.grad = torch.randn(2000, 3, generator=gen)
    state = {"exp_avg": torch.randn(5000, dtype=torch.bfloat16, generator=gen)}
    want = [t.clone() for t in (a, b, small, param.detach(), param.grad, state["exp_avg"])]
    ptrs = [t.data_ptr() for t in (a, b, small, param, param.grad, state["exp_avg"])]
    alias = a  # another reference to the same tensor object
    moved = pl.restripe([a, b, small, param, param.grad, state["exp_avg"], a], stripe=STRIPE)
    assert moved == 5  # a listed twice, small skipped
    now = [a, b, small, param.detach(), param.grad, state["exp_avg"]]
    for got, exp in zip(now, want):
        assert torch.equal(got, exp)
    new_ptrs = [t.data_ptr() for t in (a, b, small, param, param.grad, state["exp_avg"])]
    assert new_ptrs[2] == ptrs[2]
    assert all(n != o for i, (n, o) in enumerate(zip(new_ptrs, ptrs)) if i != 2)
    assert alias.data_ptr() == a.data_ptr()
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    a.add_(1.0)  # the moved storage is the tensor's own, writable
    assert torch.equal(alias, want[0] + 1.0)


def test_refuses_two_tensors_over_one_storage():
    a = torch.randn(4 * STRIPE)
    same = a.view(a.shape)  # a second object: moving a alone would leave it behind
    ptr = a.data_ptr()
    with pytest.raises(ValueError, match="share one storage"):
        pl.restripe([a, same], stripe=STRIPE)
    assert a.data_ptr() == ptr == same.data_ptr()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4 * STRIPE)[STRIPE:],         # offset into a larger storage
    lambda: torch.randn(2 * STRIPE, 4)[:, :2],        # not contiguous
    lambda: torch.randn(4 * STRIPE)[: 2 * STRIPE],    # a prefix of a larger storage
])
def test_refuses_views_before_moving_anything(make):
    first = torch.randn(4 * STRIPE)
    ptr = first.data_ptr()
    with pytest.raises(ValueError, match="view or not contiguous"):
        pl.restripe([first, make()], stripe=STRIPE)
    assert first.data_ptr() == ptr  # nothing moved


def test_refuses_a_stripe_that_is_not_positive():
    with pytest.raises(ValueError, match="positive byte count"):
        pl.restripe([torch.randn(10)], stripe=0)
