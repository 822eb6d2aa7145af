"""Buckets in the order gradients arrive: the first backward's order, adopted after a step.

When a bucket completes is decided by the order autograd produces gradients, which no param
order tells for sure (Llama registers each layer's norms after its MLP; with the Trainer's
decay / no-decay groups the optimizer's order mixes every layer into one bucket). A bucket
completing late delays its copy, and with N ranks every reduce-scatter after it (they
launch in bucket order) while their device buffers stay alive. So the engine builds its
first buckets from a guess (layout.py), records which param's gradient arrives when in its
first backward (`ArrivalOrder`), and at the end of the first step, when no gradient is held
anywhere, moves the host state into buckets filled in that order (`relayout`). With N ranks
every rank takes that decision at its first step, and the first rank's order is used on
every rank that shares the buckets (``exchange.first_rank_order``).

The move is exact in every ``state_dtype``: masters and fp32 / bf16 moments are copied;
8-bit moments are decoded and encoded again, which gives back the same codes and scales
because every param starts a 256-element block in any layout (layout.py, ``align``), so each
block holds the same elements before and after. It goes one old bucket at a time (with N
ranks an all-gather of that bucket's state), freeing each once moved, and allocates a new
bucket's state when its first param arrives: the extra host memory is about the buckets in
transit, not a second copy of the state. Checkpoints carry the order, so a resumed run
starts from the layout it saved (checkpoint.py).
"""

from __future__ import annotations

import logging

import torch

from .host import HostPool
from .layout import build_layouts
from .progress import Progress
from .state import Bucket, empty_state, zero_gaps
from .updaters import updater_of

logger = logging.getLogger(__name__)


class ArrivalOrder:
    """Param indices in the order their first gradient of one backward arrived."""

    def __init__(self):
        self.recording = True
        self._seen: dict[int, None] = {}  # insertion-ordered set

    def note(self, index: int) -> None:
        if self.recording:
            self._seen.setdefault(index)

    def stop(self) -> None:
        """At the end of the backward whose order this keeps."""
        if self._seen:
            self.recording = False

    def order(self, fill: list[int]) -> list[int]:
        """The fill order of every param of ``fill`` (the current one): those seen, as
        they arrived, then the others as they are now (all of them, if this rank saw no
        gradient: with N ranks the first rank's order is the one used)."""
        known = set(fill)
        seen = [i for i in self._seen if i in known]
        return seen + [i for i in fill if i not in self._seen]


def relayout(buckets: list[Bucket], order: list[int], *, exchange, bucket_numel: int,
             align: int, dtype: torch.dtype, state_dtype, pin: bool,
             progress: Progress | None = None, master_dtype="fp32", tiers_of=None,
             device: torch.device | None = None):
    """New buckets filled in ``order`` (param indices), with the host state of ``buckets``
    moved into them; returns (pool, buckets). ``buckets`` are unusable after.
    No gradient may be held (end of a step) and no copy may still use their buffers.
    ``progress`` hears the bytes of the old state moved so far. ``tiers_of(layouts)``: the
    new buckets' tiers (fraction.py; all on the host without it), ``device`` the params'."""
    by_index = {s.index: s for b in buckets for s in b.layout.slots}
    layouts = build_layouts([by_index[i] for i in order], bucket_numel=bucket_numel,
                            rank=exchange.rank, world=exchange.world, align=align)
    for b in buckets:  # their landing buffers hold nothing now: free them first
        b.state.grads = b.state.spare = None
    tiers = tiers_of(layouts) if tiers_of is not None else None
    pool = HostPool(layouts, pin=pin, tiers=tiers, device=device)
    home = {s.index: (lay, s) for lay in layouts for s in lay.slots}
    states = [None] * len(layouts)
    moved = 0
    for b in buckets:
        moved += sum(b.state.nbytes().values())
        # the whole old bucket (bucket coordinates) on every rank that shares the layout
        full = exchange.gather_all(b, [b.state.master_fp32(), *b.state.moments_fp32()])
        for old in b.layout.slots:
            lay, new = home[old.index]
            if states[lay.index] is None:  # not zeroed: the first touch of each page is
                # the copy below (zeroing first doubled the move's time, page faults)
                states[lay.index] = empty_state(
                    lay, dtype, pool=pool, state_dtype=state_dtype, zero=False,
                    master_dtype=master_dtype, tier=pool.tiers[lay.index], device=device)
                zero_gaps(lay, states[lay.index])
            own, mine = lay.owned(new)  # host slice of the new shard, slice of the param
            if own.start == own.stop:
                continue
            master, m, v = (t[old.offset:old.offset + old.numel][mine] for t in full)
            st = states[lay.index]
            st.master[own].copy_(master)
            st.set_moments(own.start, m, v)  # own.start starts a block (8-bit moments)
        b.state = None  # every param of it has moved
        if progress is not None:
            progress.at(moved)
    return pool, [Bucket(lay, st, t, updater_of(t))
                  for lay, st, t in zip(layouts, states, pool.tiers)]


class BucketOrder:
    """The order the buckets fill in, which the engine holds: param indices (torch's
    state_dict keys), the reversed param order until the first step, then the order in
    which the first backward's gradients arrived (recorded here), or a checkpoint's. How
    buckets are cut (``layout_args``: bucket_numel, align) is kept for the re-layout."""

    def __init__(self, fill: list[int], layout_args: dict):
        self.fill = list(fill)
        self.layout_args = dict(layout_args)
        self.arrival: ArrivalOrder | None = ArrivalOrder()  # None: the order is settled
        self.relayout_seconds: float | None = None  # how long the last re-layout took

    @property
    def settled(self) -> bool:
        """No first-backward order is waiting to be adopted."""
        return self.arrival is None

    def note(self, index: int) -> None:
        """A grad of param ``index`` arrived (the first backward's are recorded)."""
        if self.arrival is not None:
            self.arrival.note(index)

    def end_backward(self) -> None:
        if self.arrival is not None:
            self.arrival.stop()

    def arrived(self) -> list[int]:
        """The first backward's order, completed (`ArrivalOrder.order`)."""
        return self.arrival.order(self.fill)

    def resolve(self, order, exchange) -> list[int] | None:
        """``order`` made an order of exactly the current params (unknown indices dropped,
        missing ones after it in their current order), the first rank's on every rank; the
        first backward's order is then no longer adopted. None when it is the current one."""
        known = set(self.fill)
        order = [i for i in dict.fromkeys(int(i) for i in order) if i in known]
        placed = set(order)
        order = exchange.first_rank_order(order + [i for i in self.fill if i not in placed])
        self.arrival = None
        return None if order == self.fill else order
