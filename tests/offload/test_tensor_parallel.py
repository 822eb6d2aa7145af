"""ZeRO-Offload with torch tensor parallelism (DTensor params): 2 gloo ranks (tp=2) against
one process on the same model and data (tests/offload/_tp_worker.py)."""


import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.offload.modes.mesh import MeshSpan
from hf_zoffload.offload.modes.resolve import Kind
from hf_zoffload.offload.support import check_model
from tests.offload import _dp_worker as dpw
from tests.offload import _tp_worker as w

# fp32: the row-parallel projection sums two partial products (an all-reduce) where one
# process sums one matmul, a rounding apart per element (2^-24 relative), fed back through
# 10 steps (measured: 1.2e-7 max on params of magnitude < 1). A lost shard, a doubled
# replicated update or a norm counted tp times is off by > 1e-3.
ATOL, RTOL = 1e-5, 1e-4
FP32 = {"compute_dtype": "fp32"}
BF16 = {"compute_dtype": "bf16"}
INT8 = {"compute_dtype": "fp32", "state_dtype": "int8"}
M16_INT4 = {"compute_dtype": "bf16", "master_dtype": "bf16", "state_dtype": "int4"}
TRAIN = "tests.offload._tp_worker:runs"


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("tp_one") / "ckpt_tp1.pt")
    return {"fp32": w.train(0, 1, save_at=5, save=ckpt), "bf16": w.train(0, 1, plugin=BF16),
            "int8": w.train(0, 1, plugin=INT8), "m16_int4": w.train(0, 1, plugin=M16_INT4),
            "ckpt": ckpt}


@pytest.fixture(scope="module")
def two(tmp_path_factory, one):
    d = tmp_path_factory.mktemp("tp_two")
    ckpt = str(d / "ckpt_tp2.pt")
    jobs = [("train", {"save_at": 5, "save": ckpt}), ("train", {"plugin": BF16}),
            ("train", {"start": 5, "load": one["ckpt"]}), ("train", {"plugin": INT8}),
            ("train", {"plugin": M16_INT4}), ("keyed", {})]
    codes, _, res, errs = dpw.spawn(TRAIN, str(d), jobs=jobs)
    assert codes == [0, 0], "\n".join(errs)
    return dict(zip(["fp32", "bf16", "from_tp1", "int8", "m16_int4", "keyed"], zip(*res)),
                ckpt=ckpt)


def _close(a, b, atol=ATOL, rtol=RTOL):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


