"""Reentrant activation checkpointing runs a nested backward per checkpointed block. The
engine must still end each backward once (flush partial buckets once, reduce once), so the
result and the bytes sent are those of non-reentrant checkpointing."""

import pytest
import torch

from tests.offload import _dp_worker as w


@pytest.mark.parametrize("reentrant", [True, False])
def test_one_backward_end_per_backward(reentrant):
    r = w.checkpointed(0, 1, reentrant=reentrant)
    assert r["calls_per_backward"] == 1.0 and r["max_landed"] == 1


def test_reentrant_equals_non_reentrant_one_process():
    a, b = (w.checkpointed(0, 1, reentrant=x) for x in (True, False))
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.slow
def test_reentrant_equals_non_reentrant_two_ranks(tmp_path):
    jobs = [("checkpointed", {"reentrant": True}), ("checkpointed", {"reentrant": False})]
    codes, _, res, errs = w.spawn("runs", str(tmp_path), jobs=jobs)
    assert codes == [0, 0], errs
    for rank in res:
        reent, plain = rank
        assert reent["calls_per_backward"] == plain["calls_per_backward"] == 1.0
        assert reent["sent"] == plain["sent"] and plain["sent"]["reduce_scatter"] > 0
        assert all(torch.equal(x, y) for x, y in zip(reent["params"], plain["params"]))

