"""Data-parallel ZeRO-Offload: 2 gloo ranks on the CPU against 1 process.

Starting a rank costs ~5 s (imports) on 2 cores, so each spawn runs several trainings
(tests/offload/_dp_worker.py) and module-scoped fixtures share them between tests."""

import contextlib
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.offload.modes.collectives import wants_sync
from hf_zoffload.offload.modes.exchange import LocalExchange
from hf_zoffload.offload.modes.partitioned import PartitionedExchange
from hf_zoffload.offload.support import check_model
from tests.offload import _dp_worker as w

# fp32 compute: 2 ranks average two half-batch gradients where 1 process takes the mean over
# the full batch; that differs by a rounding or two per step, fed back through 10 steps of
# training (measured: 1.2e-7 max). A lost or doubled gradient is off by > 1e-3.
ATOL, RTOL = 1e-5, 1e-4
FP32 = {"compute_dtype": "fp32"}
BF16 = {"compute_dtype": "bf16"}
DPU = {"compute_dtype": "fp32", "delayed_update": True, "delayed_update_warmup_steps": 3}
INT8 = {"compute_dtype": "fp32", "state_dtype": "int8"}
# The bf16 master and 4-bit moments, each rank fed the whole batch (`_dp_worker.train`'s
# full_batch) so that the ranks' averaged gradient is the one-process one bit for bit, and
# clipping a no-op (its coefficient is 1.0 exactly under max_norm; the norm's float64 sum
# over shards runs in another order than one process's): what is left to differ is the
# update, which docs/design.md promises to be bitwise the same for any rank count.
SAME = {"full_batch": True, "max_norm": 1e6}
M16_INT4 = {"compute_dtype": "bf16", "master_dtype": "bf16", "state_dtype": "int4"}
INT4 = {"compute_dtype": "fp32", "state_dtype": "int4"}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("two")
    ckpt, ckpt16 = str(d / "ckpt_2ranks.pt"), str(d / "ckpt_2ranks_m16_int4.pt")
    jobs = [("train", {"save_at": 5, "save": ckpt}), ("train", {"plugin": BF16}),
            ("train", {"plugin": DPU}), ("overflow", {}), ("train", {"plugin": INT8}),
            ("train", {"plugin": M16_INT4, "save_at": 5, "save": ckpt16, **SAME}),
            ("train", {"plugin": INT4, **SAME})]
    codes, _, res, errs = w.spawn("runs", str(d), jobs=jobs)
    assert codes == [0, 0], "\n".join(errs)
    return dict(zip(["fp32", "bf16", "dpu", "overflow", "int8", "m16_int4", "int4"], zip(*res)),
                ckpt=ckpt, ckpt16=ckpt16)


