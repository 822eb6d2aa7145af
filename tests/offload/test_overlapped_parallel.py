"""The overlapped schedule with data parallel and tensor parallel ranks (2 gloo ranks, as
the other parallel tests run): bitwise the synchronous schedule where speculation holds
(each rank updates its own shard early; the publish's all-gather and the stats'
all-reduce stay on the caller's thread, in order), and the correction on every rank where
the global norm clips or one rank overflows."""

from __future__ import annotations

import pytest
import torch

from tests.offload import _dp_worker as dpw

WORKER = "tests.offload._overlap_worker:runs"
BF16 = {"compute_dtype": "bf16"}
OV = {"compute_dtype": "bf16", "overlap_step": True}
FP16 = {"compute_dtype": "fp16", "init_scale": 2.0**10, "hysteresis": 1}


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    jobs = [("dp", dict(plugin=BF16)), ("dp", dict(plugin=OV)),
            ("dp", dict(plugin=BF16, clip=1e-3)), ("dp", dict(plugin=OV, clip=1e-3)),
            ("dp", dict(plugin=FP16, poison=[(2, 1)])),
            ("dp", dict(plugin={**FP16, "overlap_step": True}, poison=[(2, 1)])),
            ("tp", dict(plugin=BF16)), ("tp", dict(plugin=OV))]
    codes, _, res, errs = dpw.spawn(WORKER, str(tmp_path_factory.mktemp("ov")), jobs=jobs,
                                    wait_s=400)
    assert codes == [0, 0], errs
    return res


def _bitwise(a, b):
    assert a["trace"] == b["trace"]
    assert all(torch.equal(x, y) for x, y in zip(a["host"], b["host"]))


@pytest.mark.parametrize("i", [0, 6], ids=["data-parallel", "tensor-parallel"])
def test_bitwise_where_speculation_holds(dp_runs, i):
    for rank in range(2):
        sync, ov = dp_runs[rank][i], dp_runs[rank][i + 1]
        _bitwise(ov, sync)
        assert ov["stats"]["hits"] == ov["stats"]["speculated"] == 4
    m0 = dp_runs[0][i + 1]["masters"]
    assert all(torch.equal(m0[k], v) for k, v in dp_runs[0][i]["masters"].items())


def test_data_parallel_clipping_is_corrected_on_every_rank(dp_runs):
    for rank in range(2):
        sync, ov = dp_runs[rank][2], dp_runs[rank][3]
        for (la, na, sa), (lb, nb, sb) in zip(ov["trace"], sync["trace"]):
            assert la == pytest.approx(lb, rel=1e-4) and na == pytest.approx(nb, rel=1e-3)
            assert sa == sb
        assert ov["stats"]["hits"] == 0 and ov["stats"]["speculated"] >= 1


def test_an_overflow_on_one_rank_skips_on_both(dp_runs):
    for rank in range(2):
        sync, ov = dp_runs[rank][4], dp_runs[rank][5]
        assert [t[2] for t in ov["trace"]] == [t[2] for t in sync["trace"]] == \
            [False, False, True, False]
        for (la, *_), (lb, *_) in zip(ov["trace"], sync["trace"]):
            assert la == pytest.approx(lb, rel=1e-4)
