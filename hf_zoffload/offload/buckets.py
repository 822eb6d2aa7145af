"""Grouping trainable parameters into buckets with flat gradient and host storage.

A bucket is the unit of everything the engine streams: its 16-bit gradients are collected
into one flat buffer and copied to the host in one transfer, and its fp32 master weights, Adam
moments and staging buffers are flat host buffers the CPU-Adam updates in one call per run.
The parameters themselves are NOT views of a flat buffer: each keeps its own device storage,
because the ecosystem keys tensors by storage: safetensors refuses tensors that share one, and
accelerate's save takes them for tied weights and keeps one name per storage. A slot's offset
maps the param onto the bucket's flat layout; `Bucket.pieces` and the two copy helpers move
values between a flat buffer and the params, one copy per param.
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

    def flat(self) -> torch.Tensor:
        """The param as a 1-D view of its own storage (writes reach the param). The engine
        made it contiguous; `view` raises rather than silently copying if that changed."""
        return self.param.detach().view(-1)


@dataclass
class Bucket:
    index: int
    slots: list[Slot]
    numel: int
    # the compute dtype of the params (each has its own storage) and of the grad buffers
    dtype: torch.dtype | None = None
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
    # this rank's part (partition.py): host buffers hold flat elements [start, start + shard)
    # of a bucket padded to `padded` elements; [lo, hi) is the part that holds params. One
    # process: start = lo = 0, shard = hi = padded = numel.
    padded: int = 0
    start: int = 0
    shard: int = 0
    lo: int = 0
    hi: int = 0
    # data parallel only, allocated on first use: the fp32 landing buffer of a reduced
    # gradient sum, and the full-bucket unreduced grads of micro-steps without a collective
    grad_host32: torch.Tensor | None = None
    grad_host32_alt: torch.Tensor | None = None
    local_host: torch.Tensor | None = None  # compute dtype, the latest unreduced micro-step
    local_acc: torch.Tensor | None = None  # fp32 sum of earlier unreduced micro-steps
    # per-window bookkeeping (a window = all backward passes since the last step)
    arrived: int = 0  # grads arrived in the current backward
    flushed: int = 0  # backward passes whose grads reached the host in this window
    last: torch.Tensor | None = None  # host buffer the latest flushed grads land in
    local: int = 0  # unreduced micro-steps held in local_host / local_acc
    prefilled: bool = False  # `pending` starts from earlier micro-steps: hooks add into it
    sync_round: int = -1  # the last reduction round this bucket was submitted in
    present: list[bool] = field(default_factory=list)  # slot got a grad in this window
    pending: torch.Tensor | None = None  # device buffer collecting the current backward

    def place(self, dtype, device, *, pin: bool, staging: bool, flat=None) -> None:
        """Host state (this rank's shard, bucket elements [start, start + shard)) from the
        params' current values (or ``flat``, rank 0's, broadcast), then each param -> a fresh
        contiguous ``dtype`` tensor (``param.data`` replaced, the Parameter kept): its own
        storage even if it had that dtype or shared a storage with another param before."""
        from .stream import host_empty  # stream -> buckets: import late
        self.dtype = dtype
        self.master = torch.zeros(self.shard, dtype=torch.float32)  # zeros: the padding
        self.exp_avg = torch.zeros(self.shard, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(self.shard, dtype=torch.float32)
        for s in self.slots:
            src = s.param.detach().reshape(-1) if flat is None else \
                flat[s.offset:s.offset + s.numel]
            lo, hi = max(s.offset, self.lo), min(s.offset + s.numel, self.hi)
            if lo < hi:  # from the original precision
                self.master[lo - self.start:hi - self.start].copy_(
                    src[lo - s.offset:hi - s.offset])
            new = torch.empty(s.param.shape, dtype=dtype, device=device)
            new.view(-1).copy_(src)
            s.param.data = new
        self.grad_host = host_empty(self.shard, dtype, pin=pin)
        if staging and dtype != torch.float32:
            # Mirrors the device params at all times, so uploading a whole bucket (or shard)
            # never changes params that got no gradient. Padding: zeros, never written.
            self.param_host = host_empty(self.shard, dtype, pin=pin)
            self.param_host.zero_()
            self.copy_from_params(self.param_host, self.start)

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


def check_hyper(where: str, lr, betas, eps, weight_decay) -> None:
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"{where}: lr must be a number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"{where}: eps must be a number >= 0, got {eps!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"{where}: weight_decay must be a number >= 0, got {weight_decay!r}")


def collect_slots(param_groups) -> list[Slot]:
    """A slot per trainable param, in param order; raises, before anything changes, on a
    group or param the engine cannot train."""
    from .partition import check_params  # partition -> stream -> buckets: import late
    slots, devices, index = [], set(), 0
    for gi, g in enumerate(param_groups):
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                raise ValueError(f"param group {gi}: {flag}=True is not supported")
        check_hyper(f"param group {gi}", g["lr"], g["betas"], g["eps"], g["weight_decay"])
        check_params(g["params"])
        for p in g["params"]:
            if p.requires_grad:
                if not p.is_floating_point():
                    raise TypeError(f"param {index} (group {gi}) has dtype {p.dtype}; "
                                    "only floating-point params can be trained")
                devices.add(p.device)
                slots.append(Slot(p, index, gi, 0, p.numel()))
            index += 1
    if not slots:
        raise ValueError("ZeroOffloadOptimizer got no trainable parameter "
                         "(all have requires_grad=False)")
    if len(devices) > 1:
        raise ValueError("all trainable params must be on one device; got "
                         + ", ".join(sorted(map(str, devices))))
    if next(iter(devices)).type not in ("cpu", "cuda"):
        raise ValueError(f"params on {next(iter(devices))}: only cpu and cuda are supported")
    return slots


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
        out.append(Bucket(index=i, slots=members, numel=offset, padded=offset, shard=offset,
                          hi=offset, present=[False] * len(members)))
    return out
