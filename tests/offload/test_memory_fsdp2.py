"""`memory.estimate_fsdp2` (what `hf-zoffload estimate --fsdp2_offload` prints) against the
engine's `memory_report()` over FSDP2's sharded host params (tests/offload/_fsdp2_worker.py's
net): one gloo rank in this process, two spawned (slow)."""

import pytest

from hf_zoffload.offload.memory import device_bytes_fsdp2, estimate_fsdp2
from tests.offload import _dp_worker as dpw
from tests.offload import _fsdp2_worker as w
from tests.offload._dp_worker import one_rank
from tests.offload.test_fsdp2 import RUNS

BUCKET_MB = 0.01  # the worker's: 5,242 16-bit elements a bucket


def _estimate(n: int, plugin: dict, **kw) -> dict:
    return estimate_fsdp2(n, root_params=0, largest_group=0, bucket_size_mb=BUCKET_MB,
                          compute_dtype=plugin["compute_dtype"],
                          state_dtype=plugin.get("state_dtype", "fp32"),
                          master_dtype=plugin.get("master_dtype", "fp32"), **kw)


def _slack(opt, plugin: dict, n_params: int) -> int:
    """What the engine holds beyond the estimate, the design's alignments: the pool rounds
    each bucket's landing buffer up to 64 B (host.py); int8 starts every param on a block of
    256 elements (up to 255 more of master, codes and grad per param, docs/design.md,
    "Compact moments")."""
    slack = 64 * len(opt.buckets)
    if plugin.get("state_dtype") == "int8":
        slack += 255 * n_params * (4 + 2 + opt.dtype.itemsize)
    return slack


@pytest.mark.parametrize("plugin", [
    {"compute_dtype": "bf16"},
    {"compute_dtype": "bf16", "master_dtype": "bf16", "state_dtype": "bf16"},
    {"compute_dtype": "fp32", "state_dtype": "bf16"},
    {"compute_dtype": "fp16", "state_dtype": "int8"},
], ids=["bf16", "bf16-master", "fp32", "fp16-int8"])
def test_one_rank_host_bytes_equal_memory_report(plugin, torch_one_thread):
    """After a step: FSDP2's sharded params (the compute dtype), master, moments and the
    landing buffer, kind by kind; the total within the pool's 64-byte rounding (int8: and
    its block alignment)."""
    with one_rank():
        model, opt = w.build(1, plugin=plugin)
        opt.backward(model(w.batches(1)[0]))
        opt.step()
        opt.zero_grad()
        got = opt.memory_report()
        n = sum(p.numel() for p in model.parameters())
        est = _estimate(n, plugin)
    assert got["host"].keys() == est["host"].keys()
    exact = ["params", "grad_accumulation"] + (
        [] if plugin.get("state_dtype") == "int8" else ["master", "exp_avg", "exp_avg_sq"])
    for kind in exact:
        assert got["host"][kind] == est["host"][kind], kind
    extra = got["host_total"] - est["host_total"]
    assert 0 <= extra <= _slack(opt, plugin, len(list(model.parameters()))), extra
    # the bf16 master is a buffer of its own beside FSDP2's bf16 shard: 2 + 2, not 2
    masters = {"fp32": 4, "bf16": 2}[plugin.get("master_dtype", "fp32")]
    if plugin.get("state_dtype") != "int8":
        assert est["host"]["master"] == masters * n
    assert est["host"]["params"] == opt.dtype.itemsize * n


