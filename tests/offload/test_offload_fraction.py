"""``offload_fraction``: device buckets (fp32 state on the params' device, torch's fused AdamW)
beside host buckets (the CPU-Adam), on the CPU, where the engine's "device" is the CPU.

What could go wrong and is checked here: the split (which buckets, the memory figures), the
numbers (against torch.optim.AdamW and, step 1, bitwise against the all-host and all-device
runs), fp16 skips, the delayed update, compact host moments, checkpoints between fractions
and to torch's AdamW, an exact resume, the copy ordering (AsyncCopier), `auto`, 2 ranks, and
bad values."""

import copy
import io
import json
import logging
import os

import accelerate.commands.config.config_args as config_args
import pytest
import torch
from transformers import get_scheduler

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.commands.main import main
from hf_zoffload.offload import fraction as frac_mod
from hf_zoffload.offload.fraction import SAFETY_MARGIN, FixedFraction, suffix
from hf_zoffload.offload.memory import estimate, estimate_with_fraction
from hf_zoffload.offload.tiers import Tier
from hf_zoffload.ops.adam_kernels import adam_update
from hf_zoffload.ops.device_adam import adam_update_device
from tests._tiny import batches, decay_groups, tiny_gpt2
from tests.offload import _dp_worker as w
from tests.offload import _tp_worker as tpw
from tests.offload.test_async_copier import _compare
from tests.offload.test_engine import ATOL, LR, MAX_NORM, RTOL, TRAIN_DEFAULTS, _cycle, _setup  # noqa: F401

MB = 0.01  # ~5k elements a bucket: 7 buckets on the tiny GPT-2
STEPS = 6


# make_engine's defaults here (tests/_fixtures.py); every engine holds the model it trains.
# train's (TRAIN_DEFAULTS, imported) are test_engine's loop: its loss, accumulation and clip.
ENGINE_DEFAULTS = dict(lr=LR, compute_dtype="fp32", bucket_size_mb=MB, model=True)


def _on_device(opt):
    return [b.layout.index for b in opt.buckets if b.tier is Tier.DEVICE]


def _state(opt):
    return [t.clone() for b in opt.buckets
            for t in (b.state.master, b.state.exp_avg, b.state.exp_avg_sq)]


# ---------------------------------------------------------------- the split
def test_the_last_buckets_go_to_the_device_and_the_host_keeps_at_least_the_fraction():
    layouts = [type("L", (), {"index": i, "shard": n}) for i, n in enumerate([5, 3, 4, 4])]
    assert suffix(layouts, lambda n: n <= 8) == {2, 3}
    assert FixedFraction(1).on_device(layouts) == set()
    assert FixedFraction(0).on_device(layouts) == {0, 1, 2, 3}
    assert FixedFraction(0.5).on_device(layouts) == {2, 3}  # 8 of 16 on the device
    assert FixedFraction(0.55).on_device(layouts) == {3}  # 8 would leave 50% < 55% on host


