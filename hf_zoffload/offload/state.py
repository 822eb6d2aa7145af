"""What a bucket owns on the host, and what one accumulation window tracks about it.

`HostState`: this rank's shard of the fp32 master weights, both Adam moments (fp32, bf16, or
8- or 4-bit codes with block scales: `hf_zoffload.ops.moments`), and the gradient landing buffers
(`GradBuffers`), two sets of them with the delayed update, whose background step reads one set
while the next backward fills the other. There is no separate buffer for the new params: the
CPU-Adam writes them over the 16-bit gradients it has just read (`Bucket.out`), and the upload
reads them from there. Buffers that device copies touch are views of the engine's `HostPool`
(host.py), which counts them. A device bucket (``offload_fraction``: `tiers.Tier.DEVICE`) has
the same state in fp32 on the params' device, its grad buffers device tensors from the same
pool, and updates with `updaters.DEVICE_ADAM` (docs/design.md, "Device buckets").

`Window`: per-bucket bookkeeping of one accumulation window (every backward since the last
``step()`` / ``zero_grad()``): docs/design.md, "Accumulation window".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..ops.masters import MasterFormat, master_format
from ..ops.moments import MomentFormat, moment_format
from .host import HostPool
from .layout import BucketLayout
from .support import set_local
from .tiers import Tier
from .updaters import HOST_ADAM, Updater


@dataclass(eq=False)
class GradBuffers:
    """Where reduced gradients of this rank's shard land on the host."""

    which: int  # 0 or 1: the set (the pool's kinds are per set)
    grad16: torch.Tensor  # compute dtype: the latest backward's grads (pool view)
    grad32: torch.Tensor | None = None  # fp32: a reduced sum over micro-steps (pool view)
    acc: torch.Tensor | None = None  # fp32 sum of the window's earlier backwards (pageable)


@dataclass(eq=False)
class HostState:
    master: torch.Tensor  # (shard,) in ``master_fmt.dtype``: fp32, or bf16 (master_dtype)
    exp_avg: torch.Tensor  # (fmt.storage(shard),) in ``fmt.dtype``: fp32, bf16 or uint8 codes
    exp_avg_sq: torch.Tensor
    grads: GradBuffers
    fmt: MomentFormat  # how the moments are stored (state_dtype)
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 block scales, if fmt.scaled
    spare: GradBuffers | None = None  # the delayed update's second set, made on first use
    master_fmt: MasterFormat = field(default_factory=lambda: master_format("fp32"))

    def master_fp32(self) -> torch.Tensor:
        """The master weights as fp32 (the buffer itself when fp32; a bf16 master widened,
        exactly)."""
        return self.master.float()

    def moments_fp32(self, lo: int = 0, hi: int | None = None):
        """(exp_avg, exp_avg_sq) of shard elements [lo, hi) as fp32 tensors (views for
        fp32 state, decoded copies otherwise); ``lo`` starts a block for 8- / 4-bit state."""
        hi = self.master.numel() if hi is None else hi
        return self.fmt.decode(self.exp_avg, self.exp_avg_sq, self.scales, lo, hi)

    def set_moments(self, lo: int, m32: torch.Tensor, v32: torch.Tensor) -> None:
        """Shard elements [lo, lo + len) <- fp32 moments, encoded (rounded to bf16, or to
        8- / 4-bit codes whose blocks start at ``lo``, a block start)."""
        self.fmt.encode(m32, v32, self.exp_avg, self.exp_avg_sq, self.scales, lo)

    def moment_parts(self, lo: int, hi: int):
        """(exp_avg, exp_avg_sq, scales) as the kernel takes them for shard elements
        [lo, hi), ``lo`` a block start for 8- / 4-bit state (scales from its block on)."""
        f, b = self.fmt, lo // self.fmt.block
        return (f.part(self.exp_avg, lo, hi), f.part(self.exp_avg_sq, lo, hi),
                None if self.scales is None else (self.scales[0][b:], self.scales[1][b:]))

    def swap_grads(self, pool: HostPool, index: int) -> None:
        """The delayed update's background step keeps reading the current buffers; the
        next backward lands in the other set."""
        if self.spare is None:
            g16 = self.grads.grad16
            self.spare = GradBuffers(1, pool.get(("grad16", 1), index, g16.dtype))
        self.grads, self.spare = self.spare, self.grads

    def nbytes(self) -> dict[str, int]:
        """Bytes of the buffers this state owns outright (not the pool's views), by the
        kinds `memory.estimate()` reports."""
        def size(ts):
            return sum(t.numel() * t.element_size() for t in ts)
        sets = [g for g in (self.grads, self.spare) if g is not None]
        sm, sv = self.scales or (None, None)
        return {
            "master": size([self.master]),
            "exp_avg": size([t for t in (self.exp_avg, sm) if t is not None]),
            "exp_avg_sq": size([t for t in (self.exp_avg_sq, sv) if t is not None]),
            "grad_accumulation": size([g.acc for g in sets if g.acc is not None]),
        }


