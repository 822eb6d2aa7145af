"""ZeRO-Offload as the optimizer of FSDP2 parameter offload (``fully_shard`` with
``CPUOffloadPolicy``) on a CPU mesh: 1 gloo rank in this process, 2 spawned
(tests/offload/_fsdp2_worker.py), against torch.optim.AdamW on the unsharded model."""


import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, distribute_tensor

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.offload.modes.fsdp2_offload import Fsdp2Exchange
from tests.offload import _dp_worker as dpw
from tests.offload import _fsdp2_worker as w

# fp32 compute: the engine and torch's foreach AdamW run the same formulas in fp32 in another
# operation order, a rounding or two per step, and 2 ranks average two half-batch gradients
# where one process takes the full batch's mean; 20 steps feed that back through the model
# (measured: 2.4e-7 max with 1 and with 2 ranks, params
# of magnitude < 4.1). A lost, doubled or stale gradient, or a
# norm that misses a rank's shard, is off by > 1e-3.
ATOL, RTOL = 1e-5, 1e-4
FP32, BF16 = {"compute_dtype": "fp32"}, {"compute_dtype": "bf16"}
RUNS = "tests.offload._fsdp2_worker:runs"


def reference(steps: int = w.STEPS, *, tied: bool = False):
    """torch.optim.AdamW on the unsharded net, full batches: each step's params and norm."""
    model = w.Net(tied)
    opt = torch.optim.AdamW(w.decay_groups(model), lr=w.LR)
    data, params, norms = w.batches(steps), [], []
    for step in range(steps):
        for micro in range(w.ACCUM):
            (model(data[step * w.ACCUM + micro]) / w.ACCUM).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), w.MAX_NORM)))
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return params, norms


@pytest.fixture(scope="module")
def ref():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # the net is tiny: threads only contend on the shared machine
    try:
        return reference()
    finally:
        torch.set_num_threads(saved)


