"""Where each trainable param sits: slots, buckets and this rank's shard. Built once, frozen.

A bucket is the unit of everything the engine streams: its 16-bit gradients are collected
into one flat buffer and moved to the host in one transfer, and its host state (state.py) is
flat buffers the CPU-Adam updates in one call per run. The params themselves are NOT views of
a flat buffer: each keeps its own device storage, because the ecosystem keys tensors by
storage (safetensors refuses tensors that share one; accelerate's save takes them for tied
weights and keeps one name per storage). A slot's offset maps its param onto the bucket's flat
layout; the copy helpers move values between a flat buffer and the params, one copy per param.

Sharding (docs/design.md, "Data-parallel protocol"): a bucket's flat range is padded to a
multiple of the world size N and cut into N contiguous shards; rank r holds elements
``[start, start + shard)`` of the padded bucket, of which ``[lo, hi)`` hold params. One process:
``start = lo = 0``, ``shard = hi = padded = numel``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..ops.adam_kernels import check_hyper
from ..ops.moments import MomentFormat, moment_format
from .support import check_params, is_sharded, local


@dataclass(frozen=True, eq=False)
class Slot:
    """One parameter's place in its bucket."""

    param: torch.nn.Parameter
    index: int  # position in the optimizer's param order (torch's state_dict key)
    group: int  # index of its param group
    offset: int  # first element in the bucket's flat layout
    numel: int  # of its local tensor (a DTensor's shard on this rank)
    sharded: bool = False  # a tensor-parallel shard: its elements differ between TP ranks

    def local(self) -> torch.Tensor:
        """The tensor the engine trains: the param, or a DTensor's local shard (support.py)."""
        return local(self.param)

    def flat(self) -> torch.Tensor:
        """The param (its local tensor) as a 1-D view of its own storage (writes reach the
        param). The engine made it contiguous; `view` raises rather than silently copying if
        that changed."""
        return local(self.param).view(-1)


@dataclass(frozen=True, eq=False)
class BucketLayout:
    index: int
    slots: tuple[Slot, ...]
    numel: int
    padded: int
    start: int
    shard: int
    lo: int
    hi: int
    sharded: bool = False  # its slots are tensor-parallel shards (never mixed with others)

    def pieces(self, lo: int, hi: int):
        """(slot, i, j) for each slot overlapping bucket elements [lo, hi): the slot's
        elements [i, j), which sit at bucket elements [offset + i, offset + j)."""
        for s in self.slots:
            a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < z:
                yield s, a - s.offset, z - s.offset

    def param_pieces(self, lo: int, hi: int):
        """(a, z, view) per param overlapping host-buffer elements [lo, hi) (this rank's
        shard coordinates): host elements [a, z) are the param's elements ``view``."""
        for s, i, j in self.pieces(lo + self.start, hi + self.start):
            a = s.offset + i - self.start
            yield a, a + j - i, s.flat()[i:j]

    def owned(self, s: Slot) -> tuple[slice, slice]:
        """Where slot ``s``'s elements that this rank holds sit: in the host buffers, in the
        flattened param. Empty slices when the slot lies outside this rank's shard."""
        lo = max(s.offset, self.lo)
        hi = max(min(s.offset + s.numel, self.hi), lo)
        return slice(lo - self.start, hi - self.start), slice(lo - s.offset, hi - s.offset)

    def copy_to_params(self, src: torch.Tensor, start: int, *, non_blocking=False) -> None:
        """Params <- ``src``, which holds bucket elements [start, start + len(src)); one copy
        per param. Elements of ``src`` outside every slot (the padding) are not read."""
        for s, i, j in self.pieces(start, start + src.numel()):
            a = s.offset + i - start
            s.flat()[i:j].copy_(src[a:a + j - i], non_blocking=non_blocking)

    def copy_from_params(self, dst: torch.Tensor, start: int) -> None:
        """``dst`` (bucket elements [start, start + len(dst))) <- params; padding untouched."""
        for s, i, j in self.pieces(start, start + dst.numel()):
            a = s.offset + i - start
            dst[a:a + j - i].copy_(s.flat()[i:j])

    def runs(self, present: list[bool], key):
        """Contiguous ranges of present slots with equal ``key(slot)``, in flat order.

        The engine keys on (param group, Adam step count). Slots are sorted by group at
        build time, so in the usual case a bucket has at most one run per group (2 with the
        Trainer's decay / no-decay groups): one CPU-Adam call each."""
        start = None
        for i, s in enumerate(self.slots):
            if start is not None and (not present[i] or key(s) != key(self.slots[start])):
                yield self.slots[start:i]
                start = None
            if start is None and present[i]:
                start = i
        if start is not None:
            yield self.slots[start:]


