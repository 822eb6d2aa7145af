"""The engine's parts, built in their one valid order: `build` returns them as a record
(`Parts`) that `ZeroOffloadOptimizer.__init__` takes over.

The order, stated once here: the cores are bound before anything is allocated (the host
state's pages are first touched from the cores this rank keeps); the parallel mode is resolved
(a layout the engine cannot train refused) before any param is cast; the host memory is
checked before any host state is allocated; the params get their compute-dtype tensors
(`state.state_from_params`) before the exchange re-reads them (`Exchange.params_recast`) and
before the engine notes their storage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import ZeroOffloadPlugin
from ..ops.masters import MasterFormat, master_format
from ..ops.moments import MomentFormat, moment_format
from .copier import Copier, make_copier
from .fraction import TierPolicy, make_tier_policy
from .hooks import ModuleWaits
from .host import HostPool
from .layout import Slot, build_layouts, collect_slots
from .memory import check_host_memory, human
from .modes.exchange import Exchange
from .modes.resolve import ParallelMode, make_exchange, resolve
from .progress import Progress
from .reorder import BucketOrder
from .state import Bucket, state_from_params
from .support import local
from .threads import bind_local_rank, cpu_threads, host_threads
from .tiers import Tier
from .updaters import updater_of

logger = logging.getLogger(__name__)


@dataclass
class Parts:
    """What `build` made, for the engine to hold."""

    bound_cpus: object  # the cores this rank was bound to (None: not bound)
    cpu_threads: int  # host threads of the CPU-Adam and the host passes
    moments: MomentFormat  # state_dtype
    masters: MasterFormat  # master_dtype
    slots: list[Slot]  # the trainable params, in param-group order
    device: torch.device
    dtype: torch.dtype  # the compute dtype
    copier: Copier
    mode: ParallelMode
    exchange: Exchange
    order: BucketOrder
    tiering: TierPolicy
    pool: HostPool
    buckets: list[Bucket]
    module_waits: ModuleWaits | None
    frozen: tuple[torch.nn.Parameter, ...]  # frozen params beside the trained ones


def build(param_groups: list[dict], plugin: ZeroOffloadPlugin, *, process_group,
          param_order, model: torch.nn.Module | None, engine_sync) -> Parts:
    """The engine's parts for ``param_groups`` (torch.optim's, validated) and ``plugin``;
    ``engine_sync()`` reads the engine's ``sync_gradients`` (data parallel)."""
    bound = bind_local_rank() if plugin.bind_cores else None
    threads = cpu_threads(plugin.cpu_threads, bound=bound is not None, log=True)
    if param_order is None and model is not None:
        param_order = model.parameters()
    moments = moment_format(plugin.state_dtype)
    plugin.check_master()  # compute_dtype may have been set after the plugin was made
    masters = master_format(plugin.master_dtype)
    names = None if model is None else {id(p): n for n, p in model.named_parameters()}
    slots = collect_slots(param_groups, order=param_order, state_dtype=moments, names=names)
    device = slots[0].param.device
    plugin.check_device(device.type)
    dtype = plugin.torch_dtype
    pin = device.type == "cuda" and plugin.pin_memory
    made = make_copier(device, pin=pin, threads=threads)
    copier = Copier(made, made)
    mode = resolve(process_group, slots=slots, model=model, device=device, dtype=dtype)
    exchange = make_exchange(mode, device=device, copier=copier, dtype=dtype,
                             engine_sync=engine_sync)
    if exchange.params_on_host and plugin.offload_fraction_value != 1.0:
        # FSDP2's sharded params live on the host: there is no device copy for a device
        # bucket's state to update (modes/fsdp2_offload.py)
        raise ValueError(f"ZeRO-Offload setting 'offload_fraction' "
                         f"{plugin.offload_fraction!r} with FSDP2 parameter offload: the "
                         "params live on the host, so all optimizer state does; allowed: 1")
    # Buckets fill in reverse param order until the first backward shows the real order
    # (reorder.py).
    order = BucketOrder([s.index for s in slots[::-1]], dict(
        bucket_numel=max(1, int(plugin.bucket_size_mb * 2**19)), align=moments.align))
    layouts = build_layouts(slots[::-1], rank=exchange.rank, world=exchange.world,
                            **order.layout_args)
    # Which buckets keep their state on the device (fraction.py): chosen again at the
    # re-layout, where `auto` decides from the first step's peak.
    tiering = make_tier_policy(plugin, device)
    tiers = tiering.tiers(layouts)
    needed = check_host_memory([lay for lay, t in zip(layouts, tiers) if t is Tier.HOST],
                               param_dtype=dtype, plugin=plugin, pinned=pin,
                               world=exchange.world)  # before allocating
    # Uploaded params: each module's forward waits for its own buckets only (they go up in
    # forward order), so the first layers compute while the last ones still upload.
    waits = ModuleWaits(copier.streams) \
        if model is not None and copier.streams.forwards_wait() else None
    pool = HostPool(layouts, pin=pin, tiers=tiers, device=device)
    buckets = build_buckets(layouts, pool, needed, exchange=exchange, dtype=dtype,
                            device=device, moments=moments, masters=masters, threads=threads)
    exchange.params_recast()  # FSDP2 re-reads the params' new local tensors
    # Frozen params beside the trained ones (a LoRA model's base, quantized or not), of the
    # groups and of ``model``: left as they are, in any dtype (not cast, not laid out); the
    # memory report counts their bytes by dtype (`memory.frozen_bytes`).
    frozen = {id(p): p for g in param_groups for p in g["params"] if not p.requires_grad}
    if model is not None:
        frozen.update((id(p), p) for p in model.parameters() if not p.requires_grad)
    return Parts(bound, threads, moments, masters, slots, device, dtype, copier, mode,
                 exchange, order, tiering, pool, buckets, waits, tuple(frozen.values()))


def build_buckets(layouts, pool: HostPool, needed: dict[str, int], *, exchange: Exchange,
                  dtype: torch.dtype, device: torch.device, moments, masters,
                  threads: int) -> list[Bucket]:
    """The state of every bucket, in the tier ``pool`` holds for it, from the params' values
    (each param then becomes its compute-dtype copy), logged with its size and seconds:
    seconds per GiB."""
    landing = sum(v for k, v in needed.items() if k.startswith("grad_"))
    progress = Progress(logger, "allocating the host state", sum(needed.values()),
                        detail=f"{human(landing)} of grad landing buffers"
                               f"{', pinned' if pool.pin else ''}")
    buckets, own = [], 0
    with host_threads(threads):
        for lay in layouts:
            tier = pool.tiers[lay.index]
            buckets.append(Bucket(lay, state_from_params(
                lay, dtype, device, pool=pool, state_dtype=moments, master_dtype=masters,
                flat=exchange.initial_values(lay), tier=tier), tier, updater_of(tier)))
            own += sum(buckets[-1].state.nbytes().values()) if tier is Tier.HOST else 0
            progress.at(own + sum(pool.held().values()))  # the pool: on first use
    progress.done(f"pinning {pool.alloc_seconds:.2f} s" if pool.pin else "")
    return buckets


def frozen_numel(frozen) -> int:
    """Elements of the frozen params this rank holds (their local tensors)."""
    return sum(local(p).numel() for p in frozen)
