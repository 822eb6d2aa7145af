"""Long host passes say what they do: before, during (past 5 s) and after."""

import logging

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.offload.progress import Progress
from tests._tiny import batches, tiny_llama

GiB = 2**30


def test_progress_lines_only_past_the_interval(caplog):
    now = [100.0]
    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        p = Progress(log, "moving things", 4 * GiB, detail="8 buckets", clock=lambda: now[0])
        now[0] += 1.0
        p.at(1 * GiB)  # 1 s in: quiet
        now[0] += 5.0
        p.at(2 * GiB)  # 6 s in: a line
        now[0] += 2.0
        p.at(3 * GiB)  # 2 s after the last line: quiet
        now[0] += 2.0
        assert p.done("8 buckets now") == 10.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "ZeRO-Offload: moving things: 4.00 GiB (8 buckets)",
        "ZeRO-Offload: moving things: 2.00 GiB of 4.00 GiB (50%), 6 s",
        "ZeRO-Offload: moving things: done, 4.00 GiB in 10.00 s (0.40 GiB/s); 8 buckets now"]


def test_the_engine_logs_its_allocation_and_the_relayout(caplog):
    model = tiny_llama()
    with caplog.at_level(logging.INFO, logger="hf_zoffload"):
        opt = ZeroOffloadOptimizer(model.parameters(), plugin=ZeroOffloadPlugin(
            compute_dtype="bf16", bucket_size_mb=0.01))
        ids = batches(1)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    lines = [r.getMessage() for r in caplog.records if "ZeRO-Offload: " in r.getMessage()]
    alloc = [m for m in lines if "allocating the host state" in m]
    moved = [m for m in lines if "gradient arrival order" in m]
    host = sum(sum(b.state.nbytes().values()) for b in opt.buckets) + \
        sum(opt.host_pool.held().values())
    assert len(alloc) == 2 and "grad landing buffers" in alloc[0] and "done" in alloc[1]
    assert f"{host} B" in alloc[0] or f"{host / 1024:.2f} KiB" in alloc[0], (host, alloc)
    assert len(moved) == 2 and "done" in moved[1] and opt.relayout_seconds is not None
