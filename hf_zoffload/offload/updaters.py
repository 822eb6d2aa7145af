"""What updates a bucket's state, by where the state lives: `HOST_ADAM`, the compiled CPU-Adam
over host state (every bucket by default), and `DEVICE_ADAM`, torch's fused AdamW over state
that ``offload_fraction`` keeps on the params' device (docs/design.md, "Device buckets").
The bucket holds its updater (`state.Bucket.updater`), chosen at layout and re-layout time;
update.py calls it per contiguous range and never asks which.
"""

from __future__ import annotations

import abc

import torch

from ..ops.cpu_adam import adam_update_unchecked
from ..ops.device_adam import adam_update_device
from ..ops.moments import QBLOCK


class Updater(abc.ABC):
    """One AdamW step over one run of a bucket shard's state (`update.Run`)."""

    on_device = False  # the state lives on the params' device (memory reports count it there)

    @abc.abstractmethod
    def __call__(self, b, grad, run, out, *, threads: int) -> None:
        """Bucket ``b``'s state over ``run`` (host elements [lo, hi), one param group and
        step count) <- one step from ``grad`` times ``run.grad_scale``. ``out``: the buffer
        for the new 16-bit params (`Bucket.out`), an fp32 one (the master, or a copy of it
        that `Bucket.fill_from_master` makes) meaning none, or None: into each param's own
        storage (params on the CPU)."""


class HostAdam(Updater):
    def __call__(self, b, grad, run, out, *, threads):
        s, g = b.state, run.hyper
        # In place, the new 16-bit values go straight into each param's own storage: one
        # call per param (the kernel is bitwise the same for any split; with 8-bit moments
        # every param starts on a block, layout.py).
        parts = b.layout.param_pieces(run.lo, run.hi) if out is None else \
            [(run.lo, run.hi, None if out.dtype == torch.float32 else out[run.lo:run.hi])]
        for a, z, out16 in parts:
            # Unchecked: every buffer here was built and sized by this engine; the checks
            # cost ~100 us a call, 10% of a GPT-2-124M step on 2 cores.
            adam_update_unchecked(
                s.master[a:z], grad[a:z], s.exp_avg[a:z], s.exp_avg_sq[a:z],
                step=run.step, lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1],
                eps=g["eps"], weight_decay=g["weight_decay"], grad_scale=run.grad_scale,
                out16=out16, num_threads=threads,
                scales=None if s.scales is None else
                (s.scales[0][a // QBLOCK:], s.scales[1][a // QBLOCK:]))


class DeviceAdam(Updater):
    """fp32 master and moments on the device (their state_dtype is always fp32: see
    docs/design.md, "Device buckets"): one multi-tensor fused step per run, the run split
    per param in every path (on the CPU the fused kernel's result depends on the split)."""

    on_device = True

    def __call__(self, b, grad, run, out, *, threads):
        s, g = b.state, run.hyper
        pieces = list(b.layout.param_pieces(run.lo, run.hi))
        outs = [view if out is None else None if out.dtype == torch.float32 else out[a:z]
                for a, z, view in pieces]
        adam_update_device([s.master[a:z] for a, z, _ in pieces],
                           [grad[a:z] for a, z, _ in pieces],
                           [s.exp_avg[a:z] for a, z, _ in pieces],
                           [s.exp_avg_sq[a:z] for a, z, _ in pieces],
                           step=run.step, lr=g["lr"], beta1=g["betas"][0],
                           beta2=g["betas"][1], eps=g["eps"], weight_decay=g["weight_decay"],
                           grad_scale=run.grad_scale, outs=outs)


HOST_ADAM, DEVICE_ADAM = HostAdam(), DeviceAdam()
