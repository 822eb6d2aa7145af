"""What a bucket owns on the host, and what one accumulation window tracks about it.

`HostState`: this rank's shard of the fp32 master weights and both Adam moments, the 16-bit
staging buffer the CPU-Adam writes new params into (CUDA and the delayed update), and the
gradient landing buffers (`GradBuffers`), two sets of them with the delayed update, whose
background step reads one set while the next backward fills the other. Buffers that device
copies touch are views of the engine's `HostPool` (host.py), which counts them.

`Window`: per-bucket bookkeeping of one accumulation window (every backward since the last
``step()`` / ``zero_grad()``): docs/design.md, "Accumulation window".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .host import HostPool
from .layout import BucketLayout


@dataclass(eq=False)
class GradBuffers:
    """Where reduced gradients of this rank's shard land on the host."""

    which: int  # 0 or 1: the set (the pool's kinds are per set)
    grad16: torch.Tensor  # compute dtype: the latest backward's grads (pool view)
    grad32: torch.Tensor | None = None  # fp32: a reduced sum over micro-steps (pool view)
    acc: torch.Tensor | None = None  # fp32 sum of the window's earlier backwards (pageable)


@dataclass(eq=False)
class HostState:
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grads: GradBuffers
    staging: torch.Tensor | None = None  # new 16-bit params; mirrors the device params
    spare: GradBuffers | None = None  # the delayed update's second set, made on first use

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
        return {
            "master": size([self.master]),
            "exp_avg": size([self.exp_avg]),
            "exp_avg_sq": size([self.exp_avg_sq]),
            "grad_accumulation": size([g.acc for g in sets if g.acc is not None]),
        }


def place(layout: BucketLayout, dtype: torch.dtype, device: torch.device, *, pool: HostPool,
          staging: bool, flat: torch.Tensor | None = None) -> HostState:
    """Host state for ``layout``'s shard from the params' current values (or ``flat``, rank
    0's, broadcast); then each param becomes a fresh contiguous ``dtype`` tensor
    (``param.data`` replaced, the Parameter kept): its own storage even if it had that dtype
    or shared a storage with another param before."""
    master = torch.zeros(layout.shard, dtype=torch.float32)  # zeros: the padding
    for s in layout.slots:
        src = s.param.detach().reshape(-1) if flat is None else \
            flat[s.offset:s.offset + s.numel]
        own, mine = layout.owned(s)
        master[own].copy_(src[mine])  # from the original precision
        new = torch.empty(s.param.shape, dtype=dtype, device=device)
        new.view(-1).copy_(src)
        s.param.data = new
    state = HostState(master=master,
                      exp_avg=torch.zeros(layout.shard, dtype=torch.float32),
                      exp_avg_sq=torch.zeros(layout.shard, dtype=torch.float32),
                      grads=GradBuffers(0, pool.get(("grad16", 0), layout.index, dtype)))
    if staging and dtype != torch.float32:
        # Mirrors the device params at all times, so uploading a whole bucket (or shard)
        # never changes params that got no gradient. Padding: zeros, never written.
        state.staging = pool.get(("staging",), layout.index, dtype)
        state.staging.zero_()
        layout.copy_from_params(state.staging, layout.start)
    return state


@dataclass(eq=False)
class Window:
    """One bucket's part of the current accumulation window."""

    present: list[bool]  # slot i got a grad in this window
    arrived: int = 0  # grads arrived in the current backward
    landed: int = 0  # backward passes whose grads were sent to the host in this window
    last: torch.Tensor | None = None  # the host buffer the latest sent grads land in
    pending: torch.Tensor | None = None  # device buffer collecting the current backward
    prefilled: bool = False  # `pending` starts from earlier micro-steps: hooks add into it

    def take_pending(self) -> torch.Tensor:
        """The complete buffer, leaving the window ready for the next backward."""
        buf, self.pending, self.arrived, self.prefilled = self.pending, None, 0, False
        return buf


@dataclass(eq=False)
class Bucket:
    """A bucket: its frozen layout, the host state it owns, and its window."""

    layout: BucketLayout
    state: HostState
    window: Window = field(init=False)

    def __post_init__(self):
        self.reset_window()

    def reset_window(self) -> None:
        self.window = Window(present=[False] * len(self.layout.slots))

    def grad(self) -> torch.Tensor:
        """The window's gradient of this shard: the fp32 sum, or the one landed backward."""
        return self.state.grads.acc if self.window.landed > 1 else self.window.last

    def fold(self, copier) -> None:
        """Before new grads land: move the last landed ones into the fp32 sum, once they
        have landed (on CUDA on the copier's host-work thread; the next copy into the same
        buffer and any wait for this bucket wait for it)."""
        w, g = self.window, self.state.grads
        if not w.landed:
            return
        if g.acc is None:
            g.acc = torch.empty(self.layout.shard, dtype=torch.float32)
        acc, last, first = g.acc, w.last, w.landed == 1
        copier.after_landed(self.layout.index,
                            lambda: (acc.copy_ if first else acc.add_)(last))

    def new_params(self) -> torch.Tensor | None:
        """The host buffer holding this shard's new params after the CPU-Adam: the staging
        buffer, the master itself for fp32 compute, or None when the CPU-Adam wrote them
        into the params' storage in place (params on the CPU, no delayed update)."""
        if self.state.staging is not None:
            return self.state.staging
        return self.state.master if self.state.master.dtype == self.param_dtype else None

    @property
    def param_dtype(self) -> torch.dtype:
        return self.state.grads.grad16.dtype