def empty_state(layout: BucketLayout, dtype: torch.dtype, *, pool: HostPool,
                state_dtype: str | MomentFormat = "fp32", zero: bool = True,
                master_dtype: str | MasterFormat = "fp32", tier: Tier = Tier.HOST,
                device: torch.device | None = None) -> HostState:
    """Zero state for ``layout``'s shard in ``tier`` (all-zero codes and scales are zero
    moments in every ``state_dtype``; the padding stays zero for good), its 16-bit grads
    ``dtype``. ``zero=False``: uninitialized, for a caller that writes every element
    (`zero_gaps`). `Tier.DEVICE`: fp32 master and moments on ``device`` (the params'), whatever
    the formats asked (`Tier.formats`); its grad buffers are device memory too, from
    ``pool``."""
    state_dtype, master_dtype = tier.formats(state_dtype, master_dtype)
    fmt, mf = moment_format(state_dtype), master_format(master_dtype)
    make = functools.partial(torch.zeros if zero else torch.empty,
                             device=tier.state_device(device))
    state = HostState(master=make(layout.shard, dtype=mf.dtype), master_fmt=mf,
                      exp_avg=make(fmt.storage(layout.shard), dtype=fmt.dtype),
                      exp_avg_sq=make(fmt.storage(layout.shard), dtype=fmt.dtype),
                      grads=GradBuffers(0, pool.get(("grad16", 0), layout.index, dtype)),
                      fmt=fmt)
    if fmt.scaled:
        state.scales = (make(fmt.n_scales(layout.shard)), make(fmt.n_scales(layout.shard)))
    return state


