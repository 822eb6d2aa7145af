"""Step schedules: when a step's buckets are planned, updated and published (docs/design.md,
"Step schedules"). `make_schedule` is the one place that picks one from the settings."""

from __future__ import annotations

from .base import Schedule, Steps
from .delayed_update import Delayed
from .overlapped import Overlapped
from .synchronous import Synchronous

__all__ = ["Schedule", "Steps", "Synchronous", "Delayed", "Overlapped", "make_schedule"]


def make_schedule(plugin, *, params_on_host: bool, cpu_threads: int) -> Schedule:
    """The schedule the settings ask for: ``overlap_step`` (refused with FSDP2 parameter
    offload: FSDP2 reduces and offloads the gradients itself, and they reach the engine
    only at ``step()``), ``delayed_update``, else synchronous. The plugin refuses both at
    once, and overlap_step with state other than fp32 (config.py)."""
    if plugin.overlap_step:
        if params_on_host:
            raise ValueError("ZeRO-Offload setting 'overlap_step' with FSDP2 parameter "
                             "offload: FSDP2 hands the engine its gradients only at step(), "
                             "so there is nothing to overlap; allowed: overlap_step false")
        return Overlapped(cpu_threads)
    if plugin.delayed_update:
        return Delayed(plugin.delayed_update_warmup_steps)
    return Synchronous()
