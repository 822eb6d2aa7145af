"""The engine's copy ordering, checked on the CPU: every run through `AsyncCopier` (copies on a
worker thread with random delays, tests/offload/_async_copier.py) must be bitwise the run
through the default `HostCopier` (copies at once). A missing `wait_landed` / `wait_uploaded` /
forward wait reads stale or half-written buffers there and the results part.

The async runs also take CUDA's data path (`installed(cuda_path=True)`): the CPU-Adam writes
the new params over the bucket's 16-bit grads and `to_params` / `to_flat` upload them (params
that got no grad included: the head gets one on even steps only), where the CPU engine would
write the params in place. The reference is the engine as it runs on the CPU."""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch

from hf_zoffload.offload.delayed import DelayedUpdate
from hf_zoffload.offload.hooks import ModuleWaits
from hf_zoffload.offload.state import Bucket
from tests.offload import _dp_worker as w
from tests.offload._async_copier import AsyncCopier, installed, synchronize

BUCKET_MB = 0.004  # ~2k elements: 6 buckets on the worker's model, some params split


def _host(opt):
    return [t.clone() for b in opt.buckets
            for t in (b.state.master, b.state.exp_avg, b.state.exp_avg_sq)]


def _train(*, seed=None, steps, accum=1, poison=(), **plugin):
    """``steps`` steps of ``accum`` micro-steps on the worker's model (a frozen layer, a
    head that gets a grad on even steps only), clipped; ``poison``: (step, micro) pairs
    whose grads get an inf. A snapshot after every step: losses, params, grad norm,
    skipped, loss scale, and the host state unless a delayed update is still running."""
    data = w.batches(steps * accum)
    with installed(seed) if seed is not None else contextlib.nullcontext([]) as made:
        model, opt = w.build(bucket_size_mb=BUCKET_MB, **plugin)
        assert len(opt.buckets) >= 5
        inf = {"on": False}
        model.up.weight.register_hook(
            lambda g: g.index_fill(0, torch.tensor([3]), float("inf")) if inf["on"] else g)
        trace = []
        for step in range(steps):
            losses = []
            for micro in range(accum):
                inf["on"] = (step, micro) in poison
                loss = model(data[step * accum + micro], extra_rows=2 * (step % 2 == 0),
                             extra_weight=1.0)
                opt.backward(loss / accum)
                losses.append(loss.item())
            opt.clip_grad_norm_(w.MAX_NORM)
            opt.step()
            opt.zero_grad()  # what loops do next: must not wait for a delayed update
            synchronize(opt)
            trace.append({"losses": losses, "norm": opt.grad_norm,
                          "skipped": opt.last_step_skipped, "scale": opt.loss_scaler.loss_scale,
                          "params": [p.detach().clone() for p in model.parameters()],
                          "host": None if opt.update_in_flight else _host(opt)})
        opt.flush()
        synchronize(opt)
        trace.append({"params": [p.detach().clone() for p in model.parameters()],
                      "host": _host(opt)})
        counts = dict(made[0].counts) if made else {}
    return trace, counts


