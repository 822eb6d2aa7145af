"""Grouping trainable parameters into buckets with flat device and host storage.

A bucket is the unit of everything the engine streams: its parameters live as views of one
flat device buffer (so one host->device copy refreshes them all), its 16-bit gradients are
collected into one flat buffer and copied to the host in one transfer, and its fp32 master
weights and Adam moments are flat host buffers the CPU-Adam updates in one call per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Slot:
    """One parameter's place in its bucket."""

    param: torch.nn.Parameter
    index: int  # position in the optimizer's param order (torch's state_dict key)
    group: int  # index of its param group
    offset: int
    numel: int


@dataclass
class Bucket:
    index: int
    slots: list[Slot]
    numel: int
    # device side: the parameters are views of `params`
    params: torch.Tensor | None = None
    # host side (fp32 state and staging), filled by the engine
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad_host: torch.Tensor | None = None  # compute-dtype grads of the latest backward
    grad_acc: torch.Tensor | None = None  # fp32 sum of earlier micro-steps, allocated lazily
    param_host: torch.Tensor | None = None  # 16-bit params written by the CPU-Adam
    # the delayed update reads one set of grad buffers while backward fills the other
    grad_host_alt: torch.Tensor | None = None
    grad_acc_alt: torch.Tensor | None = None
    # per-window bookkeeping (a window = all backward passes since the last step)
    arrived: int = 0  # grads arrived in the current backward
    flushed: int = 0  # backward passes whose grads reached the host in this window
    present: list[bool] = field(default_factory=list)  # slot got a grad in this window
    pending: torch.Tensor | None = None  # device buffer collecting the current backward

    def runs(self, key):
        """Contiguous ranges of present slots with equal ``key(slot)``, in flat order.

        The engine keys on (param group, Adam step count). Slots are sorted by group at
        build time, so in the usual case a bucket has at most one run per group (2 with the
        Trainer's decay / no-decay groups): one CPU-Adam call each."""
        start = None
        for i, s in enumerate(self.slots):
            if start is not None and (
                not self.present[i] or key(s) != key(self.slots[start])
            ):
                yield self.slots[start : i]
                start = None
            if start is None and self.present[i]:
                start = i
        if start is not None:
            yield self.slots[start:]


def build_buckets(slots: list[Slot], *, bucket_numel: int) -> list[Bucket]:
    """Split ``slots`` into buckets of about ``bucket_numel`` elements.

    ``slots`` come in the optimizer's param order; buckets are filled in reverse, which is
    close to the order backward produces gradients, so the first bucket completes early and
    its copy overlaps the rest of backward. A parameter larger than ``bucket_numel`` gets a
    bucket of its own. Within a bucket, slots are ordered by param group so that one
    CPU-Adam call covers each group.
    """
    buckets: list[list[Slot]] = []
    current: list[Slot] = []
    size = 0
    for slot in reversed(slots):
        if current and size + slot.numel > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(slot)
        size += slot.numel
    if current:
        buckets.append(current)
    out = []
    for i, members in enumerate(buckets):
        members = sorted(members, key=lambda s: s.group)  # stable: keeps backward order
        offset = 0
        for s in members:
            s.offset = offset
            offset += s.numel
        out.append(Bucket(index=i, slots=members, numel=offset, present=[False] * len(members)))
    return out
