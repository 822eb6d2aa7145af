"""Round-robin timing for the benchmarks that compare paths (issue 23, item 7).

Timing one row after another lets the machine change between rows: on the development VM the
memory bandwidth drifts within a minute, and one sequential run had torch's fused AdamW at
1.62x of a memory ceiling measured a minute earlier, 1.47x faster than ours, where an
alternating pair of the same two calls gave 1.00. So the rows are timed in rounds: each round
times every row once, the rows in a rotating order; a row's figure is its median over rounds,
and a ratio of two rows is the median of their per-round ratios, each taken from two calls
made at most one round apart, under (nearly) the same machine.

The order rotates (round r starts at row r mod k) rather than staying fixed, so every row takes
every place in the round equally often over k rounds: a cost tied to a place (the first call
after a sleep, the one after the heaviest row) falls on each row alike, where a fixed order
charges it to the same row every round. A shuffle would do that only on average.

Import-safe: nothing runs at import.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class RowFailed(RuntimeError):
    """A row's call raised or returned no usable time; the first failure ends the run."""


class SelfTimed:
    """A row that measures itself: ``fn()`` returns the seconds to count, e.g. only the
    optimizer step and not the backward that feeds it, or CUDA-event time."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], float]):
        self.fn = fn


Row = Callable[[], object] | SelfTimed


@dataclass(frozen=True)
class Rounds:
    """Seconds per row, one per round in round order, and the order each round ran in."""

    seconds: dict[str, list[float]]
    orders: list[tuple[str, ...]]

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def ratio(self, num: str, den: str) -> float:
        """Median over rounds of ``num``'s seconds over ``den``'s in the same round."""
        return statistics.median(a / b for a, b in zip(self.seconds[num], self.seconds[den]))


def rotation(names: Sequence[str], r: int) -> tuple[str, ...]:
    """Round ``r``'s order: the rows rotated left by ``r`` places."""
    k = r % len(names)
    return tuple(names[k:]) + tuple(names[:k])


def _call(name: str, fn: Row, clock: Callable[[], float], when: str, *, check: bool = True
          ) -> float:
    try:
        if isinstance(fn, SelfTimed):
            sec = fn.fn()
        else:
            t0 = clock()
            fn()
            sec = clock() - t0
    except Exception as exc:
        raise RowFailed(f"row {name!r} failed {when}: {type(exc).__name__}: {exc}") from exc
    if not check:  # a warm-up's time is thrown away; only its failure counts
        return 0.0
    if isinstance(sec, bool) or not isinstance(sec, (int, float)) or not 0 < sec < math.inf:
        raise RowFailed(f"row {name!r} {when} took {sec!r} s; a time must be a positive finite "
                        "number (too fast for the clock?)")
    return float(sec)


def interleave(rows: Sequence[tuple[str, Row]], rounds: int, *, warmup: bool = True,
               clock: Callable[[], float] = time.perf_counter) -> Rounds:
    """Time ``rows`` ((name, fn) pairs) in ``rounds`` rounds of one call each, the order
    rotating; a plain fn is timed with ``clock`` around the call, a `SelfTimed` one reports
    its own seconds. ``warmup``: one untimed call of every row first (first touch of its
    pages, lazy initialisation), in round 0's order. Raises `RowFailed`, naming the row and
    the round, at the first call that fails; no row runs after it."""
    names = [name for name, _ in rows]
    if not names:
        raise ValueError("interleave: no rows to time")
    if len(set(names)) != len(names):
        raise ValueError(f"interleave: row names repeat: {names}")
    if rounds < 1:
        raise ValueError(f"interleave: rounds must be >= 1, got {rounds}")
    fns = dict(rows)
    if warmup:
        for name in rotation(names, 0):
            _call(name, fns[name], clock, "in its warm-up call", check=False)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    orders = []
    for r in range(rounds):
        order = rotation(names, r)
        orders.append(order)
        for name in order:
            seconds[name].append(_call(name, fns[name], clock, f"in round {r}"))
    return Rounds(seconds, orders)
