"""Where a bucket's optimizer state lives: its tier.

`Tier.HOST`: host memory, updated by the CPU-Adam, in any state format; its gradients travel
from the device and its new params back. `Tier.DEVICE` (``offload_fraction``): the params'
device, fp32, updated there by torch's fused AdamW; nothing is copied (docs/design.md,
"Device buckets"). A bucket holds its tier beside its updater (`state.Bucket`); the tier
decides where `host.HostPool` allocates the bucket's buffers and what the state is made of
(here), which transport moves its copies (`copier.Copier.of`) and which updater steps it
(`updaters.updater_of`). Another tier (NVMe, say) is a member here, a transport and an
updater.
"""

from __future__ import annotations

import enum

import torch


class Tier(enum.Enum):
    HOST = "host"
    DEVICE = "device"

    def state_device(self, device: torch.device) -> torch.device | None:
        """Where this tier's master and moments are allocated, for params on ``device``
        (None: pageable host memory)."""
        return device if self is Tier.DEVICE else None

    def formats(self, state_dtype, master_dtype) -> tuple:
        """The (moment, master) formats this tier keeps for the configured ones: fp32 on
        the device, where torch's fused AdamW takes fp32 state only."""
        return ("fp32", "fp32") if self is Tier.DEVICE else (state_dtype, master_dtype)
