"""scripts/bench/_interleave.py, the round-robin timing of the benchmarks, on fake clocks: under a
machine whose speed drifts, the per-round ratios give the true ratio where timing one row
after another does not; the order rotates; a failing row ends the run with one clear error."""

import statistics
import sys
from pathlib import Path

import pytest

SCRIPTS = str(Path(__file__).resolve().parents[2] / "scripts" / "bench")
sys.path.insert(0, SCRIPTS)
try:
    import _interleave as il
finally:
    sys.path.remove(SCRIPTS)


class Machine:
    """A fake clock and rows on it: a row's call advances the clock by its work times the
    machine's slowness at the moment the call starts."""

    def __init__(self, slowness):
        self.now, self.slowness, self.calls = 0.0, slowness, []

    def clock(self):
        return self.now

    def row(self, name, work):
        def call():
            self.calls.append(name)
            self.now += work * self.slowness(self.now)
        return call


def sequential(rows, repeats, clock):
    """The old way (bench_cpu_adam's _time before rounds): each row's calls back to back."""
    out = {}
    for name, fn in rows:
        fn()
        times = []
        for _ in range(repeats):
            t0 = clock()
            fn()
            times.append(clock() - t0)
        out[name] = statistics.median(times)
    return out


def test_a_step_in_bandwidth_leaves_the_interleaved_ratio_true():
    # "ours" does twice the work of "ref". At t = 16 the machine halves its speed (another
    # process starts streaming memory): timed one after the other, ref runs before the step and
    # ours mostly after it, so ours reads 4x slower. In rounds, the step falls inside round 4
    # (ref, then ours): only that round's ratio is off, and the median of the per-round ratios
    # drops it. The ratio of the two rows' medians does not: 5 of ours' 9 calls came after the
    # step but only 4 of ref's.
    def make():
        m = Machine(lambda t: 1.0 if t < 16 else 2.0)
        return m, [("ref", m.row("ref", 1.0)), ("ours", m.row("ours", 2.0))]

    m, rows = make()
    old = sequential(rows, 9, m.clock)
    assert old["ours"] / old["ref"] == pytest.approx(4.0)  # the drift, read as a ratio

    m, rows = make()
    got = il.interleave(rows, 9, clock=m.clock)
    assert got.ratio("ours", "ref") == pytest.approx(2.0, rel=1e-12)
    assert got.ratio("ref", "ours") == pytest.approx(0.5, rel=1e-12)
    assert got.seconds["ref"] == [1.0] * 5 + [2.0] * 4  # the drift is in the rows...
    assert got.seconds["ours"] == [2.0] * 4 + [4.0] * 5
    assert got.median("ours") / got.median("ref") == 4.0  # ...and in their medians' ratio


def test_a_smooth_drift_leaves_the_interleaved_ratio_within_a_few_percent():
    # The machine slowing steadily, 3.5x slower after the 124 s both runs take. Timed one row
    # after the other, "other" (half ref's work) reads 1.27x slower than ref and "ours" 2.5x
    # for 1.5x. In rounds the calls compared are one or two calls apart, each ~2% of drift at
    # this rate (a call of ~1 s against a slowness that grows by 1/50 per s): within 3%.
    def make():
        m = Machine(lambda t: 1.0 + t / 50)
        return m, [("ref", m.row("ref", 1.0)), ("ours", m.row("ours", 1.5)),
                   ("other", m.row("other", 0.5))]

    m, rows = make()
    old = sequential(rows, 20, m.clock)
    assert old["ours"] / old["ref"] > 2.4 and old["other"] / old["ref"] > 1.2
    took = m.now

    m, rows = make()
    got = il.interleave(rows, 20, clock=m.clock)
    assert m.now == pytest.approx(took)  # the same drift, spread over the rounds
    assert got.ratio("ours", "ref") == pytest.approx(1.5, rel=0.03)
    assert got.ratio("other", "ref") == pytest.approx(0.5, rel=0.03)
    assert got.ratio("ref", "ours") == pytest.approx(1 / 1.5, rel=0.03)


def test_the_order_rotates_and_every_row_runs_once_a_round():
    m = Machine(lambda t: 1.0)
    rows = [(n, m.row(n, 1.0)) for n in "abc"]
    got = il.interleave(rows, 4, clock=m.clock)
    want = [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c")]
    assert got.orders == want
    assert m.calls == ["a", "b", "c"] + [n for order in want for n in order]  # warm-up first
    assert all(len(s) == 4 for s in got.seconds.values())
    m.calls.clear()
    il.interleave(rows, 2, warmup=False, clock=m.clock)
    assert m.calls == ["a", "b", "c", "b", "c", "a"]


def test_self_timed_rows_report_their_own_seconds():
    m = Machine(lambda t: 1.0)
    reported = iter([5.0, 3.0, 4.0, 6.0])  # warm-up, then rounds 0..2
    rows = [("clocked", m.row("clocked", 2.0)), ("own", il.SelfTimed(lambda it=reported: next(it)))]
    got = il.interleave(rows, 3, clock=m.clock)
    assert got.seconds == {"clocked": [2.0, 2.0, 2.0], "own": [3.0, 4.0, 6.0]}
    assert got.ratio("own", "clocked") == 2.0


def test_a_failing_row_raises_one_error_naming_it_and_nothing_runs_after():
    m = Machine(lambda t: 1.0)
    count = [0]

    def flaky():
        count[0] += 1
        if count[0] == 3:  # warm-up, round 0, then round 1
            raise MemoryError("out of host memory")
        m.now += 1.0

    rows = [("a", m.row("a", 1.0)), ("flaky", flaky), ("c", m.row("c", 1.0))]
    with pytest.raises(il.RowFailed, match=r"row 'flaky' failed in round 1: MemoryError: out "
                                           r"of host memory") as info:
        il.interleave(rows, 5, clock=m.clock)
    assert isinstance(info.value.__cause__, MemoryError)
    # warm-up a, c; round 0 a, c; round 1 starts at flaky (rotated) and stops there
    assert m.calls == ["a", "c", "a", "c"]

    with pytest.raises(il.RowFailed, match="row 'boom' failed in its warm-up call: "
                                           "ZeroDivisionError"):
        il.interleave([("boom", lambda: 1 / 0)], 3, clock=m.clock)


def test_a_row_without_a_usable_time_is_refused():
    for bad in (0.0, -1.0, float("nan"), float("inf"), None, "1.0", True):
        reported = iter([1.0, bad])  # a good warm-up: its time is not used, nor checked
        with pytest.raises(il.RowFailed, match=r"row 'own' in round 0 took .* s; a time must "
                                               "be a positive finite number"):
            il.interleave([("own", il.SelfTimed(lambda it=reported: next(it)))], 1)
    with pytest.raises(il.RowFailed, match=r"row 'instant' in round 0 took 0.0 s.*too fast"):
        il.interleave([("instant", lambda: None)], 1, clock=lambda: 7.0)


def test_bad_arguments_are_refused():
    for rows, rounds, says in (([], 1, "no rows"), ([("a", print), ("a", print)], 1, "repeat"),
                               ([("a", print)], 0, "rounds must be >= 1")):
        with pytest.raises(ValueError, match=says):
            il.interleave(rows, rounds)
