"""Host buffers that device copies read or write: page-locked, and carved from few blocks.

torch's pinned host allocator rounds every allocation up to a power of two, so one pinned
tensor per bucket wastes up to half of each (86 MiB buckets of a Llama-7B shape become
128 MiB: about 31%, 8 GiB in all), never returned and invisible to a byte count of the
tensors. `HostPool` holds one set of blocks per kind of buffer for all buckets, each block a
power of two in size and filled with whole buckets, so the rounding costs at most the tail
of each block (docs/design.md, "Host memory"). What it holds is what `memory_report()`
counts.
"""

from __future__ import annotations

import logging
import time

import torch

from .layout import BucketLayout
from .tiers import Tier

logger = logging.getLogger(__name__)
_ALIGN = 64  # bytes: every bucket's view starts on a cache line (and a 512-bit vector)


def pinned_bytes(nbytes: int) -> int:
    """What torch's pinned (CachingHostAllocator) holds for ``nbytes``: a power of two."""
    return 1 << max(0, (nbytes - 1).bit_length())


def plan_blocks(sizes: list[int], *, pinned: bool) -> list[tuple[int, list[tuple[int, int]]]]:
    """How to place buffers of ``sizes`` bytes (each rounded up to 64) in blocks: a list of
    (block bytes, [(buffer index, byte offset)]). Pinned: each block is a power of two (what
    torch's pinned allocator holds for it anyway), the largest one that the remaining
    buffers fill, so the waste is at most the part of one buffer per block plus a small
    last block. Pageable: one block of the exact total."""
    sizes = [-(-n // _ALIGN) * _ALIGN for n in sizes]
    if not pinned:
        offsets, at = [], 0
        for i, n in enumerate(sizes):
            offsets.append((i, at))
            at += n
        return [(at, offsets)] if sizes else []
    left, blocks = list(range(len(sizes))), []
    while left:
        cap = 1 << (sum(sizes[i] for i in left).bit_length() - 1)  # largest power of 2 <= total
        placed, at = [], 0
        for i in left:  # first fit, in bucket order
            if at + sizes[i] <= cap:
                placed.append((i, at))
                at += sizes[i]
        if not placed:  # every buffer left is larger than cap: the first one on its own
            placed, cap = [(left[0], 0)], pinned_bytes(sizes[left[0]])
        taken = {i for i, _ in placed}
        left = [i for i in left if i not in taken]
        blocks.append((cap, placed))
    return blocks


class HostPool:
    """Host buffers by kind, one view per bucket, each kind allocated on its first use for
    all buckets at once. ``pin`` asks for page-locked memory (truly asynchronous copies);
    if that fails (e.g. RLIMIT_MEMLOCK in a container) the pool falls back to pageable
    memory, logs why once, and says so in ``pageable_reason``.

    ``tiers``: each layout's `Tier` (all `Tier.HOST` by default). A `Tier.DEVICE` bucket
    (``offload_fraction``) keeps its state on ``device``: its buffers are device tensors, one
    per bucket from the device's allocator, counted apart (`device_held`)."""

    def __init__(self, layouts: list[BucketLayout], *, pin: bool, tiers=None,
                 device: torch.device | None = None):
        self.layouts = layouts
        self.pin = pin
        self.tiers = tuple(tiers) if tiers is not None else (Tier.HOST,) * len(layouts)
        if len(self.tiers) != len(layouts):
            raise ValueError(f"internal: {len(self.tiers)} tiers for {len(layouts)} buckets")
        self.device = device
        self._device_held: dict[tuple, int] = {}
        self.pageable_reason: str | None = None
        self.alloc_seconds = 0.0  # spent allocating blocks: pinning is most of it on CUDA
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self._held: dict[tuple, int] = {}

    def get(self, kind: tuple, index: int, dtype: torch.dtype, *, full: bool = False):
        """Bucket ``index``'s buffer of ``kind`` (a name plus anything that tells two sets
        apart): ``full`` buckets (padded) or this rank's shard, of ``dtype``."""
        if kind not in self._views:
            self._allocate(kind, dtype, full=full)
        return self._views[kind][index]

    def _allocate(self, kind: tuple, dtype: torch.dtype, *, full: bool) -> None:
        numels = [lay.padded if full else lay.shard for lay in self.layouts]
        size = torch.tensor([], dtype=dtype).element_size()
        views: list[torch.Tensor | None] = [None] * len(numels)
        on_host = [i for i, t in enumerate(self.tiers) if t is Tier.HOST]
        on_device = [i for i, t in enumerate(self.tiers) if t is Tier.DEVICE]
        held = 0
        for nbytes, placed in plan_blocks([numels[i] * size for i in on_host], pinned=self.pin):
            t0 = time.perf_counter()
            block = self._block(nbytes)
            self.alloc_seconds += time.perf_counter() - t0
            held += nbytes
            for j, at in placed:
                i = on_host[j]
                views[i] = block[at:at + numels[i] * size].view(dtype)
        for i in on_device:
            views[i] = torch.empty(numels[i], dtype=dtype, device=self.device)
        self._views[kind], self._held[kind] = views, held
        self._device_held[kind] = sum(numels[i] for i in on_device) * size

    def _block(self, nbytes: int) -> torch.Tensor:
        if self.pin and self.pageable_reason is None:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                self.pageable_reason = str(exc).splitlines()[0][:200]
                logger.warning("pinning host memory failed (%s); using pageable memory, "
                               "device<->host copies will not overlap compute",
                               self.pageable_reason)
        return torch.empty(nbytes, dtype=torch.uint8)

    def held(self) -> dict[tuple, int]:
        """Host bytes allocated, by kind (block sizes: for pinned memory, what torch holds)."""
        return dict(self._held)

    def device_held(self) -> dict[tuple, int]:
        """Bytes of the device buckets' buffers, by kind."""
        return dict(self._device_held)