def _close_every_step(got, ref_run, first: int = 0):
    params, norms = ref_run
    assert len(got["params"]) == len(params) - first
    for step, (a, b) in enumerate(zip(got["params"], params[first:]), start=first):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.allclose(x, y, atol=ATOL, rtol=RTOL), \
                (step, i, float((x - y).abs().max()))
    for x, y in zip(got["norms"], norms[first:]):
        assert x == pytest.approx(y, rel=1e-5)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One rank, in this process: 20 steps, a checkpoint after 10."""
    ckpt = str(tmp_path_factory.mktemp("fsdp2_one") / "ckpt_1rank.pt")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with dpw.one_rank():
            return {"fp32": w.train(0, 1, plugin=FP32, save_at=10, save=ckpt), "ckpt": ckpt}
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def two(tmp_path_factory, one):
    d = tmp_path_factory.mktemp("fsdp2_two")
    ckpt = str(d / "ckpt_2ranks.pt")
    jobs = [("train", {"plugin": FP32, "save_at": 10, "save": ckpt}),
            ("train", {"plugin": FP32, "start": 10, "load": one["ckpt"]}),
            ("train", {"stop": 2, "plugin": BF16}), ("overflow", {}), ("still", {}),
            ("train", {"plugin": FP32, "stop": 5, "no_sync": True})]
    codes, _, res, errs = dpw.spawn(RUNS, str(d), jobs=jobs, wait_s=400)
    assert codes == [0, 0], "\n".join(errs)
    return dict(zip(["fp32", "from_1rank", "bf16", "overflow", "still", "no_sync"], zip(*res)),
                ckpt=ckpt)


# ------------------------------------------------------------------ one rank, in-process
def test_one_rank_equals_torch_adamw(torch_one_thread):
    """fp32, 4 steps of 2 micro-steps, clipping at 0.5 (it binds), decay and no-decay groups
    (20 steps, and 2 ranks: the slow tests)."""
    with dpw.one_rank():
        got = w.train(0, 1, plugin=FP32, stop=4)
    _close_every_step(got, reference(4))


def test_one_rank_fsdp2_reducing_only_at_the_boundary_equals_torch_adamw(torch_one_thread):
    """``set_requires_gradient_sync(False)`` on the first micro-step: FSDP2 keeps its
    unsharded gradient and reduces the sum at the second backward, the engine's window sees
    one backward a step."""
    with dpw.one_rank():
        got = w.train(0, 1, plugin=FP32, stop=3, no_sync=True)
    _close_every_step(got, reference(3))
    assert got["report"]["host"]["grad_accumulation"] == 0  # one landed backward a step


@pytest.mark.parametrize("reentrant", [False, True])
def test_one_rank_activation_checkpointing_equals_torch_adamw(reentrant, torch_one_thread):
    """Each block's activations recomputed in backward (FSDP2 gathers its params again
    there); reentrant checkpointing runs a nested backward per block, and the engine's
    backward still ends once."""
    with dpw.one_rank():
        got = w.train(0, 1, plugin=FP32, stop=3, reentrant=reentrant)
    _close_every_step(got, reference(3))


def test_one_rank_tied_weights_equal_torch_adamw(torch_one_thread):
    """The head's weight is the embedding's, both in the root's FSDP2 group: one sharded
    param to FSDP2 and to the engine, its gradient the sum of both uses."""
    with dpw.one_rank():
        got = w.train(0, 1, plugin=FP32, stop=3, tied=True)
    assert len(got["params"][0]) == len(list(w.Net().parameters())) - 1
    _close_every_step(got, reference(3, tied=True))


def test_one_rank_delayed_update_equals_the_engine_without_fsdp2(torch_one_thread):
    """The delayed update (each gradient applied one step late: each forward sees the
    params of two steps before) over FSDP2's shards: the same params each step as the engine
    on the plain net, where FSDP2 on one rank computes the same grads (no collective); with
    ``flush()`` after each step, torch's AdamW."""
    plugin = {**FP32, "delayed_update": True, "delayed_update_warmup_steps": 1}
    with dpw.one_rank():
        got = w.train(0, 1, plugin=plugin, stop=5)
    plain = w.train(0, 1, plugin=plugin, stop=5, fsdp=False)
    for a, b in zip(got["params"], plain["params"], strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    ref = reference(5)
    assert max(float((x - y).abs().max()) for x, y in zip(got["params"][-1], ref[0][-1])) > 1e-3
    with dpw.one_rank():
        _close_every_step(w.train(0, 1, plugin=plugin, stop=5, flush=True), ref)


def test_checkpoints_move_to_the_mode_without_fsdp2_and_back(torch_one_thread, tmp_path):
    """The engine's state_dict is one format in both modes: saved over FSDP2's shards at step
    2, resumed by the engine on the plain net, and the reverse; both continue as AdamW."""
    ref = reference(4)
    a, b = str(tmp_path / "fsdp2.pt"), str(tmp_path / "plain.pt")
    with dpw.one_rank():
        w.train(0, 1, plugin=FP32, stop=2, save_at=2, save=a)
        w.train(0, 1, plugin=FP32, stop=2, save_at=2, save=b, fsdp=False)
        into_fsdp2 = w.train(0, 1, plugin=FP32, start=2, stop=4, load=b)
    into_plain = w.train(0, 1, plugin=FP32, start=2, stop=4, load=a, fsdp=False)
    _close_every_step(into_fsdp2, ref, first=2)
    _close_every_step(into_plain, ref, first=2)


@pytest.mark.parametrize("state_dtype, moments", [("fp32", 8.0), ("bf16", 4.0),
                                                  ("int8", 2.0 + 8 / 256)])
def test_host_bytes_per_param_per_state_dtype(state_dtype, moments, torch_one_thread):
    """bf16 compute on an fp32 model, after a step: FSDP2's sharded host params are the
    engine's bf16 copy, 2 B per param; per element the engine holds master 4, moments
    (int8: 1 B each plus an fp32 scale per 256-element block of each), grad landing 2.
    16 / 12 / about 10 B per param in all."""
    with dpw.one_rank():
        r = w.train(0, 1, stop=1, plugin={"state_dtype": state_dtype, "compute_dtype": "bf16"})
    host, n = r["report"]["host"], r["local"]
    assert r["param_dtypes"] == ["torch.bfloat16"]
    assert host["params"] == 2 * n
    assert r["report"]["device"]["params"] == 0  # what FSDP2 streams is not the engine's
    held = host["master"] / 4  # int8 starts every param on a block: + alignment (20% here,
    # 10 small params; < 0.1% for 7B shapes)
    assert held == n if state_dtype != "int8" else n < held < 1.25 * n
    assert (host["exp_avg"] + host["exp_avg_sq"]) / held == moments
    # the pool's blocks round each bucket up (here 26 B over the net's 15 buckets)
    assert 2 <= host["grad_staging"] / held <= 2 * 1.01
    assert host["grad_accumulation"] == 0  # one backward a step


# ------------------------------------------------------------------ refusals
def _refused(match: str, **shard_kw):
    with dpw.one_rank():
        model = w.shard(w.Net(), 1, **shard_kw)
        before = [p.to_local().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=match):
            ZeroOffloadOptimizer(model.parameters(), model=model, plugin=ZeroOffloadPlugin())
        after = [p.to_local() for p in model.parameters()]
        assert all(a.dtype == torch.float32 and torch.equal(a, b)
                   for a, b in zip(after, before))  # nothing cast, nothing written
        return model


def test_refuses_fsdp1(torch_one_thread):
    with dpw.one_rank():
        model = FullyShardedDataParallel(w.Net(), device_id=torch.device("cpu"))
        with pytest.raises(ValueError, match="FSDP .the param is an FSDP FlatParameter"):
            ZeroOffloadOptimizer(model.parameters(), model=model, plugin=ZeroOffloadPlugin())
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_refuses_fsdp2_without_cpu_offload(torch_one_thread):
    _refused("FSDP2 without CPU offload", offload=False)


def test_refuses_a_mixed_precision_param_dtype_other_than_compute(torch_one_thread):
    _refused(r"MixedPrecisionPolicy\(param_dtype=torch.float16\)",
             mp=MixedPrecisionPolicy(param_dtype=torch.float16))


def test_refuses_hsdp(torch_one_thread):
    _refused(r"FSDP2 on a 2-D mesh \(HSDP\)", hsdp=True)


def test_refuses_after_the_first_forward(torch_one_thread):
    with dpw.one_rank():
        model = w.shard(w.Net(), 1)
        model(w.batches(1)[0])
        with pytest.raises(ValueError, match="before the first forward"):
            ZeroOffloadOptimizer(model.parameters(), model=model, plugin=ZeroOffloadPlugin())


def test_refuses_a_trainable_param_fsdp2_does_not_shard(torch_one_thread):
    with dpw.one_rank():
        model = w.Net()
        for m in [*model.blocks, model.head]:
            w.fully_shard(m, mesh=w.init_device_mesh("cpu", (1,)),
                          offload_policy=w.CPUOffloadPolicy(pin_memory=False))
        with pytest.raises(ValueError, match="param 0 is trainable but not sharded"):
            ZeroOffloadOptimizer(model.parameters(), model=model, plugin=ZeroOffloadPlugin())


def test_refuses_an_offload_fraction_below_one(torch_one_thread):
    with dpw.one_rank():
        model = w.shard(w.Net(), 1)
        before = [p.to_local().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match="'offload_fraction' '0.5' with FSDP2 parameter "
                                             "offload: .* allowed: 1"):
            ZeroOffloadOptimizer(model.parameters(), model=model,
                                 plugin=ZeroOffloadPlugin(offload_fraction="0.5"))
        assert all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))