@pytest.mark.slow
def test_tp2_equals_one_process_every_step(two, one):
    """fp32, 10 steps of 2 micro-steps, clipping, a frozen layer, a param with a grad on
    every third step only, column- and row-parallel shards (even and uneven) and replicated
    params: every step's params equal one process's; the norms too."""
    r0, r1 = two["fp32"]
    ref = one["fp32"]
    assert len(r0["params"]) == len(ref["params"]) == w.STEPS
    for step, (a, b, c) in enumerate(zip(r0["params"], r1["params"], ref["params"])):
        for x, y in zip(a, b):
            assert torch.equal(x, y), step  # both ranks hold the same model, replicas too
        _close(a, c)
    torch.testing.assert_close(r0["norms"], ref["norms"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(r0["losses"], ref["losses"], atol=ATOL, rtol=RTOL)
    assert max(ref["norms"]) > w.MAX_NORM  # clipping was active
    assert r0["norms"] == r1["norms"]  # every rank clips and steps the same
    for (name, p0), p in zip(w.Model().named_parameters(), r0["params"][-1]):
        if name.startswith("frozen."):
            assert torch.equal(p, p0.detach()), name


@pytest.mark.slow
def test_tp2_buckets_keep_shards_and_whole_params_apart_and_halve_the_shards(two, one):
    r0 = two["fp32"][0]
    D, H, V = w.D, w.H, w.VOCAB
    # whole on every rank: embedding, norm, the row-parallel bias (Replicate), extra head
    whole = V * D + 2 * D + D + D + 1
    # rank 0's shards: half of up and down, and 49 of the head's 97 rows (torch.chunk)
    local = (H // 2) * D + H // 2 + D * (H // 2) + 49 * D + 49
    assert sum(n for s, n in r0["buckets"] if s) == local
    assert sum(n for s, n in r0["buckets"] if not s) == whole
    assert sum(n for _, n in one["fp32"]["buckets"]) == whole + 2 * H * D + H + V * D + V
    host = r0["memory"]["host"]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert host[key] == 4 * (whole + local), key  # fp32 state of this rank's tensors


@pytest.mark.slow
def test_bf16_tp2_tracks_one_process(two, one):
    """Each param's mean distance from the one-process run against its mean update, as
    tests/offload/test_partition.py does for data parallelism. bf16 roundings differ from
    the first step: each rank's partial product of the row-parallel layer is rounded to bf16
    before the all-reduce adds them (and rounds again), where one process rounds one
    matmul; the input gradient of the column-parallel layer likewise. The measured ratios:
    0.28% over all params, under 0.5% per param except the norm's bias, 2.9%, whose
    gradient is a sum over all 60 tokens of that all-reduced input gradient, with terms
    that cancel, so its relative error grows and Adam's normalized update carries it. A
    lost shard or an update applied twice is ~100%."""
    r0, r1 = two["bf16"]
    for a, b in zip(r0["params"][-1], r1["params"][-1]):
        assert torch.equal(a, b)
    dist_sum = upd_sum = 0.0
    for a, b, c in zip(r0["params"][-1], one["bf16"]["params"][-1], w.Model().parameters()):
        if not c.requires_grad:
            continue
        a, b, c = a.float(), b.float(), c.detach().float()
        assert (a - b).abs().mean() <= 0.05 * (b - c).abs().mean()
        dist_sum += float((a - b).abs().sum())
        upd_sum += float((b - c).abs().sum())
    assert dist_sum <= 0.01 * upd_sum


@pytest.mark.slow
def test_int8_moments_tp2_track_one_process(two, one):
    """8-bit moments over local shards. A shard's blocks start at its own first element,
    so a sharded param is quantized in other blocks than in one process (other scales):
    the two int8 runs differ by quantization, not by rounding. So each is compared with the
    fp32-moment run of one process: tp=2 must stay as close to it as one process does.
    Measured (mean distance over mean update, per param): one process 0.0003-0.024, tp=2
    0.0001-0.024, at most 1.13x one process's. A misplaced block or scale is ~100%."""
    r0, r1 = two["int8"]
    for a, b in zip(r0["params"][-1], r1["params"][-1]):
        assert torch.equal(a, b)
    for a, b, ref, c in zip(r0["params"][-1], one["int8"]["params"][-1],
                            one["fp32"]["params"][-1], w.Model().parameters()):
        if c.requires_grad:
            a, b, ref, c = a.float(), b.float(), ref.float(), c.detach().float()
            upd = (ref - c).abs().mean()
            tp2, one_ = (float((x - ref).abs().mean() / upd) for x in (a, b))
            assert one_ <= 0.05 and tp2 <= 1.5 * one_ + 0.002, (tp2, one_)


@pytest.mark.slow
def test_bf16_master_tp2_keys_each_shard_by_its_local_index(two):
    """What docs/design.md ("bf16 master") says of tensor-parallel shards: each rank's step
    is the kernel over its local tensors, param by param, element i of a local shard
    rounded with the bits of index i under the param's key (int4 moments in blocks from
    the shard's own first element). So two shards of a param draw the same bits at the same
    local index, and a sharded element is rounded with other bits than in one process: tp=2
    is not bitwise tp=1, even with equal gradients. (Measured: the engine keying its
    shards from local index 1000 instead fails this at every step.)"""
    r0, r1 = two["keyed"]
    assert r0["same"] == r1["same"] == [True] * len(r0["same"])
    for a, b in zip(r0["params"], r1["params"]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.slow
def test_bf16_master_int4_tp2_tracks_one_process(two, one):
    """bf16 master and 4-bit moments over local shards, with accumulation and clipping.
    The bf16 roundings of tp=2's partial products, the shards' own blocks and rounding bits
    make it another run than one process's: each is compared with the one-process run of
    fp32 master and moments (bf16 compute) and tp=2 must stay as close to it as one process
    does. Measured (mean distance over mean update, per param, after 10 steps at lr 3e-3):
    one process 0.05-0.60 (4-bit moments of these 1-3,104-element params cost that much),
    tp=2 0.0-0.64, at most 1.10x one process's; tp=2 against one process's own bf16-master
    int4 run 0.01-0.20. A block or scale that lands on another param's elements moves its
    updates by orders of magnitude; the rounding keys are the test above's."""
    r0, r1 = two["m16_int4"]
    for a, b in zip(r0["params"][-1], r1["params"][-1]):
        assert torch.equal(a, b)
    for a, b, ref, c in zip(r0["params"][-1], one["m16_int4"]["params"][-1],
                            one["bf16"]["params"][-1], w.Model().parameters()):
        if c.requires_grad:
            a, b, ref, c = a.float(), b.float(), ref.float(), c.detach().float()
            upd = (ref - c).abs().mean()
            tp2, one_ = (float((x - ref).abs().mean() / upd) for x in (a, b))
            assert one_ <= 0.7 and tp2 <= 1.25 * one_ + 0.02, (tp2, one_)


@pytest.mark.slow
def test_master_state_dict_is_whole_and_rounds_to_the_params(two):
    r0, r1 = two["bf16"]
    assert r1["masters"] is None
    m = r0["masters"]
    for (name, p0), p in zip(w.Model().named_parameters(), r0["params"][-1]):
        assert m[name].shape == p0.shape, name
        if p0.requires_grad:
            assert m[name].dtype == torch.float32
            assert torch.equal(m[name].to(torch.bfloat16), p), name


@pytest.mark.slow
def test_checkpoints_move_between_tp2_and_one_process(two, one):
    """Saved with tp=2, resumed in one process; saved in one process, resumed with tp=2:
    both continue like the uninterrupted runs."""
    sd = torch.load(two["ckpt"], weights_only=True)
    shapes = [p.shape for g in w.decay_groups(w.Model()) for p in g["params"]]  # opt order
    for i, st in sd["opt"]["state"].items():
        assert st["exp_avg"].shape == st["master"].shape == shapes[i]  # whole tensors
    resumed = w.train(0, 1, start=5, load=two["ckpt"])
    torch.testing.assert_close(resumed["losses"], one["fp32"]["losses"][5:], atol=ATOL,
                               rtol=RTOL)
    for a, b in zip(resumed["params"], one["fp32"]["params"][5:]):
        _close(a, b)
    r0, r1 = two["from_tp1"]
    torch.testing.assert_close(r0["losses"], one["fp32"]["losses"][5:], atol=ATOL, rtol=RTOL)
    for a, b, c in zip(r0["params"], r1["params"], one["fp32"]["params"][5:]):
        _close(a, c)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# ----------------------------------------------------- in-process, a 1-rank process group
def test_one_rank_tensor_parallel_is_bitwise_one_process():
    """A 1-rank mesh runs the tensor-parallel exchange (DTensor params, local tensors,
    swapped-in compute-dtype locals, the stats all-reduce, checkpoints through full_tensor):
    it must change nothing against plain params."""
    ref = w.train(0, 1, stop=4, plugin=BF16)
    with dpw.one_rank():
        model = w.Model()
        mesh = init_device_mesh("cpu", (1,))
        from torch.distributed.tensor.parallel import parallelize_module
        parallelize_module(model, mesh, w.PLAN)
        opt = ZeroOffloadOptimizer(w.decay_groups(model), lr=w.LR, plugin=ZeroOffloadPlugin(
            bucket_size_mb=0.004, compute_dtype="bf16"))
        assert opt.mode.kind is Kind.TENSOR_PARALLEL and isinstance(opt.exchange.span, MeshSpan)
        assert isinstance(model.up.weight, DTensor) and model.up.weight.dtype == torch.bfloat16
        assert model.up.weight.to_local().dtype == torch.bfloat16
        model.frozen.to(opt.dtype)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / 2, (w.STEPS - s) / (w.STEPS - 2)))
        data = w.batches(w.STEPS * w.ACCUM)
        for step in range(4):
            for micro in range(w.ACCUM):
                (model(data[step * w.ACCUM + micro], extra=step % 3 == 0) / w.ACCUM).backward()
            opt.clip_grad_norm_(w.MAX_NORM)
            opt.step()
            sched.step()
        for a, b in zip(w.whole(model), ref["params"][-1]):
            assert torch.equal(a, b)
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        for a, b in zip(w.whole(model), ref["params"][-1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["partial", "3d", "fsdp2", "two_meshes"])
def test_unsupported_dtensors_are_refused_before_any_change(case, monkeypatch):
    with dpw.one_rank():
        plain = torch.nn.Parameter(torch.randn(3))
        mesh = init_device_mesh("cpu", (1,))
        if case == "partial":
            bad = [DTensor.from_local(torch.randn(4), mesh, [Partial()])]
            match = "placement Partial"
        elif case == "3d":
            bad = [distribute_tensor(torch.randn(4), init_device_mesh("cpu", (1, 1, 1)),
                                     [Replicate()] * 3)]
            match = "3-D device mesh"
        elif case == "fsdp2":
            bad = [distribute_tensor(torch.randn(4), init_device_mesh("cpu", (1, 1)),
                                     [Shard(0), Replicate()])]
            match = "FSDP2"
        else:
            other = init_device_mesh("cpu", (1,), mesh_dim_names=("other",))
            bad = [distribute_tensor(torch.randn(4), mesh, [Shard(0)]),
                   distribute_tensor(torch.randn(4), other, [Shard(0)])]
            match = "different device meshes"
        params = [plain] + [torch.nn.Parameter(t) for t in bad]
        with pytest.raises(ValueError, match=match):
            ZeroOffloadOptimizer(params, plugin=ZeroOffloadPlugin(compute_dtype="bf16"))
        assert plain.dtype == torch.float32 and all(p.dtype == torch.float32 for p in params)


def test_check_model_takes_tensor_parallel_models_and_refuses_fsdp2_ones():
    """The integrations' check: DTensor params of a tensor-parallel plan pass (the Trainer
    and prepare_zero_offload train them, tests/integrations/test_tensor_parallel.py); a model
    loaded with fsdp_size > 1, or a placement the engine cannot train, does not."""
    with dpw.one_rank():
        model = w.Model()
        from torch.distributed.tensor.parallel import parallelize_module
        parallelize_module(model, init_device_mesh("cpu", (1,)), w.PLAN)
        check_model(model)
        model.fsdp_size = 2
        with pytest.raises(ValueError, match="fsdp_size=2 \\(FSDP2\\) is not supported"):
            check_model(model)
        del model.fsdp_size
        mesh = init_device_mesh("cpu", (1,))
        model.extra.weight = torch.nn.Parameter(DTensor.from_local(
            torch.randn(1, w.D), mesh, [Partial()]))
        with pytest.raises(ValueError, match="placement Partial"):
            check_model(model)


@pytest.mark.slow
def test_dp2_x_tp2_equals_one_process_every_step(one, tmp_path):
    """4 processes: a (dp=2, tp=2) mesh; the data-parallel group is derived from the params'
    tp mesh and the world. Each data-parallel pair averages half-batch gradients (a rounding
    more than tp=2 alone: measured 2.4e-7 max) and holds half of its shards' host state."""
    codes, _, res, errs = dpw.spawn(TRAIN, str(tmp_path), world=4, wait_s=400,
                                    jobs=[("train", {"tp": 2})])
    assert codes == [0, 0, 0, 0], "\n".join(errs)
    rs = [r[0] for r in res]
    ref = one["fp32"]
    for step in range(w.STEPS):
        for r in rs[1:]:
            for x, y in zip(rs[0]["params"][step], r["params"][step]):
                assert torch.equal(x, y), step
        _close(rs[0]["params"][step], ref["params"][step])
    torch.testing.assert_close(rs[0]["norms"], ref["norms"], atol=ATOL, rtol=RTOL)
    assert rs[0]["sent"]["reduce_scatter"] > 0 and rs[0]["sent"]["all_gather"] > 0
    tp_only = 4 * sum(n for _, n in rs[0]["buckets"])  # this rank's local elements, fp32
    # half, plus at most one padding element (4 B) per bucket
    assert tp_only / 2 <= rs[0]["memory"]["host"]["master"] <= tp_only / 2 + 4 * 8