def _same(a, b, where="") -> None:
    """Bitwise: tensors with torch.equal, floats with == (nan equal to nan)."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"differs at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _compare(seed, **run):
    ref, _ = _train(**run)
    got, counts = _train(seed=seed, **run)
    _same(got, ref, "step")
    # the copies really went through the worker, uploads included
    assert counts["to_host"] > 0 and counts["to_params"] > 0 and counts["chunked"] > 0, counts
    return ref


# ------------------------------------------------------------------ the copier itself
def test_copier_reads_stale_without_a_wait_and_relays_errors():
    c = AsyncCopier(seed=0)
    try:
        dst, src = torch.zeros(8), torch.arange(8.0)
        with c.hold():  # the worker starts nothing: a read now is a read without a wait
            c.to_host(0, dst, src)
            assert torch.equal(dst, torch.zeros(8))
            buf = c.device_buffer(0, 8, torch.float32, lambda: dst, zero=False)
            assert buf is not dst and buf.isnan().all()
        c.wait_landed(0)
        assert torch.equal(dst, src)
        up = torch.zeros(4)
        c.to_flat(1, up, torch.ones(4))
        c.finish_uploads()  # lazy: the compute stream waits at the next forward
        c.compute_wait()
        assert torch.equal(up, torch.ones(4))
        c.to_host(2, torch.zeros(3), torch.ones(5))  # fails on the worker
        with pytest.raises(RuntimeError, match="worker thread failed") as err:
            c.wait_landed(2)
        assert isinstance(err.value.__cause__, RuntimeError)
        with pytest.raises(RuntimeError, match="worker thread failed"):
            c.to_host(3, dst, src)  # sticky, as a CUDA error
    finally:
        with contextlib.suppress(RuntimeError):
            c.close()
    assert not c._thread.is_alive()


# --------------------------------------------------- the engine, one process
@pytest.mark.parametrize("dtype,state", [("bf16", "fp32"), ("fp32", "fp32"), ("bf16", "bf16"),
                                         ("bf16", "int8")])
def test_one_process_bitwise_through_async_copier(dtype, state):
    _compare(1, steps=4, compute_dtype=dtype, state_dtype=state)


def test_accumulation_bitwise_through_async_copier():
    _compare(2, steps=3, accum=3, compute_dtype="bf16")


def test_fp16_overflow_bitwise_through_async_copier():
    ref = _compare(3, steps=4, accum=2, poison={(1, 1)}, compute_dtype="fp16",
                   init_scale=2.0**10, hysteresis=1)
    assert [s["skipped"] for s in ref[:-1]] == [False, True, False, False]


@pytest.mark.parametrize("state", ["fp32", "int8"])
def test_a_late_delayed_update_reads_only_what_its_step_planned(monkeypatch, state):
    """The background step starts only after step() has returned and the next window has
    begun (window reset, hooks writing the other buffer set): it must read nothing of the
    engine's per-window state. (Which slots got a grad was once read there: the new
    params of the slots that got none were then written over grads not yet read.)"""
    ref, _ = _train(steps=5, compute_dtype="bf16", delayed_update=True,
                    delayed_update_warmup_steps=1, state_dtype=state)
    real = DelayedUpdate.start

    def late(self, fn, **kwargs):
        return real(self, lambda: (time.sleep(0.05), fn()), **kwargs)

    monkeypatch.setattr(DelayedUpdate, "start", late)
    got, _ = _train(steps=5, compute_dtype="bf16", delayed_update=True,
                    delayed_update_warmup_steps=1, state_dtype=state)
    _same(got, ref, "step")


@pytest.mark.parametrize("state", ["fp32", "int8"])
def test_delayed_update_bitwise_through_async_copier(state):
    ref = _compare(4, steps=5, accum=2, compute_dtype="bf16", delayed_update=True,
                   delayed_update_warmup_steps=1, state_dtype=state)
    assert [s["host"] is None for s in ref[:-1]] == [False] + [True] * 4  # it overlapped


@pytest.mark.parametrize("delayed", [False, True])
def test_fp32_compute_uploads_from_the_pinned_landing_buffer(monkeypatch, delayed):
    """fp32 compute where the landing buffers are pinned (CUDA): the new master is copied
    into the landing buffer and every upload reads it from there, never the pageable master
    (a blocking, driver-staged copy); bitwise the CPU engine's run."""
    run = dict(steps=4, compute_dtype="fp32", delayed_update=delayed,
               delayed_update_warmup_steps=1)
    ref, _ = _train(**run)
    filled, sources = set(), []
    real_fill = Bucket.fill_from_master

    def fill(self, out):
        copied = real_fill(self, out)
        if copied:
            filled.add(out.data_ptr())
        return copied

    real_up = AsyncCopier.to_params

    def to_params(self, key, layout, src):
        sources.append(src.data_ptr())
        return real_up(self, key, layout, src)

    monkeypatch.setattr(Bucket, "landing_pinned", True)  # for the run below: as on CUDA
    monkeypatch.setattr(Bucket, "fill_from_master", fill)
    monkeypatch.setattr(AsyncCopier, "to_params", to_params)
    got, counts = _train(seed=6, **run)
    _same(got, ref, "step")
    assert counts["to_params"] > 0 and sources and set(sources) <= filled