def test_one_rank_accumulation_sums_on_the_host(torch_one_thread):
    """Two micro-steps a step, FSDP2 reducing each (as the integrations run it: accelerate in
    data-parallel mode, whose ``no_sync`` leaves an FSDPModule alone): the host holds the
    engine's fp32 sum, what the estimate with ``grad_accumulation`` says, and the device
    nothing more than without it."""
    plugin = {"compute_dtype": "fp32"}
    with one_rank():
        model, opt = w.build(1, plugin=plugin)
        for batch in w.batches(2):  # the second backward adds to the first: the sum is held
            opt.backward(model(batch))
        got = opt.memory_report()
        n = sum(p.numel() for p in model.parameters())
    est = _estimate(n, plugin, grad_accumulation=True)
    assert got["host"]["grad_accumulation"] == est["host"]["grad_accumulation"] == 4 * n
    buckets = len(list(w.Net().parameters()))  # at most one bucket per param
    assert 0 <= got["host_total"] - est["host_total"] <= 64 * buckets
    without = _estimate(n, plugin)
    assert without["device"] == est["device"]
    assert without["host"]["grad_accumulation"] == 0


def test_device_bytes_by_hand():
    """Llama-2-7B's groups in bf16: the root (embeddings, head, final norm) gathered all step
    and two 202.4M-param layers at a time, their grads and the root's, and the largest
    reduce-scatter output, the root's at the end of backward (1/N of it with N ranks)."""
    root, layer = 262_148_096, 202_383_360
    got = device_bytes_fsdp2(root, layer, param_bytes=2, world_size=2)
    assert got == {"gathered_root": 2 * root, "gathered_groups": 4 * layer,
                   "unsharded_grads": 2 * (root + 2 * layer), "reduced_grads": root}
    assert sum(got.values()) == 2_929_807_360  # 2.73 GiB, where the whole model's bf16
    # params are 12.55 GiB
    # a root larger than two groups (a large vocabulary over small layers): its own
    # reduce-scatter input at the end of backward is the larger
    assert device_bytes_fsdp2(100, 10, param_bytes=2)["unsharded_grads"] == 2 * (100 + 100)


def test_refuses_what_cannot_hold_the_params():
    with pytest.raises(ValueError, match="root_params 20 and largest_group 0 must be"):
        estimate_fsdp2(10, root_params=20, largest_group=0)
    with pytest.raises(ValueError, match="holds fewer than the 10 params"):
        estimate_fsdp2(10, root_params=0, largest_group=0, local_params=4, world_size=2)


@pytest.mark.slow
def test_two_ranks_host_bytes_equal_memory_report(tmp_path):
    """bf16 compute, 2 ranks, a step of two micro-steps: rank 0 holds FSDP2's padded shards
    (dim 0 rounded up to the ranks), which the estimate takes as ``local_params``; the host
    figures after the step (the accumulation sum released) as with one rank."""
    plugin = {"compute_dtype": "bf16"}
    jobs = [("train", {"plugin": plugin, "stop": 1})]
    codes, _, res, errs = dpw.spawn(RUNS, str(tmp_path), jobs=jobs, wait_s=300)
    assert codes == [0, 0], "\n".join(errs)
    net = w.Net()
    n = sum(p.numel() for p in net.parameters())
    local = sum(-(-p.shape[0] // 2) * p[0].numel() for p in net.parameters())
    est = _estimate(n, plugin, local_params=local, world_size=2)
    got = res[0][0]
    assert got["local"] == local
    assert got["report"]["host"]["params"] == est["host"]["params"] == 2 * local
    assert got["report"]["host"]["master"] == est["host"]["master"] == 4 * local
    assert 0 <= got["report"]["host_total"] - est["host_total"] <= 64 * len(list(net.parameters()))


def test_pinned_shards_are_counted_as_torchs_pinned_allocator_holds_them():
    """FSDP2 pins each param's shard on its own (CPUOffloadPolicy's default on a GPU
    machine): a power of two each; unpinned, the bytes themselves."""
    shards = [11008 * 4096, 4096 * 4096, 4096]  # Llama-2-7B's MLP and attention, a norm
    pinned = estimate_fsdp2(sum(shards), root_params=0, largest_group=0, shard_numels=shards,
                            pinned=True)["host"]["params"]
    assert pinned == 2**27 + 2**25 + 2**13  # 86 MiB in a 128 MiB block
    assert estimate_fsdp2(sum(shards), root_params=0, largest_group=0, shard_numels=shards
                          )["host"]["params"] == 2 * sum(shards)