def test_refuses_a_process_group(torch_one_thread):
    with dpw.one_rank():
        model = w.shard(w.Net(), 1)
        with pytest.raises(ValueError, match="process_group= was given"):
            ZeroOffloadOptimizer(model.parameters(), model=model, plugin=ZeroOffloadPlugin(),
                                 process_group=dist.group.WORLD)


def test_the_exchange_is_the_fsdp2_mode(torch_one_thread):
    with dpw.one_rank():
        model, opt = w.build(1)
        assert isinstance(opt.exchange, Fsdp2Exchange) and opt.exchange.params_on_host


# ------------------------------------------------------------------ two ranks, spawned
@pytest.mark.slow
def test_one_rank_20_steps_equal_torch_adamw(one, ref):
    _close_every_step(one["fp32"], ref)


@pytest.mark.slow
def test_two_ranks_20_steps_equal_torch_adamw(two, ref):
    """Each rank its half of every batch; FSDP2 reduce-scatters, the engine clips on the
    norm over both ranks' shards (uneven: 49 + 48 rows of the embedding and head)."""
    for r in two["fp32"]:
        _close_every_step(r, ref)


@pytest.mark.slow
def test_two_ranks_fsdp2_reducing_only_at_the_boundary_equals_torch_adamw(two, ref):
    for r in two["no_sync"]:
        _close_every_step(r, (ref[0][:5], ref[1][:5]))