@contextlib.contextmanager
def _threads(n: int):
    """torch's thread count for a one-process run compared bitwise with the ranks', which
    run on one thread each (`_dp_worker._entry`): a matmul's blocking may follow it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("one") / "ckpt_1rank.pt")
    with _threads(1):
        same = {"m16_int4": w.train(0, 1, plugin=M16_INT4, **SAME),
                "int4": w.train(0, 1, plugin=INT4, **SAME)}
    return {"fp32": w.train(0, 1, save_at=5, save=ckpt), "bf16": w.train(0, 1, plugin=BF16),
            "dpu": w.train(0, 1, plugin=DPU), "int8": w.train(0, 1, plugin=INT8), "ckpt": ckpt,
            **same}


def _close(a, b, atol=ATOL, rtol=RTOL):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def _mean_losses(r0, r1):
    return [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp32", "dpu"])
def test_two_ranks_equal_one_rank(two, one, kind):
    """10 steps, 2 micro-steps each (all three boundary styles), clipping, a param with a
    grad on one rank only, a frozen layer; delayed update too."""
    r0, r1 = two[kind]
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)  # every rank ends each step with identical params
    _close(r0["params"], one[kind]["params"])
    torch.testing.assert_close(_mean_losses(r0, r1), one[kind]["losses"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(r0["norms"], one[kind]["norms"], atol=ATOL, rtol=RTOL)
    assert max(one[kind]["norms"]) > w.MAX_NORM  # clipping was active


@pytest.mark.slow
def test_the_ranks_adopt_the_first_ranks_arrival_order(two, one):
    """After the first step the buckets follow the first backward's gradient order (rank
    0's: rank 1's first backward has no grad for ``extra``, which rank 0 uses), the same
    on every rank; the runs above show the state moved between ranks exactly."""
    guess = w.build(**FP32)[1].bucket_order  # the model's param order, reversed
    for kind in ("fp32", "dpu", "int8"):
        r0, r1 = two[kind]
        assert r0["bucket_order"] == r1["bucket_order"] == one[kind]["bucket_order"] != guess


@pytest.mark.slow
def test_bf16_two_ranks_track_one_rank(two, one):
    # 2 ranks average bf16 grads in bf16 (the reduce-scatter), so the runs part by bf16
    # roundings from the first step and Adam amplifies that for tiny grads: compare each
    # param's mean distance with its mean update (measured: 0.4% at most; a lost gradient
    # or a misplaced shard is ~100%).
    r0, r1 = two["bf16"]
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    init = list(w.Model().parameters())
    for a, b, c in zip(r0["params"], one["bf16"]["params"], init):
        a, b, c = a.float(), b.float(), c.float()
        assert (a - b).abs().mean() <= 0.02 * (b - c).abs().mean()


@pytest.mark.slow
def test_int8_moments_two_ranks_track_one_rank(two, one):
    """8-bit moments with 2 ranks: every param and shard starts on a 256-element block
    (layout.py), so each rank encodes whole blocks of its own. 2 ranks average where 1
    process takes the full-batch mean (a rounding apart, as in fp32), and a code may then
    round the other way: compare each param's mean distance with its mean update. Measured:
    2.6e-7 at most; one code rounded the other way moves one element's update by one code
    step (12%) for a few steps, ~1e-4 of the mean update of a 1000-element param; a
    misplaced block or scale is ~100%."""
    r0, r1 = two["int8"]
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    init = list(w.Model().parameters())
    worst = 0.0
    for a, b, c in zip(r0["params"], one["int8"]["params"], init):
        a, b, c = a.float(), b.float(), c.float()
        worst = max(worst, float((a - b).abs().mean() / (b - c).abs().mean()))
    assert worst <= 1e-3
    host2, host1 = r0["memory"]["host"], one["int8"]["memory"]["host"]
    assert host2["exp_avg"] < 0.75 * host1["exp_avg"]  # each rank holds about half


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["m16_int4", "int4"])
def test_bf16_master_and_int4_moments_two_ranks_equal_one_rank_bitwise(two, one, kind):
    """bf16 master with 4-bit moments (bf16 compute), and 4-bit moments with an fp32 master:
    2 ranks end bit for bit where one process does, given the same gradients. A shard's
    stochastic rounding keys each element by its index in the param (a shard's first
    element passes its own), and shards start on 128-element blocks of the param's layout,
    so each rank rounds and encodes exactly the elements one process does. A shard keyed
    from its own element 0 instead (each call's first index 0) fails this: measured, the
    losses and 10 of the 11 trained params end different."""
    r0, r1 = two[kind]
    ref = one[kind]
    assert r0["losses"] == r1["losses"] == ref["losses"]
    for a, b, c in zip(r0["params"], r1["params"], ref["params"], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    for name, t in ref["masters"].items():
        assert torch.equal(r0["masters"][name], t), name
    host2, host1 = r0["memory"]["host"], ref["memory"]["host"]
    for key in ("master", "exp_avg", "exp_avg_sq"):  # about half: one block of padding each
        assert host1[key] / 2 <= host2[key] < 0.75 * host1[key], key


@pytest.mark.slow
def test_a_two_rank_bf16_master_checkpoint_resumes_bitwise_in_one_process(two, one):
    """Saved at step 5 by 2 ranks (bf16 master, 4-bit moments), resumed in one process: the
    seed, each param's step, the master as fp32 and the decoded moments re-encoded continue
    the uninterrupted one-process run bit for bit."""
    sd = torch.load(two["ckpt16"], weights_only=True)["opt"]
    assert sd["zero_offload"]["world_size"] == 2 and "sr_seed" in sd["zero_offload"]
    with _threads(1):
        resumed = w.train(0, 1, start=5, load=two["ckpt16"], plugin=M16_INT4, **SAME)
    assert resumed["losses"] == one["m16_int4"]["losses"][5:]
    for a, b in zip(resumed["params"], one["m16_int4"]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_master_state_dict_gathers_the_sharded_masters_onto_rank0(two, one):
    r0, r1 = two["bf16"]
    assert r1["masters"] is None
    m2, m1 = r0["masters"], one["bf16"]["masters"]
    names = [n for n, _ in w.Model().named_parameters()]
    assert list(m2) == list(m1) and set(names) <= set(m2)
    for name, p in zip(names, r0["params"]):
        if name.startswith("frozen."):  # not trained: the model's own bf16 values
            assert m2[name].dtype == torch.bfloat16 and torch.equal(m2[name], p)
            continue
        assert m2[name].dtype == torch.float32 and m2[name].shape == p.shape
        # every rank's shard, in place: rounding the masters gives the params bit for bit
        assert torch.equal(m2[name].to(torch.bfloat16), p), name
        torch.testing.assert_close(m2[name], m1[name], atol=0.05, rtol=0.05)


@pytest.mark.slow
def test_no_collective_on_non_boundary_micro_steps(two):
    r0, _ = two["fp32"]
    assert r0["no_sync_bytes"] == 0 and r0["sent"]["reduce_scatter"] > 0


@pytest.mark.slow
def test_memory_report_per_rank_is_half(two, one):
    host2, host1 = two["fp32"][0]["memory"]["host"], one["fp32"]["memory"]["host"]
    for key in ("master", "exp_avg", "exp_avg_sq", "grad_staging"):
        # half, plus at most one padding element (4 B) per bucket
        assert host1[key] / 2 <= host2[key] <= host1[key] / 2 + 4 * 40, key
    assert two["fp32"][0]["memory"]["device"]["params"] >= one["fp32"]["memory"]["device"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["fp32", "bf16", "dpu"])
def test_accumulation_buffers_are_what_the_report_counts_ahead(two, run):
    # the unreduced whole buckets and their fp32 sum; bf16 also an fp32 landing per shard
    for r in two[run]:
        kinds = {k[0] for k in r["acc_need"]}
        assert kinds == ({"unreduced16", "unreduced32", "grad32"} if run == "bf16"
                         else {"unreduced16", "unreduced32"}), kinds
        assert {k: r["held"][k] for k in r["acc_need"]} == r["acc_need"]


@pytest.mark.slow
def test_overflow_on_one_rank_skips_on_all_and_rank0_params_win(two):
    r0, r1 = two["overflow"]
    for a, b in zip(r0["start"], r1["start"]):
        assert torch.equal(a, b)  # rank 1 built its model differently: rank 0's values win
    assert r0["skipped"] == r1["skipped"] == [False, False, True, False]
    assert r0["scale"] == r1["scale"] == 2.0**9
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_checkpoints_reshard(two, one, tmp_path):
    """Saved with 2 ranks, resumed with 2 and with 1; saved with 1, resumed with 2: the
    losses continue as in the uninterrupted runs."""
    sd = torch.load(two["ckpt"], weights_only=True)["opt"]
    assert sd["zero_offload"]["world_size"] == 2 and "shell_of_rank" not in sd["zero_offload"]
    n_trainable = sum(p.requires_grad for p in w.Model().parameters())
    assert len(sd["state"]) == n_trainable  # the whole state, gathered on rank 0
    jobs = [("train", {"start": 5, "load": two["ckpt"]}),
            ("train", {"start": 5, "load": one["ckpt"]})]
    codes, _, res, errs = w.spawn("runs", str(tmp_path), jobs=jobs)
    assert codes == [0, 0], "\n".join(errs)
    (two_two, one_two), (two_two_r1, one_two_r1) = res
    full2 = two["fp32"]
    # 2 -> 2: the same computation as without the interruption
    torch.testing.assert_close(two_two["losses"], full2[0]["losses"][5:], atol=1e-6, rtol=0)
    torch.testing.assert_close(two_two_r1["losses"], full2[1]["losses"][5:], atol=1e-6, rtol=0)
    _close(two_two["params"], full2[0]["params"], atol=1e-6, rtol=0)
    # 1 -> 2 and 2 -> 1: at the 1-rank vs 2-rank rounding
    torch.testing.assert_close(_mean_losses(one_two, one_two_r1), _mean_losses(*full2)[5:],
                               atol=ATOL, rtol=RTOL)
    _close(one_two["params"], full2[0]["params"])
    two_one = w.train(0, 1, start=5, load=two["ckpt"])
    torch.testing.assert_close(two_one["losses"], one["fp32"]["losses"][5:], atol=ATOL, rtol=RTOL)
    _close(two_one["params"], one["fp32"]["params"])


@pytest.mark.slow
@pytest.mark.parametrize("hang", [False, True], ids=["killed", "stuck"])
def test_lost_rank_makes_the_survivor_exit(tmp_path, hang):
    """Rank 1 dies (or stops, alive) before its backward of step 2's last micro-step; rank
    0 runs into that backward's reduce-scatter and must exit non-zero with a clear error:
    at once when the peer's socket closes, else after the process group's timeout."""
    timeout = 6.0
    # once one rank has failed, the other gets grace_s to end on its own: the survivor
    # needs up to the timeout; the stuck rank would never end
    codes, ended, _, errs = w.spawn("train", str(tmp_path), timeout_s=timeout,
                                    grace_s=1.0 if hang else timeout + 20,
                                    kill_at=(2, 1), hang=hang, kill_dir=str(tmp_path))
    stopped = float(open(os.path.join(tmp_path, "stopped_at")).read())
    assert codes[0] == 1, errs[0]
    assert ended[0] - stopped < timeout + 5
    assert "ZeRO-Offload rank 0 of 2: reduce-scatter" in errs[0] and "timeout" in errs[0]
    assert codes[1] == (-9 if hang else 17)


# ----------------------------------------------------- in-process, a 1-rank process group
@contextlib.contextmanager
def _one_rank(backend):
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def group():
    with _one_rank("gloo") as g:
        yield g


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_partitioned_path_with_one_rank_is_bitwise_single_process(device):
    """An explicit process group runs the partitioned code (reduce-scatter, all-reduce,
    all-gather, the accumulation buffers; on CUDA the side-stream completion and NCCL) even
    with one rank: it must change nothing."""
    with _one_rank("gloo" if device == "cpu" else "nccl") as group:
        _compare_partitioned_with_single(group, device)


def _compare_partitioned_with_single(group, device):
    data = [ids.to(device) for ids in w.batches(8)]
    results = []
    for pg in (None, group):
        model, opt = w.build(process_group=pg, compute_dtype="bf16", bucket_size_mb=0.005,
                             device=device)
        norms = []
        for step in range(4):
            for micro in range(2):
                with opt.no_sync() if micro == 0 and step % 2 == 0 else w._null():
                    loss = model(data[2 * step + micro], extra_rows=2 * (step == 1), extra_weight=1)
                    loss.backward()
            opt.step()
            # No clipping: the norm of a window reduced once is summed on the device, one
            # process sums it on the host; they differ in the last bits.
            norms.append(opt.grad_norm)
        results.append(([p.detach().clone() for p in model.parameters()], opt, norms))
    (single, opt1, norms1), (parted, opt2, norms2) = results
    assert norms2 == pytest.approx(norms1, rel=1e-6)
    assert isinstance(opt1.exchange, LocalExchange)
    assert isinstance(opt2.exchange, PartitionedExchange)
    assert opt2.exchange.sent["reduce_scatter"] > 0
    for a, b in zip(single, parted):
        assert torch.equal(a, b)
    sd1, sd2 = opt1.state_dict(), opt2.state_dict()
    for i, st in sd1["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sd2["state"][i][k]), (i, k)


def test_partial_dtensor_params_are_refused_before_any_change(group):
    # tensor parallelism itself is supported (tests/offload/test_tensor_parallel.py)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (1,))
    plain = torch.nn.Parameter(torch.randn(3))
    partial = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Partial()]))
    with pytest.raises(ValueError, match="placement Partial.*not supported"):
        ZeroOffloadOptimizer([plain, partial], plugin=ZeroOffloadPlugin(compute_dtype="bf16"))
    assert plain.dtype == torch.float32


def test_check_model_refuses_ddp_and_fsdp_not_tp(group):
    """Tensor-parallel models pass (the integrations shard and train them); DDP and FSDP2
    layouts are refused."""
    model = w.Model()
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        check_model(torch.nn.parallel.DistributedDataParallel(model))
    model.fsdp_size = 2
    with pytest.raises(ValueError, match=r"fsdp_size=2 \(FSDP2\) is not supported"):
        check_model(model)
    del model.fsdp_size
    model.tp_size = 2
    check_model(model)


def test_sync_signal_precedence():
    from accelerate.state import GradientState

    model, opt, _ = w.make(compute_dtype="fp32")
    assert wants_sync(opt.sync_gradients)  # no accelerate state: every backward synchronizes
    try:
        GradientState()._set_sync_gradients(False)
        assert not wants_sync(opt.sync_gradients)  # accelerate's micro-step inside accumulate()
        opt.sync_gradients = True
        assert wants_sync(opt.sync_gradients)  # the engine's own flag wins
        opt.sync_gradients = None
        GradientState()._set_sync_gradients(True)
        with opt.no_sync():
            assert not wants_sync(opt.sync_gradients)
        assert wants_sync(opt.sync_gradients)
    finally:
        GradientState._reset_state()


def test_shell_state_dict_refuses_to_load():
    model, opt, _ = w.make(compute_dtype="fp32")
    sd = opt.state_dict()
    sd["zero_offload"]["shell_of_rank"] = 1
    with pytest.raises(ValueError, match="rank 1 .* holds no state"):
        opt.load_state_dict(sd)
