"""What updates a bucket's state, by its tier (tiers.py): `HOST_ADAM`, the compiled CPU-Adam
over host state (every bucket by default), and `DEVICE_ADAM`, torch's fused AdamW over state
that ``offload_fraction`` keeps on the params' device (docs/design.md, "Device buckets").
The bucket holds its updater beside its tier (`state.Bucket`), chosen at layout and re-layout
time (`updater_of`); update.py calls it per contiguous range and never asks which.
"""

from __future__ import annotations

import abc

import torch

from ..ops.adam_kernels import adam_update_unchecked
from ..ops.device_adam import adam_update_device
from ..ops.masters import step_key
from .tiers import Tier


class Updater(abc.ABC):
    """One AdamW step over one run of a bucket shard's state (`update.Run`)."""

    @abc.abstractmethod
    def __call__(self, b, grad, run, out, *, threads: int, sr_seed: int = 0) -> None:
        """Bucket ``b``'s state over ``run`` (host elements [lo, hi), one param group and
        step count) <- one step from ``grad`` times ``run.grad_scale``. ``out``: the buffer
        for the new 16-bit params (`Bucket.out`), an fp32 one (the master, or a copy of it
        that `Bucket.fill_from_master` makes) meaning none, or None: into each param's own
        storage (params on the CPU). ``sr_seed``: the stochastic rounding's seed of a bf16
        master (docs/design.md, "bf16 master")."""


class HostAdam(Updater):
    def __call__(self, b, grad, run, out, *, threads, sr_seed=0):
        s, g = b.state, run.hyper
        for a, z, out16, sr in _calls(b, run, out, sr_seed):
            # Unchecked: every buffer here was built and sized by this engine; the checks
            # cost ~100 us a call, 10% of a GPT-2-124M step on 2 cores.
            m, v, scales = s.moment_parts(a, z)
            adam_update_unchecked(
                s.master[a:z], grad[a:z], m, v,
                step=run.step, lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1],
                eps=g["eps"], weight_decay=g["weight_decay"], grad_scale=run.grad_scale,
                out16=out16, num_threads=threads, scales=scales, state_dtype=s.fmt.name,
                sr=sr)


def _calls(b, run, out, sr_seed: int):
    """(a, z, out16, sr) per kernel call of ``run``: host elements [a, z), where the new
    16-bit params go, and a bf16 master's rounding key with the index of element a in its
    param. In place, the new 16-bit values go straight into each param's own storage: one
    call per param (the kernel is bitwise the same for any split; with 8- / 4-bit moments
    every param starts on a block, layout.py); with a bf16 master one per param too (its
    key is per param: docs/design.md, "bf16 master"); else one for the run."""
    lay, stochastic = b.layout, b.state.master_fmt.stochastic
    if out is not None and not stochastic:
        return [(run.lo, run.hi, None if out.dtype == torch.float32 else out[run.lo:run.hi],
                 None)]
    calls = []
    for s, i, j in lay.pieces(run.lo + lay.start, run.hi + lay.start):
        a = s.offset + i - lay.start
        dst = s.flat()[i:j] if out is None else out[a:a + j - i]
        calls.append((a, a + j - i, dst,
                      (step_key(sr_seed, run.step, s.index), i) if stochastic else None))
    return calls


class DeviceAdam(Updater):
    """fp32 master and moments on the device (their state_dtype is always fp32: see
    docs/design.md, "Device buckets"): one multi-tensor fused step per run, the run split
    per param in every path (on the CPU the fused kernel's result depends on the split)."""

    def __call__(self, b, grad, run, out, *, threads, sr_seed=0):
        s, g = b.state, run.hyper  # fp32 master: no stochastic rounding, sr_seed unused
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


def updater_of(tier: Tier) -> Updater:
    """The updater of a bucket whose state lives in ``tier``."""
    return {Tier.HOST: HOST_ADAM, Tier.DEVICE: DEVICE_ADAM}[tier]