@pytest.mark.slow
def test_checkpoints_resume_with_the_other_rank_count(two, ref, tmp_path):
    """Saved by 1 rank at step 10, resumed by 2; saved by 2, resumed by 1: every later step
    equals the uninterrupted run."""
    for r in two["from_1rank"]:
        _close_every_step(r, ref, first=10)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with dpw.one_rank():
            got = w.train(0, 1, plugin=FP32, start=10, load=two["ckpt"])
    finally:
        torch.set_num_threads(saved)
    _close_every_step(got, ref, first=10)
    sd = torch.load(two["ckpt"], weights_only=True)  # torch AdamW's per-param format
    assert sorted(sd["state"]) == list(range(len(ref[0][0])))
    assert {"step", "exp_avg", "exp_avg_sq", "master"} <= set(sd["state"][0])
    assert sd["state"][0]["master"].shape == ref[0][0][0].shape


def _padded(p, world: int) -> int:
    """Elements of FSDP2's padded shard of ``p`` (dim 0 rounded up to the ranks)."""
    return -(-p.shape[0] // world) * p[0].numel()


@pytest.mark.slow
def test_two_ranks_fsdp2_moves_16bit_both_ways(two):
    """bf16 compute on an fp32 model: FSDP2's all-gathers send the bf16 sharded params and
    its reduce-scatters return bf16 gradient shards, 2 B per element of the padded shard
    each way, per micro-step: every group is gathered for its forward, the non-root ones
    again for their backward (resharded after forward); counted exactly (53,948 B up and
    30,012 B down a step on rank 0 here)."""
    net = w.Net()
    root = _padded(net.emb.weight, 2)
    rest = sum(_padded(p, 2) for n, p in net.named_parameters() if not n.startswith("emb."))
    for r in two["bf16"]:
        assert r["up"] == {"bfloat16": w.ACCUM * 2 * (root + 2 * rest)}
        assert r["down"] == {"bfloat16": w.ACCUM * 2 * (root + rest)}
    assert two["bf16"][0]["local"] == root + rest  # rank 0 holds the longer shards
    assert two["bf16"][0]["report"]["host"]["params"] == 2 * (root + rest)


@pytest.mark.slow
def test_two_ranks_fp16_overflow_skips_and_leaves_the_state(two):
    """An inf in rank 1's loss at step 2: both ranks skip it, halve the scale, and the
    optimizer state and the params are bit for bit what they were."""
    r0, r1 = two["overflow"]
    for r in (r0, r1):
        assert r["skipped"] == [False, False, True, False]
        assert r["scale"][2] == r["scale"][1] / 2
        for a, b in zip(r["params_before"], r["params_after"]):
            assert torch.equal(a, b)
    before, after = r0["before"]["state"], r0["after"]["state"]
    assert before and sorted(before) == sorted(after)
    for i in before:
        for k in ("step", "exp_avg", "exp_avg_sq", "master"):
            assert torch.equal(before[i][k], after[i][k]), (i, k)


@pytest.mark.slow
def test_two_ranks_masters_stay_fp32_through_fsdp2s_padding(two):
    """lr 0: after a step the masters are the fp32 initial values, not their bf16 roundings
    (FSDP2 re-padding the short shards at placement is not an edit from outside)."""
    got = two["still"][0]["masters"]
    init = list(w.Net().parameters())
    assert len(got) == len(init)
    for a, b in zip(got, init):
        assert torch.equal(a, b.detach())


def test_load_master_state_dict_takes_dtensors_laid_out_as_the_params(torch_one_thread):
    """What a DTensor model's load_state_dict hands its hooks once whole tensors are cut into
    parts: DTensors in the params' own layout become the fp32 masters (their local parts);
    a DTensor in another layout is refused before anything is written."""
    with dpw.one_rank():
        model, opt = w.build(1, plugin=dict(compute_dtype="bf16"))
        named = dict(model.named_parameters())
        g = torch.Generator().manual_seed(5)
        whole = {n: torch.randn(p.shape, generator=g) for n, p in named.items()}
        parts = {n: distribute_tensor(whole[n], p.device_mesh, p.placements, src_data_rank=None)
                 for n, p in named.items()}
        first = next(iter(named))
        bad = dict(parts)
        bad[first] = distribute_tensor(whole[first], named[first].device_mesh, [Replicate()],
                                       src_data_rank=None)
        before = opt.master_state_dict(model)
        with pytest.raises(ValueError, match=f"master weights for '{first}': a DTensor"):
            opt.load_master_state_dict(model, bad)
        assert all(torch.equal(before[n], m) for n, m in opt.master_state_dict(model).items())
        opt.load_master_state_dict(model, parts)
        masters = opt.master_state_dict(model)
        for n, p in named.items():
            assert torch.equal(masters[n], whole[n]), n
            assert torch.equal(p.full_tensor(), whole[n].bfloat16()), n