@pytest.mark.slow
@pytest.mark.parametrize("fraction", ["0", "0.5", "1"])
def test_fractions_match_adamw_with_accumulation_and_clipping(fraction, make_engine, train):
    ref = _setup("gpt2")
    ours = copy.deepcopy(ref)
    data = batches(7)
    ref_opt = torch.optim.AdamW(decay_groups(ref), lr=LR)
    opt = make_engine(decay_groups(ours), model=ours, offload_fraction=fraction)
    n = len(opt.buckets)
    assert n > 3
    dev = _on_device(opt)
    assert {"0": n, "0.5": len(dev), "1": 0}[fraction] == len(dev)
    if fraction == "0.5":
        assert 0 < len(dev) < n and dev == list(range(n - len(dev), n))  # the last ones

    def mk(o):
        return get_scheduler("cosine", o, num_warmup_steps=2, num_training_steps=STEPS)

    ref_losses = train(ref, ref_opt, STEPS, batch=_cycle(data), sched=mk(ref_opt))
    losses = train(ours, opt, STEPS, batch=_cycle(data), sched=mk(opt))
    torch.testing.assert_close(losses, ref_losses, atol=ATOL, rtol=RTOL)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, atol=ATOL, rtol=RTOL, msg=name)
    # after the re-layout the split still holds
    assert len(_on_device(opt)) == {"0": len(opt.buckets), "1": 0}.get(fraction,
                                                                      len(_on_device(opt)))


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_first_step_each_param_is_bitwise_its_all_host_or_all_device_run(compute, make_engine):
    """Same grads in at step 1 (2 micro-steps, clipped): a param of a device bucket must come
    out bitwise as in the all-device run, a host one as in the all-host run."""
    runs = {}
    for f in ("0", "0.5", "1"):
        model = tiny_gpt2()
        opt = make_engine(model, compute_dtype=compute, offload_fraction=f)
        for ids in batches(2):
            opt.backward(model(input_ids=ids, labels=ids).loss)
        opt.clip_grad_norm_(0.3)
        where = {id(s.param): b.tier is Tier.DEVICE for b in opt.buckets for s in b.layout.slots}
        opt.step()
        runs[f] = ([p.detach().clone() for p in model.parameters()],
                   [opt.host_views(p)["master"].clone() for p in model.parameters()],
                   [where[id(p)] for p in model.parameters()], opt.grad_norm)
    assert runs["0"][3] == runs["1"][3] == runs["0.5"][3]  # one global norm over both kinds
    params, masters, on_dev, _ = runs["0.5"]
    assert any(on_dev) and not all(on_dev)
    for i, d in enumerate(on_dev):
        like = runs["0" if d else "1"]
        assert torch.equal(params[i], like[0][i]) and torch.equal(masters[i], like[1][i])
        if compute == "bf16":
            assert torch.equal(params[i].reshape(-1), masters[i].to(torch.bfloat16))
    # the two kernels round differently somewhere: the comparison above can tell them apart
    assert not all(torch.equal(a, b) for a, b in zip(runs["0"][1], runs["1"][1]))


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_state_dtype_applies_to_the_host_buckets_only(state_dtype, make_engine):
    model = tiny_gpt2()
    opt = make_engine(model, compute_dtype="bf16", state_dtype=state_dtype, offload_fraction=0.5)
    host_dtype = {"bf16": torch.bfloat16, "int8": torch.uint8}[state_dtype]
    for b in opt.buckets:
        want = torch.float32 if b.tier is Tier.DEVICE else host_dtype
        assert b.state.exp_avg.dtype == want and b.state.exp_avg_sq.dtype == want
    ref = tiny_gpt2()
    ref_opt = make_engine(ref, compute_dtype="bf16", state_dtype=state_dtype)  # all host
    for ids in batches(1):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    where = {id(s.param): b.tier is Tier.DEVICE for b in opt.buckets for s in b.layout.slots}
    for p, q in zip(model.parameters(), ref.parameters()):
        if not where[id(p)]:  # the host buckets ran the same compact kernel on the same grads
            assert torch.equal(p, q)
    for b in opt.buckets:  # still split after the re-layout, still compact on the host
        assert b.state.exp_avg.dtype == (torch.float32 if b.tier is Tier.DEVICE else host_dtype)


def test_fp16_overflow_leaves_device_and_host_state_untouched(make_engine):
    model = tiny_gpt2()
    opt = make_engine(model, compute_dtype="fp16", init_scale=2.0**10, hysteresis=1,
                  offload_fraction=0.5)
    assert _on_device(opt)
    ids = batches(1)[0]
    poison = {"on": False}
    # wte is used by the first module in forward order: a device bucket's param
    model.transformer.wte.weight.register_hook(
        lambda g: g.index_fill(0, torch.tensor([3]), float("inf")) if poison["on"] else g)
    for step in range(4):
        poison["on"] = step == 2
        before, params = _state(opt), [p.detach().clone() for p in model.parameters()]
        opt.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        after = _state(opt)
        assert opt.last_step_skipped == poison["on"]
        same = [torch.equal(a, b) for a, b in zip(before, after)]
        if poison["on"]:
            assert all(same)
            assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        else:
            assert not all(same)
    assert opt.skipped_steps == 1


class _SplitReference:
    """AdamW per param with the kernel of the param's placement at that step: the CPU-Adam
    (bitwise the engine's for any split of a bucket) or the device update."""

    def __init__(self, params):
        self.params = list(params)
        self.state = [(torch.zeros(p.numel()), torch.zeros(p.numel())) for p in self.params]
        self.steps = 0

    @torch.no_grad()
    def step(self, on_device):
        self.steps += 1
        for p, (m, v), dev in zip(self.params, self.state, on_device):
            kw = dict(step=self.steps, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.0)
            if dev:
                adam_update_device([p.data.view(-1)], [p.grad.reshape(-1)], [m], [v], **kw)
            else:
                adam_update(p.data.view(-1), p.grad.reshape(-1), m, v, **kw)


