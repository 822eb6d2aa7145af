"""``offload_fraction``: which buckets keep their optimizer state on the params' device.

A tier policy is an object the engine holds (`make_tier_policy`): `FixedFraction` (a number in
[0, 1], the share of this rank's state kept on the host) or `AutoFraction` (``auto``: every
bucket on the host for the first step, then as many on the device as the memory the first step
left free holds). Either answers `tiers(layouts)`, each bucket's `tiers.Tier`, at layout and
re-layout time (docs/design.md, "Device buckets").

Device buckets are the last ones: buckets fill in backward order, so the last hold the first
layers in forward order, and those params are written first by the fast device update; the
next forward's first modules then wait for nothing but it (the module waits).
"""

from __future__ import annotations

import logging

import torch

from .memory import DEVICE_STATE_BYTES, human
from .tiers import Tier

logger = logging.getLogger(__name__)

# `auto` leaves this share of the device's memory unused: the caching allocator reserves
# more than max_memory_allocated counts (fragmentation: 5-10% on long runs), the CUDA
# context and NCCL's buffers (~0.5 GiB each on an H100) are outside the allocator, and later
# batches may peak higher than the first. 10% covers those on a 40-80 GiB card; it is a
# starting point until the GPU stage measures it (scripts/gpu_check.sh).
SAFETY_MARGIN = 0.10


def per_element(param_bytes: int, *, accumulates: bool, delayed: bool) -> int:
    """Device bytes one element of a device bucket holds: fp32 master and moments (12), its
    grad buffer in the compute dtype (two with the delayed update), the fp32 sum when the
    window accumulates (4)."""
    return DEVICE_STATE_BYTES + param_bytes * (2 if delayed else 1) + (4 if accumulates else 0)


def auto_budget(peak: int, have: int) -> int:
    """Device bytes `auto` gives the optimizer state: ``have`` less the margin, less the
    peak the first step measured (with every bucket on the host)."""
    return max(0, int(have * (1.0 - SAFETY_MARGIN)) - peak)


def suffix(layouts, fits) -> frozenset[int]:
    """The indices of the longest run of last buckets (forward order first) whose shards'
    elements ``n`` together may be on the device (``fits(n)``)."""
    chosen, n = [], 0
    for lay in reversed(layouts):
        if not fits(n + lay.shard):
            break
        n += lay.shard
        chosen.append(lay.index)
    return frozenset(chosen)


def device_elements(layouts, on_device) -> int:
    return sum(lay.shard for lay in layouts if lay.index in on_device)


class TierPolicy:
    """Which tier each bucket's state lives in; the engine asks at each (re-)layout."""

    auto = False

    def on_device(self, layouts) -> frozenset[int]:
        """Indices of ``layouts`` whose state is kept on the device."""
        raise NotImplementedError

    def tiers(self, layouts) -> tuple[Tier, ...]:
        """Each of ``layouts``' tier, in their order."""
        dev = self.on_device(layouts)
        return tuple(Tier.DEVICE if lay.index in dev else Tier.HOST for lay in layouts)

    def first_step_done(self, engine) -> None:
        """At the end of the first step, before the re-layout (`auto` decides here)."""

    def relaid(self, layouts) -> None:
        """After the first step's re-layout (`auto` logs its choice here)."""


class FixedFraction(TierPolicy):
    """At least ``fraction`` of this rank's state elements stay on the host; the last
    buckets whose elements fit in the rest go to the device (0: all, 1: none)."""

    def __init__(self, fraction: float):
        self.fraction = float(fraction)

    def on_device(self, layouts) -> frozenset[int]:
        total = sum(lay.shard for lay in layouts)
        room = (1.0 - self.fraction) * total
        return suffix(layouts, lambda n: n <= room + 1e-9 * total)


class DeviceMeter:
    """The figures `auto` decides from: the peak device memory since `reset` and the
    device's total. A seam: tests replace it with figures of their own."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def figures(self) -> tuple[int, int] | None:
        """(peak allocated bytes, total bytes), or None where nothing can be measured (the
        CPU: its "device" memory is the host's, and the host budget is host_memory_limit)."""
        if self.device.type != "cuda":
            return None
        return (torch.cuda.max_memory_allocated(self.device),
                torch.cuda.get_device_properties(self.device).total_memory)


class AutoFraction(TierPolicy):
    """``auto``: every bucket on the host until the first step has shown its peak device
    memory; then the last buckets whose device state fits in ``(total or limit) x (1 -
    SAFETY_MARGIN) - peak`` go to the device. Decided once, logged once with the figures."""

    auto = True

    def __init__(self, meter: DeviceMeter, *, limit: int = 0):
        self.meter = meter
        self.limit = limit  # device_memory_limit in bytes; 0: the device's total
        self.budget: int | None = None  # device bytes the state may use, once decided
        self.per_element = DEVICE_STATE_BYTES
        self.decision: str | None = None  # the log line, once decided
        self._figures = ""
        meter.reset()

    def on_device(self, layouts) -> frozenset[int]:
        if not self.budget:
            return frozenset()
        return suffix(layouts, lambda n: n * self.per_element <= self.budget)

    def first_step_done(self, engine) -> None:
        figures = self.meter.figures()
        if figures is None:
            self.budget = 0
            self.decision = (f"offload_fraction auto: there is no device memory to measure "
                             f"on {engine.device.type}, so all optimizer state stays on the "
                             f"host")
            logger.info(self.decision)
            return
        peak, total = figures
        have, source = (self.limit, "device_memory_limit") if self.limit else \
            (total, "the device's total")
        self.per_element = per_element(engine.dtype.itemsize, accumulates=engine.accumulates,
                                       delayed=engine.plugin.delayed_update)
        self.budget = auto_budget(peak, have)
        self._figures = (f"first step peaked at {human(peak)} of {human(have)} ({source}), "
                         f"{SAFETY_MARGIN:.0%} kept free: {human(self.budget)} for optimizer "
                         f"state at {self.per_element} B/element")

    def relaid(self, layouts) -> None:
        if self.decision is not None:
            return
        dev = self.on_device(layouts)
        n_dev = device_elements(layouts, dev)
        n_all = sum(lay.shard for lay in layouts) or 1
        self.decision = (f"offload_fraction auto: {self._figures}; {len(dev)} of "
                         f"{len(layouts)} buckets on the device "
                         f"({human(n_dev * self.per_element)}), offload fraction "
                         f"{1 - n_dev / n_all:.3f}")
        logger.info(self.decision)


def make_tier_policy(plugin, device: torch.device) -> TierPolicy:
    """The tier policy ``plugin.offload_fraction`` asks for."""
    value = plugin.offload_fraction_value
    if value is None:
        return AutoFraction(DeviceMeter(device), limit=plugin.device_memory_limit_bytes)
    return FixedFraction(value)
