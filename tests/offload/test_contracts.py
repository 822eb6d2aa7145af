"""The interfaces' contracts, which every implementation must keep: each `Transport` and
`Streams` of hf_zoffload/offload/copier.py (the CPU's, the suite's asynchronous stand-in, a
device bucket's resident transport over either) and each `Exchange` the mode resolver builds
(one process, data parallel, tensor parallel, FSDP2; in one process, over one-rank gloo
groups). Each test states one promise of the interface's docstrings and drives the
implementation through the interface only: a new implementation is added to the lists below
and must pass them all."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from hf_zoffload.config import ZeroOffloadPlugin
from hf_zoffload.offload.copier import HostCopier, ResidentTransport
from hf_zoffload.offload.engine import ZeroOffloadOptimizer
from tests.offload import _dp_worker as dpw
from tests.offload import _fsdp2_worker as fw
from tests.offload import _tp_worker as tw
from tests.offload._async_copier import AsyncCopier

ODD = 1237  # elements: no power of two, no multiple of a vector width


# ------------------------------------------------------------------ copiers
def _host():
    return HostCopier(threads=2)


def _async():
    return AsyncCopier(seed=7, max_delay_s=0.002)


# (name, make the streams object, make the transport over it)
STACKS = {
    "host": (_host, lambda s: s),
    "async stand-in": (_async, lambda s: s),
    "resident over host": (_host, ResidentTransport),
    "resident over async stand-in": (_async, ResidentTransport),
}


@pytest.fixture(params=list(STACKS))
def stack(request):
    make, over = STACKS[request.param]
    streams = make()
    yield streams, over(streams)
    if isinstance(streams, AsyncCopier):
        streams.close()


def _settle(streams) -> None:
    """The copies done before a test reads a "device" tensor (the stand-in's worker)."""
    if isinstance(streams, AsyncCopier):
        streams.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_to_host_lands_by_wait_landed_and_the_source_may_go(stack, dtype):
    streams, t = stack
    src = torch.randn(ODD).to(dtype)
    want = src.clone()
    dst = torch.full((ODD,), -1.0).to(dtype)
    t.to_host(3, dst, src)
    del src  # the caller drops it at once: the copy must not need it after
    t.wait_landed(3)
    assert torch.equal(dst, want)


def test_device_buffer_has_the_size_dtype_and_zeros_asked(stack):
    _, t = stack
    host = torch.full((ODD,), 5.0, dtype=torch.bfloat16)
    buf = t.device_buffer(0, ODD, torch.bfloat16, lambda: host, zero=True)
    assert buf.shape == (ODD,) and buf.dtype == torch.bfloat16 and not buf.any()
    raw = t.device_buffer(1, 17, torch.float16, lambda: torch.empty(17, dtype=torch.float16),
                          zero=False)
    assert raw.shape == (17,) and raw.dtype == torch.float16


def test_after_landed_runs_after_the_landing_and_before_the_next_copy_and_wait(stack):
    """The fold of a micro-step: ``fn`` sees the landed values; the next `to_host` into the
    same buffer waits for it, and `wait_landed` returns only once it ran."""
    streams, t = stack
    first, second = torch.randn(ODD), torch.randn(ODD)
    landing, acc = torch.zeros(ODD), torch.zeros(ODD)
    t.to_host(2, landing, first.clone())
    t.after_landed(2, lambda: acc.copy_(landing))
    t.to_host(2, landing, second.clone())  # overwrites what fn reads: after fn
    t.wait_landed(2)
    assert torch.equal(acc, first) and torch.equal(landing, second)


def test_to_device_may_be_added_to_at_once(stack):
    _, t = stack
    host = torch.randn(ODD)
    want = host + 1.0
    buf = t.to_device(4, host)
    buf.add_(1.0)  # the compute stream adds into it straight away
    assert torch.equal(buf, want)


def _layout(numel: int = ODD):
    """A one-bucket layout over two params of odd sizes (whole, world 1)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel)), torch.nn.Parameter(torch.randn(31, 3))]
    opt = ZeroOffloadOptimizer(params, plugin=ZeroOffloadPlugin(bucket_size_mb=64,
                                                                compute_dtype="bf16"))
    (b,) = opt.buckets
    return b.layout, params


def _assert_params(lay, src) -> None:
    """Each param of ``lay`` holds its elements of ``src`` (bucket elements from
    ``lay.start``)."""
    for s in lay.slots:
        a = s.offset - lay.start
        assert torch.equal(s.flat(), src[a:a + s.numel]), s.index


def test_to_params_is_read_by_a_forward_after_wait_ready_and_the_source_freed_by_wait_uploaded(
        stack):
    streams, t = stack
    lay, params = _layout()
    src = torch.randn(lay.shard).to(torch.bfloat16)
    want = src.clone()
    t.to_params(lay.index, lay, src)
    streams.mark_ready(lay.index)
    t.wait_uploaded(lay.index)
    src.fill_(float("nan"))  # the host may overwrite the source now
    streams.wait_ready([lay.index])  # a module's forward waits for its bucket
    _settle(streams)
    _assert_params(lay, want)


def test_to_flat_fills_a_side_buffer_by_wait_uploaded(stack):
    streams, t = stack
    dst = streams.side_buffer(ODD, torch.float32)
    assert dst.shape == (ODD,) and dst.dtype == torch.float32
    src = torch.randn(ODD)
    want = src.clone()
    t.to_flat(5, dst, src)
    t.wait_uploaded(5)
    src.zero_()
    with streams.side():  # side-stream work queued after the copy reads it whole
        seen = dst.clone()
    assert torch.equal(seen, want)


def test_queue_on_side_reads_what_the_uploads_before_it_wrote(stack):
    """`Streams.queue_on_side`: behind everything on the side stream so far."""
    streams, t = stack
    lay, params = _layout()
    src = torch.randn(lay.shard).to(torch.bfloat16)
    t.to_params(lay.index, lay, src)
    outs = [torch.empty(s.numel, dtype=torch.bfloat16) for s in lay.slots]
    streams.queue_on_side(lambda: [o.copy_(s.flat()) for o, s in zip(outs, lay.slots)])
    _settle(streams)
    for o, s in zip(outs, lay.slots):
        assert torch.equal(o, src[s.offset - lay.start:s.offset - lay.start + s.numel])


def test_stream_wide_calls_keep_their_types(stack):
    streams, _ = stack
    assert isinstance(streams.finish_uploads(), float) and streams.finish_uploads() >= 0
    assert isinstance(streams.device_times(), dict)
    assert isinstance(streams.forwards_wait(), bool)
    assert isinstance(streams.updates_in_place(False), bool)
    assert streams.updates_in_place(True) is False  # a delayed update never writes params
    streams.join_side()
    streams.wait_ready([])


# ---------------------------------------------------------------- exchanges
def _plain_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Linear(13, 5))


def _tp_model():
    model = tw.Model()
    parallelize_module(model, init_device_mesh("cpu", (1,)), tw.PLAN)
    return model


def _plugin():
    return ZeroOffloadPlugin(bucket_size_mb=0.0005, compute_dtype="bf16")  # several buckets


MODES = {  # name -> (needs a process group, build (model, optimizer))
    "one process": (False, lambda: (m := _plain_model(), ZeroOffloadOptimizer(
        m.parameters(), plugin=_plugin()))),
    "data parallel": (True, lambda: (m := _plain_model(), ZeroOffloadOptimizer(
        m.parameters(), plugin=_plugin(), process_group=dist.group.WORLD))),
    "tensor parallel": (True, lambda: (m := _tp_model(), ZeroOffloadOptimizer(
        tw.decay_groups(m), plugin=_plugin()))),
    "FSDP2": (True, lambda: (m := fw.shard(fw.Net(), 1), ZeroOffloadOptimizer(
        m.parameters(), plugin=_plugin(), model=m))),
}


@pytest.fixture(params=list(MODES))
def engine(request):
    grouped, build = MODES[request.param]
    with dpw.one_rank() if grouped else contextlib.nullcontext():
        model, opt = build()
        yield opt


def _backward(opt, grads: dict[int, torch.Tensor]) -> None:
    """One backward driven through the exchange alone: each bucket opened, every slot's
    grad written as a hook would, flushed, the window ended."""
    ex = opt.exchange
    ex.begin_backward()
    for b in opt.buckets:
        ex.open(b)
        for i, s in enumerate(b.layout.slots):
            b.window.pending[s.offset:s.offset + s.numel].copy_(grads[s.index])
            b.window.arrive(i)
        ex.send(b)
    ex.end_backward(True)
    ex.end_window()
    for b in opt.buckets:
        opt.copier.of(b).wait_landed(b.layout.index)


def _grads(opt) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {s.index: torch.randn(s.numel, generator=g).to(opt.dtype)
            for b in opt.buckets for s in b.layout.slots}


def test_a_flushed_bucket_lands_its_shard_once(engine):
    """open -> hooks write -> flush: after `wait_landed` the window's landed buffer holds
    this rank's shard of what the hooks wrote (the whole bucket, one rank), once per
    backward; the window is ready for the next backward."""
    opt = engine
    grads = _grads(opt)
    _backward(opt, grads)
    for b in opt.buckets:
        w, lay = b.window, b.layout
        assert w.landed == 1 and w.pending is None and w.arrived == 0
        for s in lay.slots:
            own, mine = lay.owned(s)
            assert torch.equal(w.last[own], grads[s.index][mine]), (lay.index, s.index)


def test_share_stats_is_the_same_numbers_on_one_rank_and_keeps_present(engine):
    opt = engine
    _backward(opt, _grads(opt))
    before = [list(b.window.present) for b in opt.buckets]
    assert all(all(p) for p in before)
    flag, total = opt.exchange.share_stats(0.0, 6.0, 2.0)
    assert (flag, total) == (0.0, 8.0)  # one rank: sum of both kinds, one copy each
    assert [list(b.window.present) for b in opt.buckets] == before


def test_publish_writes_the_params_and_marks_them_ready(engine):
    opt = engine
    ex, streams = opt.exchange, opt.copier.streams
    news = {}
    for b in opt.buckets:
        src = torch.randn(b.layout.shard).to(opt.dtype)
        news[b.layout.index] = src.clone()
        ex.publish(b, src)
    ex.finish_publish()
    streams.wait_ready([b.layout.index for b in opt.buckets])
    streams.finish_uploads()
    for b in opt.buckets:
        lay = b.layout
        for s in lay.slots:
            own, mine = lay.owned(s)
            assert torch.equal(s.flat()[mine], news[lay.index][own]), (lay.index, s.index)


def test_gather_whole_tensors_and_local_part_are_inverse(engine):
    """A checkpoint's path: `gather` (this rank's shards -> the bucket on the saving rank),
    `Span.whole_tensors` (-> param-shaped tensors), `Span.local_part` (back)."""
    opt = engine
    ex = opt.exchange
    parts = []
    for b in opt.buckets:
        shards = [torch.randn(b.layout.shard), torch.randn(b.layout.shard)]
        got = ex.gather(b, shards, to=0)
        assert got is not None and ex.span.keeps_gathered(0)
        assert all(torch.equal(g.cpu()[:b.layout.shard], s) for g, s in zip(got, shards))
        parts += [(s, [t.cpu()[s.offset:s.offset + s.numel] for t in got])
                  for s in b.layout.slots]
    parts.sort(key=lambda x: x[0].index)
    whole = ex.span.whole_tensors(parts)
    for (s, ts), ws in zip(parts, whole):
        for t, w in zip(ts, ws):
            assert w.shape == s.param.shape
            assert torch.equal(ex.span.local_part(s, w), t)


def test_layout_facts_agree(engine):
    ex = engine.exchange
    assert 0 <= ex.rank < ex.world and isinstance(ex.spans_ranks, bool)
    assert isinstance(ex.sent, dict) and all(v >= 0 for v in ex.sent.values())
    assert ex.first_rank_order([3, 1, 2]) == [3, 1, 2]
    b = engine.buckets[0]
    shards = [torch.arange(b.layout.shard, dtype=torch.float32)]
    assert torch.equal(ex.gather_all(b, shards)[0][:b.layout.shard], shards[0])
