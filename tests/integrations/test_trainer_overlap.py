"""``--zero_offload_overlap_step`` through ZeroOffloadTrainer: the overlapped schedule under
the Trainer's accumulation (accelerate's no_sync on all but the window's last micro-step),
clipping and logging, against the synchronous schedule on the same run."""

import pytest
import torch

from tests.integrations.test_trainer import COMMON, OnLog, column, gpt2, run


def _both(tmp_path, **kw):
    """The same run synchronous and overlapped: (sync logs, overlap trainer, overlap logs,
    the overlapped run's per-step entries as the callback saw them)."""
    sync, ref = run(tmp_path / "sync", gpt2(), offload=True, **kw)
    on_log = OnLog()
    ov, got = run(tmp_path / "overlap", gpt2(), offload=True, zero_offload_overlap_step=True,
                  callbacks=[on_log], **kw)
    assert ov.engine.schedule.name == "overlapped" and sync.engine.schedule.name == "synchronous"
    return sync, ref, ov, got, [e for e in on_log.seen if "loss" in e]


def test_without_clipping_the_overlapped_run_is_the_synchronous_one(tmp_path):
    """No clipping, fp32 compute: every early update stands and the run is bit for bit the
    synchronous one (losses, and the final weights)."""
    sync, ref, ov, got, seen = _both(tmp_path, max_grad_norm=0.0)
    assert column(got, "loss") == column(ref, "loss")
    for a, b in zip(sync.model.parameters(), ov.model.parameters()):
        assert torch.equal(a, b)
    # each window's last micro-step updated its buckets during backward, and every one stood
    assert ov.engine.schedule.speculated == COMMON["max_steps"] == ov.engine.schedule.hits
    assert all(e["hit_share"] == 1.0 and e["cpu_adam_early_ms"] > 0 for e in seen)
    assert all(e["correction_ms"] == 0.0 for e in seen)


def test_clipping_that_bites_corrects_and_logs_the_misses(tmp_path):
    """COMMON's max_grad_norm 0.5 clips every step (norms 0.84-1.44). --max_grad_norm is the
    engine's limit from the first step, and the first bucket's norm is already over it: each
    step's speculation ends before any update, so every step is a miss with nothing to undo,
    and the run is the synchronous one."""
    sync, ref, ov, got, seen = _both(tmp_path)
    assert min(column(ref, "grad_norm")) > COMMON["max_grad_norm"]  # every step clipped
    sched = ov.engine.schedule
    assert (sched.hits, sched.speculated) == (0, COMMON["max_steps"])
    assert [e["hit_share"] for e in seen] == [0.0] * COMMON["max_steps"]
    assert all(e["cpu_adam_early_ms"] == e["correction_ms"] == 0.0 for e in seen)
    assert column(got, "loss") == column(ref, "loss")
    for a, b in zip(sync.model.parameters(), ov.model.parameters()):
        assert torch.equal(a, b)


def test_clipping_that_binds_sometimes_has_hits_and_misses(tmp_path):
    """max_grad_norm 1.0 against norms 0.84-1.44: the steps under it speculate and stand
    (bit for bit the synchronous update); over it, speculation ends at the bucket whose
    partial norm passes 1.0, and the buckets updated before it are undone and redone: within
    the fp32 rounding of a corrected step (docs/protocols/step.md, "The correction bound")."""
    sync, ref, ov, got, seen = _both(tmp_path, max_grad_norm=1.0)
    norms = column(ref, "grad_norm")
    assert min(norms) < 1.0 < max(norms)
    sched = ov.engine.schedule
    assert (sched.hits, sched.speculated) == (sum(n < 1.0 for n in norms), len(norms))
    assert seen[-1]["hit_share"] == pytest.approx(sched.hits / sched.speculated, abs=1e-4)
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-5)
    for a, b in zip(sync.model.parameters(), ov.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