# ------------------------------------------------------------ 2 gloo ranks
@pytest.mark.slow
def test_two_ranks_bitwise_through_async_copier(tmp_path):
    """Accumulation with all three boundary styles (no_sync, every micro-step, step()
    reduces), clipping, a param with a grad on one rank only, the delayed update, and an
    fp16 overflow on one rank: each run once per copier, in one spawn."""
    runs = {"bf16": ("train", {"stop": 5, "plugin": {"compute_dtype": "bf16",
                                                     "bucket_size_mb": BUCKET_MB}}),
            "dpu": ("train", {"stop": 5, "plugin": {
                "compute_dtype": "bf16", "bucket_size_mb": BUCKET_MB, "delayed_update": True,
                "delayed_update_warmup_steps": 1}}),
            "overflow": ("overflow", {})}
    jobs = [("with_copier", {"job": job, "copier": copier})
            for job in runs.values() for copier in (None, {"seed": 5})]
    codes, _, res, errs = w.spawn("runs", str(tmp_path), jobs=jobs, wait_s=180.0)
    assert codes == [0, 0], "\n".join(errs)
    for rank in res:
        for i, name in enumerate(runs):
            ref, got = rank[2 * i], rank[2 * i + 1]
            assert (ref["copier"], got["copier"]) == ("HostCopier", "AsyncCopier")
            assert got["copier_jobs"] > 0
            for key in ("losses", "norms", "params", "host", "skipped", "scale"):
                if key in ref:
                    _same(got[key], ref[key], f"{name}.{key}")
    assert res[0][5]["skipped"] == [False, False, True, False]
    for a, b in zip(res[0][1]["params"], res[1][1]["params"]):
        assert torch.equal(a, b)


# ------------------------------------------- uploads in forward order, per-module waits
def _no_sync_loop(steps, *, slow_bucket=None, module_waits=True, monkeypatch=None, seed=6):
    """``steps`` steps with no host sync between them (the next forward follows step() at
    once, as in training); ``slow_bucket``: its uploads take 0.3 s more. Returns the losses,
    the final params, the upload order of the last step and, for each forward after a step,
    whether some upload was still running when the first module (the embedding) computed."""
    data = w.batches(steps)
    if slow_bucket is not None:
        real = AsyncCopier._copy_to_params

        def slow(self, layout, src):
            if layout.index == slow_bucket:
                time.sleep(0.3)
            real(self, layout, src)

        monkeypatch.setattr(AsyncCopier, "_copy_to_params", slow)
    if not module_waits:  # only the waits after the model's forward and at step() stay
        monkeypatch.setattr(ModuleWaits, "before", lambda self, m: (
            self.copier.finish_uploads() if m is None else None))
    with installed(seed) if slow_bucket is not None else contextlib.nullcontext([]) as made:
        model, opt = w.build(bucket_size_mb=BUCKET_MB, compute_dtype="bf16")
        overlapped, uploads = [], []
        if made:
            c = made[0]
            model.emb.register_forward_hook(
                lambda *a: overlapped.append(c._done < c._queued))
            real_to_params = c.to_params
            c.to_params = lambda key, *a: (uploads.append(key), real_to_params(key, *a))[1]
        losses = []
        for step in range(steps):
            uploads.clear()
            loss = model(data[step], extra_rows=2, extra_weight=1.0)
            losses.append(loss.item())
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        synchronize(opt)
        return losses, [p.detach().clone() for p in model.parameters()], uploads, overlapped


def test_uploads_go_in_forward_order_and_the_first_layers_compute_meanwhile(monkeypatch):
    """After the re-layout (step 1) bucket 0 holds the head (its grads arrive first): it is
    updated and uploaded last, and the next forward's embedding computes while it is still
    on its way. Every module waited for its own params: bitwise the host engine's run."""
    ref_losses, ref_params, _, _ = _no_sync_loop(4)
    losses, params, uploads, overlapped = _no_sync_loop(4, slow_bucket=0,
                                                        monkeypatch=monkeypatch)
    assert uploads == sorted(uploads, reverse=True) and uploads[-1] == 0
    assert overlapped[2:] == [True, True]  # steps 3, 4: the layout is the arrival order
    _same(losses, ref_losses, "losses")
    _same(params, ref_params, "params")


def test_without_the_module_waits_a_forward_reads_half_uploaded_params(monkeypatch):
    """The same run with each module's wait removed: the head is read before its upload
    has landed, and the losses part from the host engine's."""
    _, ref_params, _, _ = _no_sync_loop(4)
    _, params, _, overlapped = _no_sync_loop(4, slow_bucket=0, module_waits=False,
                                             monkeypatch=monkeypatch)
    assert overlapped[2:] == [True, True]
    assert not all(torch.equal(a, b) for a, b in zip(params, ref_params))