def zero_gaps(layout: BucketLayout, state: HostState) -> None:
    """Zero every element of ``state`` outside this shard's params (alignment gaps, the
    padding) and every 8- / 4-bit block scale with no param element in its block."""
    covered = sorted((own.start, own.stop) for own, _ in map(layout.owned, layout.slots)
                     if own.start < own.stop)
    at, blocks, fmt = 0, 0, state.fmt
    for lo, hi in [*covered, (layout.shard, layout.shard)]:
        state.master[at:lo].zero_()
        for t in (state.exp_avg, state.exp_avg_sq):
            fmt.zero(t, at, lo)
        if state.scales is not None:
            for t in state.scales:
                t[blocks:lo // fmt.block].zero_()
        at, blocks = max(at, hi), max(blocks, -(-hi // fmt.block))


def state_from_params(layout: BucketLayout, dtype: torch.dtype, device: torch.device, *,
                      pool: HostPool, state_dtype: str | MomentFormat = "fp32",
                      master_dtype: str | MasterFormat = "fp32",
                      flat: torch.Tensor | None = None, tier: Tier = Tier.HOST) -> HostState:
    """State in ``tier`` for ``layout``'s shard from the params' current values (or
    ``flat``, rank 0's, broadcast); then each param becomes a fresh contiguous ``dtype``
    tensor on ``device`` (``param.data`` replaced, the Parameter kept): its own storage even
    if it had that dtype or shared a storage with another param before (a DTensor param gets
    a new local tensor, support.set_local). Moments start at zero."""
    state = empty_state(layout, dtype, pool=pool, state_dtype=state_dtype,
                        master_dtype=master_dtype, tier=tier, device=device)
    for s in layout.slots:
        shape = s.local().shape
        src = s.local().reshape(-1) if flat is None else flat[s.offset:s.offset + s.numel]
        own, mine = layout.owned(s)
        state.master[own].copy_(src[mine])  # from the original precision
        new = torch.empty(shape, dtype=dtype, device=device)
        new.view(-1).copy_(src)
        set_local(s.param, new)
    return state


class Window:
    """One bucket's part of the current accumulation window (docs/design.md, "Accumulation
    window"). Its fields change only through the methods below, in this order per backward:
    `open` (the exchange gives it a device buffer), `arrive` per param (the grad hook),
    `take_pending` and `land` (the exchange sends it), and `set_present` at the step."""

    def __init__(self, n_slots: int):
        self.present = [False] * n_slots  # slot i got a grad in this window
        self.arrived = 0  # grads arrived in the current backward
        self.landed = 0  # backward passes whose grads were sent to the host in this window
        self.last: torch.Tensor | None = None  # host buffer the latest sent grads land in
        self.pending: torch.Tensor | None = None  # device buffer of the current backward
        self.adds_to_sum = False  # `pending` holds earlier micro-steps: hooks add into it

    def open(self, pending: torch.Tensor, *, adds_to_sum: bool = False) -> None:
        """This backward's grads go into device buffer ``pending`` (``adds_to_sum``: it
        starts from the sum of earlier micro-steps, and the hooks add to it)."""
        self.pending, self.adds_to_sum = pending, adds_to_sum

    def arrive(self, i: int) -> bool:
        """Slot ``i``'s grad is in `pending`; whether every slot's now is."""
        self.present[i] = True
        self.arrived += 1
        return self.arrived == len(self.present)

    def take_pending(self) -> torch.Tensor:
        """The complete buffer, leaving the window ready for the next backward."""
        buf, self.pending, self.arrived, self.adds_to_sum = self.pending, None, 0, False
        return buf

    def land(self, host: torch.Tensor) -> None:
        """The buffer taken is on its way to host buffer ``host``."""
        self.last = host
        self.landed += 1

    def set_present(self, present: list[bool]) -> None:
        """Which slots got a gradient on any rank (the step's all-reduce)."""
        if len(present) != len(self.present):
            raise RuntimeError(f"internal: {len(present)} flags for {len(self.present)} slots")
        self.present = list(present)


@dataclass(eq=False)
class Bucket:
    """A bucket: its frozen layout, the state it owns, where that lives (its tier) and what
    updates it, and its window."""

    layout: BucketLayout
    state: HostState
    tier: Tier = Tier.HOST  # Tier.DEVICE for a device bucket (offload_fraction)
    updater: Updater = HOST_ADAM  # `updaters.updater_of(tier)`
    window: Window = field(init=False)

    def __post_init__(self):
        self.reset_window()

    def reset_window(self) -> None:
        self.window = Window(len(self.layout.slots))

    def grad(self) -> torch.Tensor:
        """The window's gradient of this shard: the fp32 sum, or the one landed backward."""
        return self.state.grads.acc if self.window.landed > 1 else self.window.last

    def add_last_to_sum(self, transport) -> None:
        """Before new grads land: add the last landed ones to the window's fp32 sum (the
        first ones are copied there), once they have landed (``transport``: this bucket's,
        `copier.Copier.of`; on CUDA on the copier's host-work thread; the next copy into the
        same buffer and any wait for this bucket wait for it)."""
        w, g = self.window, self.state.grads
        if not w.landed:
            return
        if g.acc is None:
            g.acc = torch.empty(self.layout.shard, dtype=torch.float32,
                                device=self.state.master.device)  # a device bucket's there
        acc, last, first = g.acc, w.last, w.landed == 1
        transport.after_landed(self.layout.index,
                            lambda: (acc.copy_ if first else acc.add_)(last))

    def out(self) -> torch.Tensor:
        """Where the CPU-Adam writes this shard's new 16-bit params when they are copied to
        the device (CUDA, the delayed update): over the 16-bit grads of the current set, read
        by then. The fp32 compute dtype has no 16-bit copy: the master itself where the
        landing buffer is pageable (the CPU), else the pinned landing buffer, into which
        `fill_from_master` copies the new master: a copy from pageable memory would be a
        blocking, driver-staged upload per param."""
        g16 = self.state.grads.grad16
        if g16.dtype == torch.float32 and not self.landing_pinned:
            return self.state.master
        return g16

    @functools.cached_property
    def landing_pinned(self) -> bool:
        # Both sets of landing buffers come from the engine's one pool: pinned alike.
        return self.state.grads.grad16.is_pinned()

    def fill_from_master(self, out: torch.Tensor) -> bool:
        """fp32 compute, ``out`` not the master: the whole shard's new master into ``out``
        (after the CPU-Adam; params that got no gradient keep their value). Returns whether
        it copied."""
        if out.dtype != torch.float32 or out is self.state.master:
            return False
        out.copy_(self.state.master)
        return True

    def fill_absent(self, out: torch.Tensor, present: list[bool]) -> None:
        """Slots that got no gradient (``present``): their current params, so that an
        upload of the whole shard leaves them as they are (rounding the master gives the
        device value bit for bit: the last upload, or the first cast, was that)."""
        if out.dtype == torch.float32:  # the master, or filled from it whole after the update
            return
        for s, got in zip(self.layout.slots, present):
            if not got:
                own, _ = self.layout.owned(s)
                out[own].copy_(self.state.master[own])

    @property
    def param_dtype(self) -> torch.dtype:
        return self.state.grads.grad16.dtype


class GradSlot(NamedTuple):
    """Where a param's gradient goes: its bucket, its slot's index there, and its elements
    [lo, hi) of the bucket's flat buffer (the grad hook's one lookup)."""

    bucket: Bucket
    index: int
    lo: int
    hi: int
