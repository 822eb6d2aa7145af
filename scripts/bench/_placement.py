"""Where a benchmark's buffers lie in memory: moved so that every buffer gets the same mix.

On the development VMs memory differs in speed by where it lies (the guest's pages are backed
unevenly by the host), and the kernel hands out pages in the order they are first touched, so
buffers allocated one after another sit in different memory. Measured on the Intel Xeon
(family 6, model 167; 1 thread, 100M params): the same 28-B ceiling pass over three of 16
such buffers took 122, 124, 136, 133, 147 and 162 ms as the buffers came later, the ceiling
rows of bench_cpu_adam.py (allocated after the kernel rows') 163 ms against 105 ms for the
same pass in a process of its own, where our engine's call ran at 115 ms: "of ceiling" read
1.42. First-touched in stripes across all buffers, the same six sets took 129-133 ms.

`restripe` moves buffers that already exist (a row's lazily created optimizer state included,
after a warm-up call) to memory touched that way, in place: every reference to a tensor sees
its new storage. Import-safe: nothing runs at import.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Bytes of each buffer touched before moving to the next one: fine enough that a buffer of a
# few MB (a Llama's matrices at a small width) spans several stripes, coarse enough that 7 GB
# take ~30K zero_ calls (~0.2 s).
STRIPE = 256 * 1024


def restripe(tensors: Iterable[torch.Tensor], stripe: int = STRIPE) -> int:
    """Moves each tensor of at least ``stripe`` bytes to new memory whose pages are first
    touched in turns, ``stripe`` bytes of every buffer in each turn, and returns how many it
    moved. The values are kept; a tensor is moved once however often it is listed. Each must
    be a contiguous tensor over its whole storage (not a view into a larger one), and no other
    tensor may share that storage, since the move replaces the storage of the listed object
    only; either raises before anything moves. Peak memory: the moved buffers twice, each old one freed only
    when nothing else holds it."""
    if stripe <= 0:
        raise ValueError(f"restripe: stripe must be a positive byte count, got {stripe}")
    olds: dict[int, torch.Tensor] = {}
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes < stripe:
            continue
        if not t.is_contiguous() or t.untyped_storage().nbytes() != nbytes \
                or t.storage_offset() != 0:
            raise ValueError(f"restripe: a {tuple(t.shape)} {t.dtype} tensor is a view or not "
                             "contiguous; list the tensor that owns the storage")
        other = olds.setdefault(t.untyped_storage().data_ptr(), t)
        if other is not t:  # moving one would leave the other on the old storage
            raise ValueError(f"restripe: two tensors ({tuple(t.shape)} {t.dtype}) share one "
                             "storage; list only one of them")
    news = {key: torch.empty_like(t, memory_format=torch.contiguous_format)
            for key, t in olds.items()}  # large: mapped, not yet touched
    raw = [n.view(-1).view(torch.uint8) for n in news.values()]
    top = max((r.numel() for r in raw), default=0)
    for off in range(0, top, stripe):
        for r in raw:
            if off < r.numel():
                r[off:off + stripe].zero_()
    with torch.no_grad():
        for key, old in olds.items():
            new = news[key]
            new.copy_(old)
            old.data = new
    return len(olds)
