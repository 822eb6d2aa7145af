"""bench_offload.py (CPU) and bench_trainer.py time what they compare in rounds
(scripts/bench/_interleave.py): the engine step against the bare kernel, the stock Trainer against
--zero_offload, the order alternating, each ratio the median of per-round ratios."""

import re
import runpy
import sys
import types
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "bench"


def _load(name, monkeypatch):
    """The script's globals (main() not run), the ones its functions see: run_path returns a
    copy of them."""
    monkeypatch.setattr(sys, "path", sys.path[:])  # the scripts put their folder on the path
    return runpy.run_path(str(SCRIPTS / name))["main"].__globals__


def _spy(module, seen):
    real = module["il"]

    def interleave(rows, rounds, **kw):
        seen.append(([name for name, _ in rows], rounds))
        return real.interleave(rows, rounds, **kw)
    module["il"] = types.SimpleNamespace(interleave=interleave, SelfTimed=real.SelfTimed)


def test_trainer_pairs_alternate_which_run_goes_first(monkeypatch, capsys):
    bench = _load("bench_trainer.py", monkeypatch)
    calls = []

    def one(steps, offload, out):  # offload 10% faster, the machine slower every run
        calls.append((steps, offload))
        return (9.0 if offload else 10.0) * (1 + 0.5 * len(calls))

    bench["one"] = one
    bench["main"](["--steps", "7", "--pairs", "3"])
    assert calls == [(4, False), (4, True)] + [(7, o) for o in (False, True, True, False,
                                                                 False, True)]
    out = capsys.readouterr().out
    pairs = re.findall(r"^\| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out, re.M)
    assert [p[0] for p in pairs] == ["0", "1", "2"]
    # pair 1 ran offload first (the 5th call of 8, warm-ups included) and stock after it
    assert pairs[1][1:] == ("40.00", "31.50", f"{31.5 / 40:.3f}")
    ratios = sorted(9 * (1 + 0.5 * o) / (10 * (1 + 0.5 * s)) for s, o in ((3, 4), (6, 5),
                                                                           (7, 8)))
    assert f"median ratio --zero_offload / stock: {ratios[1]:.3f}" in out
    assert "stock first in even pairs" in out


def test_offload_cpu_times_the_engine_step_and_the_kernel_in_rounds(monkeypatch, capsys):
    bench = _load("bench_offload.py", monkeypatch)
    seen = []
    _spy(bench, seen)
    threads = torch.get_num_threads()
    try:  # one layer of width 64: 3.3M params, mostly the 50257-token embedding
        bench["main"](["--layers", "1", "--hidden", "64", "--repeats", "2",
                       "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert seen == [(["kernel", "engine"], 2)]
    rows = re.findall(r"^\| (.+?) \| ([\d.]+)M \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      capsys.readouterr().out, re.M)
    assert [r[0].split(",")[0].split(" (")[0] for r in rows] == [
        "bare CPU-Adam kernel", "`ZeroOffloadOptimizer.step()`"]
    assert rows[0][1] == rows[1][1] == "3.3"  # the same params in both
    assert rows[0][4] == "1.00" and float(rows[1][4]) > 0


def test_scaling_report_takes_each_ratio_per_round_against_its_launchs_references(
        monkeypatch):
    bench = _load("bench_scaling.py", monkeypatch)
    methods = [("D2D copy", None, 4), ("ours", None, 2), ("ours+out", None, 6),
               ("torch pair", None, 6)]
    # eager: ours twice the copy's speed in two rounds of three, as fast as torch pair in the
    # third: the per-round ratios give 1.00 of copy GB/s and 3.00x; the rows' medians would
    # give 0.25 and 1.50x. graph: every row 1 ms, so of copy GB/s is the bytes' ratio and
    # every speedup 1.00x.
    eager = {"D2D copy": [1, 2, 10], "ours": [0.5, 4, 5], "ours+out": [1, 2, 10],
             "torch pair": [1.5, 2, 15]}
    seconds = {f"{name}, {mode}": [t * 1e-3 for t in eager[name]] if mode == "eager"
               else [1e-3] * 3 for name, _, _ in methods for mode in ("eager", "graph")}
    lines = bench["report"](methods, bench["il"].Rounds(seconds, []), 10**6)
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]):
            [c.strip() for c in line.strip("|").split("|")[2:]]
            for line in lines if line.startswith("| ") and "---" not in line}
    assert rows["ours", "eager"] == ["4.000", "2", "0", "1.00", "3.00x"]  # 4 ms: 2 MB / 4 ms
    assert rows["ours+out", "eager"] == ["2.000", "6", "3", "1.50", "1.50x"]
    assert rows["ours", "graph"] == ["1.000", "2", "2", "0.50", "1.00x"]
    assert rows["torch pair", "graph"][3:] == ["1.50", "1.00x"]
    assert "targets (eager): ours 3.00x the torch pair (want >= 1.5x), 1.00 of copy GB/s" in \
        "\n".join(lines)