def collect_slots(param_groups, *, order=None, state_dtype: str | MomentFormat = "fp32",
                  names: dict[int, str] | None = None) -> list[Slot]:
    """A slot per trainable param (offsets come with the buckets); raises, before anything
    changes, on a group or param the engine cannot train (``state_dtype``: how the moments
    will be stored; int8 needs betas with a bound, `moments.ratio_cap`). Frozen params
    (``requires_grad=False``) get no slot, whatever their dtype. ``names``: the params' names
    by ``id``, for the errors.

    In ``order`` (the params as the model registers them, ``model.parameters()``), else in
    the optimizer's param order; params missing from ``order`` follow, in theirs. The order
    matters until the first step: buckets are filled from its end. With the Trainer's decay /
    no-decay groups the optimizer's order puts every layer's norms and biases together, in a
    bucket that completes only when backward reaches the first layer, and with N ranks a
    late bucket holds back every reduce-scatter after it (they launch in bucket order)."""
    fmt = moment_format(state_dtype)
    slots, devices, index = [], set(), 0
    for gi, g in enumerate(param_groups):
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                raise ValueError(f"param group {gi}: {flag}=True is not supported")
        check_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"], where=f"param group {gi}")
        fmt.check_betas(*g["betas"])
        check_params(g["params"])
        for p in g["params"]:
            if p.requires_grad:
                if not p.is_floating_point():  # complex: torch refuses grads of integers
                    name = (names or {}).get(id(p))
                    raise TypeError(
                        f"param {index} (group {gi}{', ' + name if name else ''}) has dtype "
                        f"{p.dtype} and requires_grad=True: ZeRO-Offload trains floating-point "
                        "params only (fp32, fp16, bf16, fp64); freeze it (requires_grad_(False)) "
                        "to leave it as it is")
                devices.add(p.device)
                slots.append(Slot(p, index, gi, 0, local(p).numel(), is_sharded(p)))
            index += 1
    if not slots:
        raise ValueError("ZeroOffloadOptimizer got no trainable parameter "
                         "(all have requires_grad=False)")
    if len(devices) > 1:
        raise ValueError("all trainable params must be on one device; got "
                         + ", ".join(sorted(map(str, devices))))
    if next(iter(devices)).type not in ("cpu", "cuda"):
        raise ValueError(f"params on {next(iter(devices))}: only cpu and cuda are supported")
    if order is not None:
        place = {}
        for p in order:
            place.setdefault(id(p), len(place))
        slots.sort(key=lambda s: (place.get(id(s.param), len(place)), s.index))
    return slots


def build_layouts(slots: list[Slot], *, bucket_numel: int, rank: int = 0,
                  world: int = 1, align: int = 1) -> list[BucketLayout]:
    """Split ``slots`` into buckets of about ``bucket_numel`` elements, each sharded for
    ``rank`` of ``world``.

    ``slots`` come in the order the buckets fill, which should be the order backward
    produces their gradients, so that the first bucket completes early and its copy overlaps
    the rest of backward: the engine passes the reversed param order first, then the order
    the first backward showed (reorder.py). A parameter larger than ``bucket_numel`` gets a
    bucket of its own. Within a bucket, slots are ordered by param group so that one
    CPU-Adam call covers each group.
    """
    groups: list[list[Slot]] = []
    current: list[Slot] = []
    size = 0
    for slot in slots:
        if current and (size + slot.numel > bucket_numel or slot.sharded != current[0].sharded):
            groups.append(current)
            current, size = [], 0
        current.append(slot)
        size += slot.numel
    if current:
        groups.append(current)
    out = []
    for i, members in enumerate(groups):
        placed, offset = [], 0
        for s in sorted(members, key=lambda s: s.group):  # stable: keeps backward order
            offset = -(-offset // align) * align
            placed.append(replace(s, offset=offset))
            offset += s.numel
        shard = -(-offset // world)
        shard = -(-shard // align) * align
        start = rank * shard
        out.append(BucketLayout(index=i, slots=tuple(placed), numel=offset,
                                padded=shard * world, start=start, shard=shard,
                                lo=min(start, offset), hi=min(start + shard, offset),
                                sharded=members[0].sharded))
    return out