def _placements(opt, model):
    where = {id(s.param): b.tier is Tier.DEVICE for b in opt.buckets for s in b.layout.slots}
    return [where[id(p)] for p in model.parameters()]


@pytest.mark.parametrize("fraction", ["0", "0.5"])
def test_delayed_update_with_device_buckets_is_the_delay_written_out(fraction):
    """tests/offload/test_engine.py's delayed-update reference, each param updated by its
    placement's kernel: bitwise; each forward from the warm-up on sees the params of one
    step earlier, in device buckets too."""
    warmup, steps = 2, 6
    data = batches(3)
    ref = tiny_gpt2()
    stale = copy.deepcopy(ref)  # the params the reference's forward sees
    ours = copy.deepcopy(ref)
    ref_opt = _SplitReference(ref.parameters())
    opt = ZeroOffloadOptimizer(ours.parameters(), lr=LR, weight_decay=0.0, plugin=ZeroOffloadPlugin(
        compute_dtype="fp32", delayed_update=True, delayed_update_warmup_steps=warmup,
        offload_fraction=fraction, bucket_size_mb=MB), model=ours)
    for step in range(steps):
        ids = data[step % len(data)]
        stale(input_ids=ids, labels=ids).loss.backward()
        before = [p.detach().clone() for p in ref.parameters()]
        for p, s in zip(ref.parameters(), stale.parameters()):
            p.grad = s.grad
        on_device = _placements(opt, ours)
        assert any(on_device) and (all(on_device) == (fraction == "0"))
        ref_opt.step(on_device)
        stale.zero_grad()
        with torch.no_grad():
            for s, new, old in zip(stale.parameters(), ref.parameters(), before):
                s.copy_(new if step < warmup else old)
        ours(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        assert opt.update_in_flight == (step >= warmup)
        for a, b in zip(stale.parameters(), ours.parameters()):
            assert torch.equal(a, b)
    opt.flush()
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)


def test_copies_are_ordered_with_device_buckets_through_async_copier():
    """Host buckets' copies on the emulated side stream, device buckets' none: bitwise the
    run through HostCopier (accumulation, fp16, a skipped step)."""
    _compare(5, steps=4, accum=2, poison={(1, 0)}, compute_dtype="fp16", init_scale=2.0**10,
             hysteresis=1, offload_fraction=0.5)
    _compare(6, steps=3, accum=2, compute_dtype="bf16", delayed_update=True,
             delayed_update_warmup_steps=1, offload_fraction=0.5)


# -------------------------------------------------------------- checkpoints
def _trained(make_engine, fraction, steps=3, **plugin):
    model = tiny_gpt2()
    opt = make_engine(model, offload_fraction=fraction, **plugin)
    for ids in batches(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
    return model, opt


def _save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same_state(a, b):
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq", "master"):
            assert a["state"][i][k].device.type == "cpu"
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)


