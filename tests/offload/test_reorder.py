"""Buckets follow the first backward's gradient arrival order from the second step on
(hf_zoffload/offload/reorder.py): the re-layout moves the host state exactly, in every
state_dtype, and checkpoints carry the order."""

from __future__ import annotations

import gc
import io
import weakref

import pytest
import torch

from hf_zoffload.offload import reorder as reorder_mod
from tests._tiny import MODELS, batches, decay_groups

LR = 3e-3


# make_engine's defaults here (tests/_fixtures.py): fp32, buckets of ~1.5k elements
ENGINE_DEFAULTS = dict(lr=LR, compute_dtype="fp32", bucket_size_mb=0.006)


def _flushes(opt):
    """Bucket indices in the order the exchange flushes them, per backward (appended)."""
    order, send = [], opt.exchange.send
    opt.exchange.send = lambda b: (order.append(b.layout.index), send(b))[1]
    return order


def _arrivals(model, opt, ids):
    """Param indices in the order their grads reach the engine in one backward."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    seen = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: seen.append(index[id(p)]))
               for p in model.parameters() if p.requires_grad]
    model(input_ids=ids, labels=ids).loss.backward()
    for h in handles:
        h.remove()
    opt.zero_grad()
    return seen


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_after_the_first_step_buckets_complete_in_index_order(name, make_engine):
    """The optimizer's order with the Trainer's groups puts every layer's norms and biases
    in the first bucket (it completes last); Llama's registration order puts input norms
    one bucket late. From the second backward on, every bucket completes in index order."""
    ids = batches(1)[0]
    model = MODELS[name]()
    opt = make_engine(decay_groups(model))
    first = [s.index for s in reversed([s for b in opt.buckets for s in b.layout.slots])]
    assert opt.bucket_order != _arrivals(model, opt, ids)  # a wrong guess to start from
    flushed = _flushes(opt)
    model(input_ids=ids, labels=ids).loss.backward()
    before = list(flushed)
    assert before != sorted(before)
    opt.step()
    opt.zero_grad()
    assert opt.bucket_order == _arrivals(model, opt, ids)
    assert sorted(opt.bucket_order) == sorted(first)
    flushed.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    assert flushed == list(range(len(opt.buckets)))
    assert opt.relayout_seconds is not None


def _steps(model, opt, data):
    """Params after each step, no clipping (the norm's sum order follows the buckets)."""
    out = []
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("state", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_the_move_is_exact_in_every_state_dtype(state, compute, make_engine):
    """A run that re-lays out after step 1 is bitwise a run built in the final order from
    the start (its order set before any step): params every step, and the host state per
    param (masters and the moments as stored: 8-bit codes and scales included)."""
    data = batches(4)
    runs, order = [], None
    for preset in (False, True):
        model = MODELS["llama"]()
        opt = make_engine(decay_groups(model), state_dtype=state, compute_dtype=compute)
        if preset:
            opt.set_bucket_order(order)
            assert opt.relayout_seconds is not None  # moved here, before any step
            opt.order.relayout_seconds = None
        params = _steps(model, opt, data)
        if not preset:
            order = opt.bucket_order
            assert opt.relayout_seconds is not None and order != sorted(order, reverse=True)
        else:
            assert opt.relayout_seconds is None  # nothing moved during training
        stored = {}
        for b in opt.buckets:
            for s in b.layout.slots:
                own, _ = b.layout.owned(s)
                st = b.state
                stored[s.index] = [st.master[own].clone(), st.exp_avg[own].clone(),
                                   st.exp_avg_sq[own].clone()]
                if st.scales is not None:
                    q = 256
                    stored[s.index] += [t[own.start // q:-(-own.stop // q)].clone()
                                        for t in st.scales]
        runs.append((params, stored))
    (pa, sa), (pb, sb) = runs
    for step_a, step_b in zip(pa, pb):
        for a, b in zip(step_a, step_b):
            assert torch.equal(a, b)
    assert sa.keys() == sb.keys()
    for k in sa:
        for a, b in zip(sa[k], sb[k]):
            assert torch.equal(a, b), k


@pytest.mark.parametrize("state", ["fp32", "int8"])
def test_checkpoints_carry_the_order_and_resume_bitwise(state, make_engine):
    """The saved run's buckets come back at load, before any backward, and the resumed run
    continues bitwise as the uninterrupted one (8-bit codes land in the same blocks)."""
    data = batches(5)
    model = MODELS["llama"]()
    opt = make_engine(decay_groups(model), state_dtype=state, compute_dtype="bf16")
    _steps(model, opt, data[:2])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    rest = _steps(model, opt, data[2:])

    model2 = MODELS["llama"]()
    opt2 = make_engine(decay_groups(model2), state_dtype=state, compute_dtype="bf16")
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert ckpt["opt"]["zero_offload"]["bucket_order"] == opt.bucket_order
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.bucket_order == opt.bucket_order
    resumed = _steps(model2, opt2, data[2:])
    assert opt2.bucket_order == opt.bucket_order  # the first backward changed nothing
    for step_a, step_b in zip(rest, resumed):
        for a, b in zip(step_a, step_b):
            assert torch.equal(a, b)


def test_an_adamw_checkpoint_keeps_recording(make_engine):
    """A checkpoint without an order (torch's AdamW) leaves the first backward to decide."""
    model = MODELS["llama"]()
    opt = make_engine(decay_groups(model))
    ref = torch.optim.AdamW(decay_groups(model), lr=LR)
    opt.load_state_dict(ref.state_dict())
    guess = opt.bucket_order
    _steps(model, opt, batches(1))
    assert opt.bucket_order != guess


def test_a_bad_saved_order_is_refused_before_any_change(make_engine):
    model = MODELS["gpt2"]()
    opt = make_engine(decay_groups(model))
    _steps(model, opt, batches(1))
    sd = opt.state_dict()
    sd["zero_offload"]["bucket_order"] = "backwards"
    before = opt.bucket_order
    with pytest.raises(ValueError, match="bucket_order must be a list of param indices"):
        opt.load_state_dict(sd)
    assert opt.bucket_order == before


def test_delayed_update_starts_after_the_relayout(make_engine):
    """The first step is synchronous while the buckets still move (warm-up 0 asked)."""
    model = MODELS["gpt2"]()
    opt = make_engine(decay_groups(model), delayed_update=True, delayed_update_warmup_steps=0)
    data = batches(3)
    model(input_ids=data[0], labels=data[0]).loss.backward()
    opt.step()
    assert not opt.update_in_flight
    opt.zero_grad()
    model(input_ids=data[1], labels=data[1]).loss.backward()
    opt.step()
    assert opt.update_in_flight
    opt.flush()


def test_arrival_order_keeps_the_first_backward_and_completes_it():
    a = reorder_mod.ArrivalOrder()
    fill = [5, 4, 3, 2, 1, 0]
    assert a.order(fill) == fill  # nothing seen (a rank without grads): as it is
    for i in (2, 9, 2, 4):  # 9: not a param of this engine; repeats count once
        a.note(i)
    a.stop()
    a.note(0)  # a later backward changes nothing
    assert a.order(fill) == [2, 4, 5, 3, 1, 0]


def test_the_old_buckets_and_pool_are_freed(make_engine):
    """Nothing keeps the old host buffers (pinned on a GPU machine) alive after the move."""
    model = MODELS["llama"]()
    opt = make_engine(decay_groups(model), compute_dtype="bf16")
    pool, state = weakref.ref(opt.host_pool), weakref.ref(opt.buckets[0].state)
    _steps(model, opt, batches(1))
    gc.collect()
    assert opt.relayout_seconds is not None and pool() is None and state() is None


@pytest.mark.parametrize("delayed", [False, True])
def test_the_old_pool_is_gone_before_the_new_one_is_allocated(monkeypatch, delayed, make_engine):
    """The re-layout frees the old landing buffers (2 B/param, pinned on CUDA) before it
    allocates the new pool: nothing, the step's own plan included, holds a view of them by
    then. Storage weak references, no gc.collect(): refcounts alone must free them."""
    model = MODELS["llama"]()
    opt = make_engine(decay_groups(model), compute_dtype="bf16", delayed_update=delayed,
                      delayed_update_warmup_steps=0)
    old = [weakref.ref(b.state.grads.grad16.untyped_storage()) for b in opt.buckets]
    alive_at_alloc = []
    real = reorder_mod.HostPool._block

    def block(pool, nbytes):
        alive_at_alloc.append(sum(r() is not None for r in old))
        return real(pool, nbytes)

    monkeypatch.setattr(reorder_mod.HostPool, "_block", block)
    _steps(model, opt, batches(1))
    assert opt.relayout_seconds is not None and alive_at_alloc
    assert alive_at_alloc == [0] * len(alive_at_alloc), alive_at_alloc


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("state", ["int8", "int4"])
def test_zero_gaps_zeroes_exactly_what_no_param_covers(rank, state):
    """Everything outside the params' elements and their blocks' scales is zeroed; a 4-bit
    byte shared by a param's odd last element and the gap is the param's (its encode writes
    the whole byte)."""
    from hf_zoffload.offload.host import HostPool
    from hf_zoffload.offload.layout import Slot, build_layouts
    from hf_zoffload.offload.state import empty_state, zero_gaps
    from hf_zoffload.ops.moments import FORMATS

    fmt = FORMATS[state]
    slots = [Slot(None, i, 0, 0, n) for i, n in enumerate((5, 300, 7, 1000, 33, 256))]
    layouts = build_layouts(slots, bucket_numel=900, rank=rank, world=2, align=fmt.align)
    pool = HostPool(layouts, pin=False)
    assert len(layouts) > 1
    for lay in layouts:
        st = empty_state(lay, torch.bfloat16, pool=pool, state_dtype=state, zero=False)
        for t in (st.master, st.exp_avg, st.exp_avg_sq, *st.scales):
            t.fill_(7)
        zero_gaps(lay, st)
        for s in lay.slots:  # what the move writes: each param's elements, its blocks' scales
            own, _ = lay.owned(s)
            assert (st.master[own] == 7).all()
            st.master[own] = 0
            for t in (st.exp_avg, st.exp_avg_sq):
                assert (fmt.part(t, own.start, own.stop) == 7).all()
                fmt.part(t, own.start, own.stop).zero_()
            for t in st.scales:
                t[own.start // fmt.block:-(-own.stop // fmt.block)] = 0
        for t in (st.master, st.exp_avg, st.exp_avg_sq, *st.scales):
            assert (t == 0).all()
