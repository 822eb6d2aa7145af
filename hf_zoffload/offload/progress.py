"""Long host passes say what they do: a line before with the size, progress lines while
they run past a few seconds, and a line after with the seconds and the rate.

Allocating (and on CUDA pinning) the host state and the re-layout after the first step touch
every byte of it once: 0.2-1.6 GiB/s on the 2-vCPU EPYC (docs/measurements.md, "Protocol figures"),
minutes for a 7B model's 50-90 GiB on a small host. Without a word they look like a hang.
"""

from __future__ import annotations

import logging
import time

from .memory import human

PROGRESS_EVERY_S = 5.0  # a quiet pause shorter than this needs no progress line


class Progress:
    """``what``: a noun phrase for the log ("allocating the host state"); ``total``: the
    bytes the pass will cover. `at(covered)` as it goes; `done()` returns the seconds."""

    def __init__(self, logger: logging.Logger, what: str, total: int, *, detail: str = "",
                 every_s: float = PROGRESS_EVERY_S, clock=time.perf_counter):
        self.logger, self.what, self.total, self.every_s = logger, what, total, every_s
        self.clock = clock
        self.covered = 0
        self.t0 = self._last = clock()
        logger.info("ZeRO-Offload: %s: %s%s", what, human(total),
                    f" ({detail})" if detail else "")

    def at(self, covered: int) -> None:
        """``covered`` bytes of ``total`` are done."""
        self.covered = covered
        now = self.clock()
        if now - self._last >= self.every_s:
            self._last = now
            share = self.covered / self.total if self.total else 1.0
            self.logger.info("ZeRO-Offload: %s: %s of %s (%.0f%%), %.0f s", self.what,
                             human(self.covered), human(self.total), 100 * share, now - self.t0)

    def done(self, detail: str = "") -> float:
        seconds = self.clock() - self.t0
        rate = self.total / 2**30 / seconds if seconds > 0 else float("inf")
        self.logger.info("ZeRO-Offload: %s: done, %s in %.2f s (%.2f GiB/s)%s", self.what,
                         human(self.total), seconds, rate, f"; {detail}" if detail else "")
        return seconds