def test_checkpoints_move_between_fractions_and_to_adamw_and_back(make_engine):
    model, opt = _trained(make_engine, "0.5")
    sd = _save(opt.state_dict())
    for f in ("0", "1", "0.5"):
        m2 = tiny_gpt2()
        m2.load_state_dict(model.state_dict())
        o2 = make_engine(m2, offload_fraction=f)
        o2.load_state_dict(sd)
        _same_state(o2.state_dict(), sd)
        assert all(torch.equal(a, b) for a, b in zip(m2.parameters(), model.parameters()))
    adamw_model = copy.deepcopy(model)
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=LR)
    adamw.load_state_dict(sd)
    back_model = copy.deepcopy(model)
    back = make_engine(back_model, offload_fraction=0)
    back.load_state_dict(_save(adamw.state_dict()))
    for i, st in adamw.state_dict()["state"].items():
        got = back.state_dict()["state"][i]
        assert torch.equal(got["exp_avg"], st["exp_avg"]) and got["step"] == st["step"]


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_resume_continues_exactly(state_dtype, make_engine):
    data = batches(6)

    def run(model, opt, steps):
        for step in steps:
            for micro in range(2):
                ids = data[(2 * step + micro) % len(data)]
                opt.backward(model(input_ids=ids, labels=ids).loss)
            opt.clip_grad_norm_(MAX_NORM)
            opt.step()

    def make():
        model = tiny_gpt2()
        return model, make_engine(model, compute_dtype="bf16", state_dtype=state_dtype,
                              offload_fraction=0.5)

    full_model, full_opt = make()
    run(full_model, full_opt, range(6))
    model, opt = make()
    run(model, opt, range(3))
    ckpt = _save({"model": model.state_dict(), "opt": opt.state_dict()})
    model2, opt2 = make()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert _on_device(opt2) == _on_device(opt)
    run(model2, opt2, range(3, 6))
    for a, b in zip(full_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(_state(full_opt), _state(opt2)):
        assert torch.equal(a, b)


# ---------------------------------------------------------- memory figures
def test_memory_report_splits_the_state_by_the_fraction(make_engine):
    opts = {f: _trained(make_engine, f, steps=1)[1] for f in ("0", "0.5", "1")}
    reports = {f: opt.memory_report() for f, opt in opts.items()}
    host = {f: sum(r["host"][k] for k in ("master", "exp_avg", "exp_avg_sq"))
            for f, r in reports.items()}
    dev = {f: r["device"]["optimizer_state"] for f, r in reports.items()}
    assert host["0"] == 0 and dev["1"] == 0
    assert host["0.5"] + dev["0.5"] == host["1"] == dev["0"]  # fp32 state: same bytes
    assert 0.5 <= host["0.5"] / host["1"] < 0.75  # at least the fraction, about it
    assert reports["0"]["host"]["grad_staging"] == 0  # no landing buffer for device buckets
    assert reports["0"]["device"]["grad_resident"] > 0
    n = sum(reports["1"]["buckets"].values())  # where each bucket's state is, counted
    assert reports["1"]["buckets"] == {"host": n, "device": 0} and n == len(opts["1"].buckets)
    assert reports["0"]["buckets"] == {"host": 0, "device": n}
    assert reports["0.5"]["buckets"] == {"host": n - len(_on_device(opts["0.5"])),
                                         "device": len(_on_device(opts["0.5"]))}
    assert opts["0.5"].collective_bytes == {}  # one process: no collective


# --------------------------------------------------------------------- auto
class _Meter:
    def __init__(self, peak, total):
        self.peak, self.total = peak, total

    def reset(self):
        pass

    def figures(self):
        return self.peak, self.total


def test_auto_on_the_cpu_keeps_everything_on_the_host_and_says_so(caplog, make_engine):
    with caplog.at_level(logging.INFO, logger="hf_zoffload.offload.fraction"):
        _, opt = _trained(make_engine, "auto", steps=2)
    assert _on_device(opt) == []
    lines = [r.getMessage() for r in caplog.records if "offload_fraction auto" in r.getMessage()]
    assert len(lines) == 1 and "no device memory to measure on cpu" in lines[0]


@pytest.mark.parametrize("limit", [None, "1900KiB"])
def test_auto_keeps_on_the_device_what_the_first_step_left_free(monkeypatch, caplog, limit,
                                                               make_engine):
    total, peak = 2_000_000, 1_600_000  # 200,000 B free: 12,500 of the 29,600 elements
    monkeypatch.setattr(frac_mod, "DeviceMeter", lambda device: _Meter(peak, total))
    extra = {"device_memory_limit": limit} if limit else {}
    model = tiny_gpt2()
    opt = make_engine(model, offload_fraction="auto", **extra)
    assert _on_device(opt) == []  # the first step runs with everything on the host
    data = batches(3)
    with caplog.at_level(logging.INFO, logger="hf_zoffload.offload.fraction"):
        for ids in data:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    have = 1900 * 1024 if limit else total
    budget = int(have * (1 - SAFETY_MARGIN)) - peak
    per = 12 + 4  # fp32 master and moments, fp32 grad buffer; no accumulation here
    n_dev = sum(b.layout.shard for b in opt.buckets if b.tier is Tier.DEVICE)
    if budget <= 0:
        assert n_dev == 0
    else:
        assert 0 < n_dev * per <= budget
        nxt = [b for b in opt.buckets if b.tier is not Tier.DEVICE][-1]  # the next one out
        assert (n_dev + nxt.layout.shard) * per > budget
    lines = [r.getMessage() for r in caplog.records if "offload_fraction auto" in r.getMessage()]
    assert len(lines) == 1 and ("device_memory_limit" if limit else "device's total") in lines[0]
    assert opt.memory_report()["device"]["optimizer_state"] == 12 * n_dev


def test_auto_decides_after_a_resume_too(monkeypatch, make_engine):
    """A checkpoint loaded before the first step settles the bucket order; `auto` must still
    decide at the end of that step."""
    monkeypatch.setattr(frac_mod, "DeviceMeter", lambda device: _Meter(1_600_000, 2_000_000))
    model, opt = _trained(make_engine, "1", steps=2)
    sd = _save(opt.state_dict())
    m2 = tiny_gpt2()
    m2.load_state_dict(model.state_dict())
    o2 = make_engine(m2, offload_fraction="auto")
    o2.load_state_dict(sd)
    assert _on_device(o2) == []
    ids = batches(1)[0]
    m2(input_ids=ids, labels=ids).loss.backward()
    o2.step()
    assert _on_device(o2) and o2.bucket_order == opt.bucket_order


# --------------------------------------------------------------- bad values
@pytest.mark.parametrize("value", [1.5, -0.1, "half", "nan", ""])
def test_bad_fraction_is_one_line_naming_what_is_allowed(value):
    with pytest.raises(ValueError) as err:
        ZeroOffloadPlugin(offload_fraction=value)
    msg = str(err.value)
    assert "\n" not in msg and "'offload_fraction'" in msg and "from 0 to 1" in msg \
        and "auto" in msg


def test_device_memory_limit_without_auto_is_refused():
    with pytest.raises(ValueError, match="'device_memory_limit'.*only with offload_fraction "
                                         "auto"):
        ZeroOffloadPlugin(offload_fraction=0.5, device_memory_limit="40GiB")
    with pytest.raises(ValueError, match="expected a number with a unit"):
        ZeroOffloadPlugin(offload_fraction="auto", device_memory_limit="40")
    assert ZeroOffloadPlugin(offload_fraction="auto",
                             device_memory_limit="40GiB").device_memory_limit_bytes == 40 * 2**30
    env = {"HF_ZOFFLOAD_OFFLOAD_FRACTION": "0.25"}
    assert ZeroOffloadPlugin.from_sources(environ=env).offload_fraction_value == 0.25


# ------------------------------------------------------------ data parallel
@pytest.mark.slow
def test_two_ranks_split_their_shards_and_match_one_process(tmp_path):
    jobs = [("train", {"plugin": {"compute_dtype": "fp32", "offload_fraction": f}})
            for f in ("0", "0.5")]
    codes, _, res, errs = w.spawn("runs", str(tmp_path), jobs=jobs)
    assert codes == [0, 0], "\n".join(errs)
    one = w.train(0, 1)  # all host, one process
    for r0, r1 in zip(*res):
        for a, b in zip(r0["params"], r1["params"]):  # the ranks end equal
            assert torch.equal(a, b)
        for a, b in zip(r0["params"], one["params"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        for k in ("master", "exp_avg"):
            assert r0["memory"]["host"][k] == r1["memory"]["host"][k]
    host = [r0["memory"]["host"]["master"] for r0 in res[0]]
    assert host[0] == 0 and 0 < host[1] <= one["memory"]["host"]["master"] / 2


# ---------------------------------------------------------- tensor parallel
@pytest.mark.slow
def test_tensor_parallel_ranks_split_their_local_buckets(tmp_path):
    """tp=2 at fractions 0.5 and 0 against one process all on the host, every step; and a
    one-process checkpoint (fraction 1) resumed by tp=2 at fraction 0.5 continues as the
    uninterrupted run (tests/offload/test_tensor_parallel.py's model and data)."""
    ckpt = str(tmp_path / "ckpt_tp1.pt")
    one = tpw.train(0, 1, save_at=5, save=ckpt)
    half = {"compute_dtype": "fp32", "offload_fraction": "0.5"}
    jobs = [("train", {"plugin": half}),
            ("train", {"plugin": {"compute_dtype": "fp32", "offload_fraction": "0"}}),
            ("train", {"plugin": half, "start": 5, "load": ckpt})]
    codes, _, res, errs = w.spawn("tests.offload._tp_worker:runs", str(tmp_path), jobs=jobs)
    assert codes == [0, 0], "\n".join(errs)
    for job, (r0, r1) in enumerate(zip(*res)):
        ref = one["params"][5:] if job == 2 else one["params"]
        assert len(r0["params"]) == len(ref)
        for a, b, c in zip(r0["params"], r1["params"], ref):
            for x, y, z in zip(a, b, c):
                assert torch.equal(x, y)  # both ranks hold the same model
                torch.testing.assert_close(x, z, atol=ATOL, rtol=RTOL)
    full = res[0][1]["memory"]["host"]["master"]  # fraction 0: nothing on the host
    assert full == 0 and res[0][0]["memory"]["device"]["optimizer_state"] > 0


# ------------------------------------------------------------------- estimate
def test_estimate_moves_the_state_to_the_device_by_the_fraction():
    n = 10**9
    whole = estimate_with_fraction(n, compute_dtype="bf16", offload_fraction=1.0)
    assert whole == estimate(n, compute_dtype="bf16") | {"offload_fraction": 1.0}
    half = estimate_with_fraction(n, compute_dtype="bf16", offload_fraction=0.5,
                                  grad_accumulation=True)
    assert half["host"]["master"] == 4 * n // 2 and half["host"]["exp_avg"] == 4 * n // 2
    assert half["device"]["optimizer_state"] == (12 + 4) * n // 2  # + the fp32 sum
    assert half["device"]["grad_resident"] == 2 * n // 2
    none = estimate_with_fraction(n, compute_dtype="bf16", offload_fraction=0.0,
                                  world_size=4, delayed_update=True)
    assert none["host_total"] == 0 and none["device"]["grad_resident"] == 2 * 2 * n // 4
    with pytest.raises(ValueError, match="offload_fraction 1.5: must be from 0 to 1"):
        estimate_with_fraction(n, offload_fraction=1.5)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "acc.yaml"))


def test_estimate_says_what_auto_would_pick(clean_env, capsys):
    n, gpu = 10**9, 12 * 2**30
    assert main(["estimate", "--params", "1B", "--gpu_memory", "12GiB", "--offload_fraction",
                 "auto", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    peak = estimate(n, compute_dtype="bf16", pinned=True)["device_total"]  # all on the host
    budget = int(gpu * (1 - SAFETY_MARGIN)) - peak
    on_device = budget // (12 + 2)
    assert got["auto"]["fraction"] == pytest.approx(1 - on_device / n)
    assert 0 < got["auto"]["fraction"] < 1
    assert got["report"]["device"]["optimizer_state"] == pytest.approx(12 * on_device, rel=1e-6)
    assert main(["estimate", "--params", "1B", "--gpu_memory", "12GiB",
                 "--offload_fraction", "auto"]) == 0
    out = capsys.readouterr().out
    assert "offload_fraction auto would keep 0." in out and "(--gpu_memory)" in out
    assert main(["estimate", "--params", "1B", "--offload_fraction", "auto"]) == 0
    assert "give --gpu_memory to see what it would pick" in capsys.readouterr().out
    assert main(["estimate", "--params", "1B", "--offload_fraction", "half"]) == 2
    assert "'offload_fraction': 'half' is not allowed" in capsys.readouterr().err


# ------------------------------------------------------------- with other modes
def test_a_bf16_master_keeps_fp32_state_in_the_device_buckets(torch_one_thread, make_engine):
    # master_dtype applies to the host buckets only: a device bucket's state is fp32
    # (docs/design.md, "Device buckets"), so its update rounds to the bf16 param directly
    model = tiny_gpt2()  # every param trained (the engine leaves frozen ones in fp32)
    opt = make_engine(model, compute_dtype="bf16", master_dtype="bf16", offload_fraction="0.5")
    dev = set(_on_device(opt))
    assert 0 < len(dev) < len(opt.buckets)
    for b in opt.buckets:
        assert b.state.master.dtype == (torch.float32 if b.layout.index in dev
                                        else torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    for x in batches(2):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    changed = [not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())]
    assert all(changed)  # every param, in both kinds of bucket, was updated
    host = opt.memory_report()["host"]
    assert host["master"] == 2 * sum(b.layout.shard for b in opt.buckets
                                     if b.layout.index not in dev)
