"""`ZeroOffloadOptimizer`: the ZeRO-Offload data path.

Device: the trainable params, cast to ``compute_dtype``, each in its own storage (layout.py).
Host: fp32 master weights and Adam moments (fp32, bf16 or 8-bit: ``state_dtype``) per bucket
(state.py), updated by the one-pass CPU-Adam, which also writes the new 16-bit params: over the
bucket's 16-bit grads it has just read, copied back one copy per param (CUDA, delayed update),
or on the CPU straight into each param's storage.

Per backward, each gradient goes into its bucket's flat buffer and a complete bucket to the
exchange of the parallel mode (modes/: resolve.py decides it; one process, data parallel,
DTensor shards, FSDP2's sharded host params), which checks it and lands it on the host
through the copier (copier.py).
See docs/design.md, "Data flow" and "Accumulation window".

The engine holds its parts, which build.py makes in their one valid order: the copier and the
exchange (their interfaces in copier.py and modes/exchange.py), the bucket order (reorder.py),
the tier policy (fraction.py), the module waits (hooks.py); and the delayed update
(delayed.py). Checkpoints are checkpoint.py's functions over the engine's facts.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import math
import time

import torch

from ..config import ZeroOffloadPlugin
from ..ops.adam_kernels import check_hyper
from ..ops.masters import SR_SEED
from ..ops.scaling import kernel_backend, unscale_check_, unscale_check_host_
from ..optim.loss_scaler import DynamicLossScaler
from .build import build, frozen_numel
from .checkpoint import load_master_state_dict, load_state_dict, master_state_dict, state_dict
from .hooks import queue_at_backward_end, register_grad_hooks, register_module_waits
from .host import HostPool
from .memory import EngineFacts, engine_report
from .modes.collectives import accelerate_sync, wants_sync
from .params import ParamWatch, check_unmoved
from .progress import Progress
from .reorder import relayout
from .schedules import make_schedule
from .state import Bucket, GradSlot
from .support import check_clip_args, local_grad
from .threads import host_threads

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Where the engine is in a step (as FSDP2's ``TrainingState``)."""

    IDLE = "idle"  # between backwards: none is streaming gradients
    BACKWARD = "backward"  # a backward streams gradients (first grad hook to its end)
    FINALIZED = "finalized"  # the window's grads were read (clip_grad_norm_, step): no
    # backward until step() opens the next window
    CLOSED = "closed"  # close(): no hooks, no host state; step() and the rest raise


class ZeroOffloadOptimizer(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments in host memory (ZeRO-Offload).

    The hyperparameters and their defaults are torch.optim.AdamW's (weight_decay 0.01,
    decoupled). Build it after the model is on its device. It casts the trainable params
    passed to it to ``plugin.compute_dtype`` in place; frozen params, of any dtype (a quantized
    base's uint8 codes), are left alone and get no host state. Use it
    as any torch optimizer (schedulers change ``param_groups[i]["lr"]``); for fp16, scale the
    loss with ``optimizer.backward(loss)`` or through ``accelerator.backward`` once the
    engine's ``loss_scaler`` is installed as accelerate's scaler. The Adam moments are kept
    as ``plugin.state_dtype`` says (fp32, bf16 or 8-bit: `hf_zoffload.ops.moments`); the
    master weights are fp32 in every mode.

    Accumulation boundary: ``step()`` applies the sum of every backward since the previous
    ``step()`` / ``zero_grad()``; callers step only at the boundary (accelerate's
    ``sync_gradients`` does this for ``AcceleratedOptimizer``). ``model.zero_grad()`` does not
    discard streamed gradients; ``optimizer.zero_grad()`` does.

    ``model`` (optional; the integrations pass it): the module these params belong to. Its
    param order is the first guess of the bucket order (``param_order`` overrides); from the
    second step on the buckets follow the order the first backward produced gradients
    (``bucket_order``). With params on a GPU each submodule's forward then waits only for the
    uploads of its own params, and the model's ``state_dict()`` for those it saves; code that
    reads params in another way between ``step()`` and the next forward calls ``flush()``.

    Delayed update (``plugin.delayed_update``): after ``delayed_update_warmup_steps`` applied
    steps, ``step()`` starts the CPU update of step i in a background thread and returns; the
    new params are copied to the device at the next ``step()``. So the forward/backward of
    step i+1 runs on the params of step i-1: each gradient is applied one step late.
    ``state_dict()``, ``load_state_dict()`` and ``zero_grad()`` first finish a pending update.

    Overlapped step (``plugin.overlap_step``): during the backward that ends the window,
    each host bucket's CPU-Adam starts as soon as its gradient is on the host; ``step()``
    validates it (the same plan: no clipping, no fp16 overflow, the same hyperparameters),
    undoes and redoes what it must, and publishes the params. Bitwise the synchronous step
    where speculation holds, else within the bound of docs/protocols/step.md. A loop that
    accumulates tells the engine which micro-step is the last (``no_sync()`` for the
    others, or accelerate's ``accumulate()``).

    Device buckets (``plugin.offload_fraction`` below 1, or ``auto``): the buckets of the
    first layers in forward order keep fp32 master weights and moments on the params' device
    and are updated there by torch's fused AdamW, their grads never leaving it; the rest as
    above (docs/design.md, "Device buckets"). ``auto`` decides after the first step.

    Data parallel (torch.distributed initialized with N > 1 ranks, or ``process_group=``):
    every rank builds the engine over the same unwrapped params (no DDP), runs the same
    calls, ends each step with identical params and holds 1/N of the optimizer state.
    ``sync_gradients`` (``no_sync()``, else accelerate's, else True) only decides when
    bytes move. ``state_dict()`` is a collective that leaves the state on rank 0 (call
    ``consolidate_state_dict()`` on every rank where only one rank saves); ``load_state_dict``
    takes a state saved with any number of ranks. A collective whose peer died raises,
    naming this rank and the collective (docs/design.md, "Data-parallel protocol").

    FSDP2 parameter offload (``model`` holds ``fully_shard`` modules with
    ``CPUOffloadPolicy``, the root one included): FSDP2 moves the params and reduces the
    grads; the engine keeps the fp32 state of this rank's shards and writes the new values
    into FSDP2's sharded host params, which become the compute-dtype copy. Build it after
    ``fully_shard`` and before the first forward (docs/design.md, "FSDP2 parameter offload").
    """

    fused_loss_scaling = True  # the scaler protocol: we unscale and check inside step()

    @property
    def _is_accelerate_prepared(self):
        # accelerate's prepare() reads this of every optimizer it is given (1.15-1.16); the
        # integrations hand it a wrapper instead. Given the engine itself (a stock Trainer's
        # optimizers= / optimizer_cls_and_kwargs=, a loop's accelerator.prepare), accelerate
        # would clip no gradient (they are on the host), log grad_norm 0 and save the 16-bit
        # weights: refused before any step.
        raise ValueError(
            "a ZeroOffloadOptimizer was passed to accelerator.prepare, which would train it "
            "without clipping, grad_norm or the fp32 masters saved: in an Accelerate loop use "
            "hf_zoffload.prepare_zero_offload(accelerator, model, optimizer, ...); with a "
            "Trainer use hf_zoffload.zero_offload_trainer(<the Trainer class>) with "
            "zero_offload=True arguments (it builds the optimizer; pass no optimizers=)")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 plugin: ZeroOffloadPlugin | None = None, process_group=None,
                 param_order=None, model: torch.nn.Module | None = None):
        check_hyper(lr, betas, eps, weight_decay, where="ZeroOffloadOptimizer")
        if plugin is None:
            plugin = ZeroOffloadPlugin.from_sources()
        if not isinstance(plugin, ZeroOffloadPlugin):
            raise TypeError(f"plugin must be a ZeroOffloadPlugin, got {type(plugin).__name__}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)  # rejects a param listed in two groups
        self.plugin = plugin
        plugin.check_schedule()  # one schedule, fp32 state for overlap_step: before any work
        self.sync_gradients: bool | None = None  # None: follow accelerate, else True
        # Every part, in its one valid order (build.py).
        parts = build(self.param_groups, plugin, process_group=process_group,
                      param_order=param_order, model=model,
                      engine_sync=lambda: self.sync_gradients)
        self.bound_cpus, self.cpu_threads = parts.bound_cpus, parts.cpu_threads
        self.moments, self.masters = parts.moments, parts.masters
        self.device, self.dtype = parts.device, parts.dtype
        self.copier, self.mode, self.exchange = parts.copier, parts.mode, parts.exchange
        self.order, self.tiering = parts.order, parts.tiering
        self.module_waits = parts.module_waits
        self._install(parts.pool, parts.buckets)
        slots = parts.slots
        # The seed of a bf16 master's stochastic rounding (checkpoints carry it).
        self.sr_seed = SR_SEED
        self.accumulates = False  # a window summed several backwards (`auto` counts it)
        self._stepped = False  # a step has ended (the first one's end decides `auto`)
        # Per-param Adam step, as torch keeps it; counted on every rank for every param.
        self.param_steps = {s.index: 0 for s in slots}
        self.frozen: tuple[torch.nn.Parameter, ...] = parts.frozen
        self.n_frozen = frozen_numel(self.frozen)
        self.applied_steps = 0  # steps that updated the params (not skipped)
        self.loss_scaler = DynamicLossScaler(enabled=plugin.compute_dtype == "fp16", **{
            k: getattr(plugin, k) for k in ("init_scale", "growth_factor", "backoff_factor",
                                            "growth_interval", "hysteresis", "min_scale")})
        # On the CPU the host form of the check (bitwise the reference, fewer passes).
        self._check_kernel = unscale_check_host_ if self.device.type == "cpu" and \
            kernel_backend(self.device, plugin.kernels) == "torch" else \
            functools.partial(unscale_check_, backend=plugin.kernels)
        # [whole params, tensor-parallel shards]: the norm counts them differently
        self._found_inf, self._sumsq, self._ones = (
            torch.full((n,), x, dtype=torch.float32, device=self.device)
            for x, n in ((0, 1), (0, 2), (1, 1)))
        self._sumsq_part = (self._sumsq[0:1], self._sumsq[1:2])
        self.phase = Phase.IDLE
        self._stats: tuple[bool, float] | None = None  # (overflow, norm) once FINALIZED
        # When each bucket is planned, updated and published (schedules/): chosen once.
        self.schedule = make_schedule(plugin, params_on_host=self.exchange.params_on_host,
                                      cpu_threads=self.cpu_threads)
        # The max_norm the last step clipped to: what an overlapped update speculates under.
        self._clip_hint = plugin.max_grad_norm
        self._checked: list[Bucket] = []  # buckets checked by the exchange, not yet told
        self._consolidated = None
        self.grad_norm, self.last_step_skipped, self.skipped_steps = None, False, 0
        # Seconds of the last step, each named for what it measures (docs/design.md,
        # "Timings"); on CUDA also d2h_copy / h2d_copy, from events.
        self.timings = {"fwd_bwd": 0.0, "grad_wait": 0.0, "cpu_adam": 0.0, "upload_host": 0.0}
        self._t_step_end: float | None = None
        self._reset_window()
        self._hooks = register_grad_hooks(self, "_grad_hook", [s.param for s in slots])
        if self.module_waits is not None:
            self._hooks += register_module_waits(self.module_waits, "before", model,
                                                 [s.param for s in slots])
        self.closed = False

    def _install(self, pool: HostPool, buckets: list[Bucket]) -> None:
        """Buckets (new, or re-laid out) and the pool their landing buffers come from."""
        self.host_pool, self.buckets = pool, buckets
        self.exchange.attach(buckets, self._check, pool)
        self._where = {s.param: GradSlot(b, i, s.offset, s.offset + s.numel)
                       for b in buckets for i, s in enumerate(b.layout.slots)}
        if self.module_waits is not None:
            self.module_waits.follow(buckets)
        self._watch = ParamWatch(buckets)

    # ------------------------------------------------------------- public facts
    @property
    def update_in_flight(self) -> bool:
        """An update of the schedule is running, or its params are not on the device yet
        (the delayed update; an overlapped one before its step)."""
        return self.schedule.in_flight

    @property
    def order_settled(self) -> bool:
        """The buckets follow the first backward's order (reorder.py)."""
        return self.order.settled

    def speculation(self) -> tuple[float | None, float]:
        """What an overlapped update assumes (`schedules.Steps.speculation`)."""
        if not self.loss_scaler.is_enabled() and self._clip_hint == 0:
            return None, self._inv_scale()
        return self._clip_hint, self._inv_scale()

    def settle_step(self, overflow: bool, norm: float) -> float | None:
        """The loss scale updated from ``overflow``; the step's grad_scale, or None when
        the step is skipped (`schedules.Steps.settle_step`)."""
        if self.loss_scaler.is_enabled():
            self.loss_scaler.update_scale(overflow)
        self.last_step_skipped = bool(overflow and self.loss_scaler.is_enabled())
        if self.last_step_skipped:
            self.skipped_steps += 1
            return None
        # An explicit clip_grad_norm_ follows torch (0 zeroes the update); the plugin's
        # max_grad_norm uses 0 for "off".
        max_norm = self._clip if self._clip is not None else self.plugin.max_grad_norm
        coef = min(1.0, max_norm / (norm + 1e-6)) \
            if self._clip is not None or max_norm > 0 else 1.0
        self.applied_steps += 1
        return self._inv_scale() * coef

    def params_written(self) -> None:
        """The params got new values from the host (`schedules.Steps.params_written`)."""
        self._watch.note_written()

    def host_views(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """1-D views of the host state of ``param``'s elements this rank holds (all of them
        in one process): ``master``, ``exp_avg``, ``exp_avg_sq`` (the stored moments: codes
        for 8- and 4-bit state)."""
        b, i = self._where[param][:2]
        own, _ = b.layout.owned(b.layout.slots[i])
        s = b.state
        m, v, _ = s.moment_parts(own.start, own.stop)  # 4-bit: the param's bytes
        return {"master": s.master[own], "exp_avg": m, "exp_avg_sq": v}

    # ----------------------------------------------------------- grad stream
    def _grad_hook(self, p: torch.Tensor) -> None:
        # Runs once per param per backward on the autograd thread: kept to lookups and one
        # copy (its place in the bucket is precomputed in self._where).
        if p.grad is None:
            return
        b, i, lo, hi = self._where[p]
        w = b.window
        self.order.note(b.layout.slots[i].index)
        if self.phase is not Phase.BACKWARD:
            if self.phase is Phase.FINALIZED:
                raise RuntimeError("backward after clip_grad_norm_() and before step(): "
                                   "clip only once the gradients of this step are complete")
            check_unmoved(self.buckets, self.device, self.dtype)
            self.phase = Phase.BACKWARD
            self.schedule.begin_backward(
                self, final=wants_sync(self.sync_gradients),
                explicit=self.sync_gradients is not None or accelerate_sync() is not None)
            self.exchange.begin_backward()
            # Buckets with a param that got no grad never complete: flush them at the end
            # of the outermost backward (hooks.py: reentrant checkpointing nests backwards).
            queue_at_backward_end(self._end_backward)
        if w.pending is None:
            self.exchange.open(b)
        dst = w.pending[lo:hi]
        self.exchange.wait_for_grad(p)  # FSDP2 on torch 2.11: its copy may be in flight
        (dst.add_ if w.adds_to_sum else dst.copy_)(local_grad(p, p.grad).reshape(-1))
        p.grad = None  # the device keeps no full gradient copy
        if w.arrive(i):
            self.exchange.send(b)
            self._tell_landed()

    def _check(self, buf, b: Bucket) -> None:
        inv = self.loss_scaler.inv_scale_tensor(self.device) if self.loss_scaler.is_enabled() \
            else self._ones
        self._check_kernel(buf, inv, self._found_inf, self._sumsq_part[b.layout.sharded])
        self._checked.append(b)  # its copy to the host follows in the same exchange call

    def _tell_landed(self) -> None:
        # After an exchange call has returned: each bucket it checked has its host copy
        # queued (with gloo, a reduction may finish inside a later call).
        checked, self._checked = self._checked, []
        for b in checked:
            self.schedule.landed(self, b)

    def _end_backward(self) -> None:
        ended = self.phase is Phase.BACKWARD
        if ended:
            self.phase = Phase.IDLE
            self.order.end_backward()
        for b in self.buckets:
            if b.window.pending is not None:
                self.exchange.send(b)
        self.exchange.end_backward(ended)
        self._tell_landed()
        if ended:
            self.schedule.end_backward(self)

    # ------------------------------------------------------------------ step
    def _finalize(self) -> tuple[bool, float]:
        """Wait for this window's grads; return (overflow, unscaled global norm)."""
        if self.phase is Phase.FINALIZED:
            return self._stats
        self._end_backward()
        t0 = time.perf_counter()
        self.exchange.end_window()
        self._tell_landed()  # reductions that finished only now (gloo) still go early
        self.schedule.end_window(self)  # nothing of the schedule reads the grads from here
        live = [b for b in self.buckets if b.window.landed]
        for b in live:
            self.copier.of(b).wait_landed(b.layout.index)
        self.timings["grad_wait"] = time.perf_counter() - t0
        accumulated = any(b.window.landed > 1 for b in live)
        self.accumulates = self.accumulates or accumulated
        for b in live:
            if b.window.landed > 1 and not self.schedule.took_sum(b):
                b.state.grads.acc.add_(b.window.last)
        flag, *sums = torch.cat([self._found_inf, self._sumsq]).tolist()  # one read
        if accumulated:  # the device norm summed micro-steps' squares: recompute on the host
            inv, sums = self._inv_scale(), [0.0, 0.0]
            for b in live:
                sums[b.layout.sharded] += float(torch.linalg.vector_norm(
                    b.grad(), dtype=torch.float32) * inv) ** 2
        flag, sumsq = self.exchange.share_stats(flag, *sums)  # so far this rank's shards
        self._stats = (flag != 0.0, math.sqrt(sumsq) if math.isfinite(sumsq) else sumsq)
        self.phase = Phase.FINALIZED
        return self._stats

    def _inv_scale(self) -> float:
        # The scale the window's losses were multiplied by; step() may have updated the
        # scaler already, so it is remembered per window.
        return 1.0 / self._window_scale if self.loss_scaler.is_enabled() else 1.0

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
        """Clip the coming step's gradient to ``max_norm`` (torch's rule: scale by
        ``min(1, max_norm / (norm + 1e-6))``); return its unscaled global norm."""
        self._check_open()
        check_clip_args(max_norm, norm_type, error_if_nonfinite)
        self._clip = float(max_norm)
        with host_threads(self.cpu_threads):  # an accumulated window's norm is a host pass
            return torch.tensor(self._finalize()[1])

    @torch.no_grad()
    def step(self, closure=None):
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with host_threads(self.cpu_threads):  # the host norm, fills, the re-layout
            self._step()
        return loss

    def _step(self) -> None:
        check_unmoved(self.buckets, self.device, self.dtype)
        self.copier.streams.finish_uploads()  # what no forward waited for, before reads
        self._watch.adopt_edits(update_in_flight=self.update_in_flight)
        t_start = time.perf_counter()
        if self._t_step_end is not None:
            self.timings["fwd_bwd"] = t_start - self._t_step_end
        self.timings.update(self.copier.streams.device_times())
        overflow, norm = self._finalize()
        self.grad_norm = norm
        self._consolidated = None  # a consolidated state_dict is stale from here
        self.schedule.step(self, overflow=overflow, norm=norm)  # settle_step, the update
        self.timings.update(self.schedule.stats())
        self._clip_hint = self._clip if self._clip is not None else self.plugin.max_grad_norm
        self._reset_window()
        first, self._stepped = not self._stepped, True
        if first:  # `auto` decides from this step's peak (also when a checkpoint set the order)
            self.tiering.first_step_done(self)
        if not self.order.settled or first:  # on every rank alike
            # After the step has returned: its plan held views of every landing buffer, and
            # the old pool (2 B/param, pinned on CUDA) must be gone before the new one is made.
            self.set_bucket_order(self.order.fill if self.order.settled
                                  else self.order.arrived())
        if first:
            self.tiering.relaid([b.layout for b in self.buckets])
        self._t_step_end = time.perf_counter()

    def finish_publish(self) -> float:
        """The last uploads are queued and the next forward will wait for them (each
        module for its own, with ``model=``); returns the host seconds that took."""
        t0 = time.perf_counter()
        self.exchange.finish_publish()
        if self.module_waits is None:
            self.copier.streams.finish_uploads()
        return time.perf_counter() - t0

    def _drain(self) -> None:
        """Nothing of the schedule runs or is pending (a delayed update lands)."""
        self.schedule.settle(self)

    def _reset_window(self) -> None:
        for b in self.buckets:
            b.reset_window()
        self.exchange.reset()
        self._found_inf.zero_()
        self._sumsq.zero_()
        self.phase, self._stats, self._clip = Phase.IDLE, None, None
        self._window_scale = self.loss_scaler.loss_scale
        self._checked = []
        self.schedule.reset_window()

    def flush(self) -> None:
        """Finish a pending delayed update and copy its params to the device. The
        integrations call it before the model is saved or evaluated; a plain loop using
        ``delayed_update`` calls it before it evaluates or saves the model itself. Also makes
        the device wait for every upload: with ``model=``, code that reads params outside a
        module's forward (``model.state_dict()`` waits by itself) calls it after ``step()``."""
        self._drain()
        self.copier.streams.finish_uploads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient accumulated since the last step. ``set_to_none`` has no
        effect: streamed gradients never stay on the params. A pending delayed update keeps
        running (loops call this right after ``step()``)."""
        self._check_open()
        self.exchange.complete()
        self.schedule.discard(self)  # what was updated from the dropped window is undone
        for b in self.buckets:
            self.copier.of(b).wait_landed(b.layout.index)
            for s in b.layout.slots:
                s.param.grad = None
        self._reset_window()

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` with the fp16 loss scale applied (a no-op scale otherwise)."""
        self.loss_scaler.scale(loss).backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside reduce no gradients across ranks (micro-steps before the
        accumulation boundary); nothing changes with one process."""
        before, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = before

    # ------------------------------------------------------------ bucket order
    @property
    def bucket_order(self) -> list[int]:
        """Param indices (torch's state_dict keys) in the order the buckets fill: the
        reversed param order until the first step, then the order in which the first
        backward's gradients arrived (reorder.py)."""
        return list(self.order.fill)

    @property
    def relayout_seconds(self) -> float | None:
        """How long the last re-layout took (None: none yet)."""
        return self.order.relayout_seconds

    def set_bucket_order(self, order) -> None:
        """Fill the buckets in ``order`` (param indices; trainable params missing from it
        follow in their current order, others are ignored), moving the host state; the
        first backward's order is then no longer adopted. With N ranks a collective; the
        first rank's order wins. Between steps only (checkpoints call it when loading).
        Also moves state between host and device when the tier policy now wants other
        device buckets (`auto`, after the first step)."""
        order = self.order.resolve(order, self.exchange)
        if order is None:
            layouts = [b.layout for b in self.buckets]
            if self.tiering.tiers(layouts) == tuple(b.tier for b in self.buckets):
                return
            order = self.order.fill
        self._drain()
        for b in self.buckets:  # no copy may still use the old buffers
            self.copier.of(b).wait_landed(b.layout.index)
            self.copier.of(b).wait_uploaded(b.layout.index)
        # Drop every view of the old pool first: its pinned blocks go back to torch's
        # cache, where the new pool's blocks of the same sizes come from.
        pin, self.host_pool = self.host_pool.pin, None
        self.exchange.attach([], self._check, None)
        progress = Progress(logger, "moving the host state into gradient arrival order",
                            sum(sum(b.state.nbytes().values()) for b in self.buckets),
                            detail=f"{_buckets(len(self.buckets))}, once, after the first step")
        with host_threads(self.cpu_threads):
            pool, buckets = relayout(
                self.buckets, order, exchange=self.exchange, dtype=self.dtype,
                state_dtype=self.moments, master_dtype=self.masters, pin=pin,
                progress=progress,
                tiers_of=self.tiering.tiers, device=self.device,
                **self.order.layout_args)
        self.order.fill = order
        self._install(pool, buckets)
        self._reset_window()
        self.order.relayout_seconds = progress.done(f"{_buckets(len(buckets))} now")

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The whole state in torch.optim.AdamW's per-param format. With N ranks: a
        collective (rank 0 gets the state, the others a dict without it that refuses to
        load), unless `consolidate_state_dict` ran since the last step."""
        self._check_open()
        if self._consolidated is not None:
            sd, self._consolidated = self._consolidated, None
            return sd
        self._drain()
        with host_threads(self.cpu_threads):  # the moments decoded, copies: host passes
            return state_dict(self)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the state onto rank ``to``, a collective: every rank calls it (data or
        tensor parallel). Then ``state_dict()`` on rank ``to`` alone returns it, once, until
        the next step. In one process there is nothing to gather and this does nothing."""
        self._check_open()
        self._drain()
        with host_threads(self.cpu_threads):
            self._consolidated = state_dict(self, to=to) \
                if self.exchange.spans_ranks else None

    def master_state_dict(self, model: torch.nn.Module, *, to: int = 0) -> dict | None:
        """A full-precision ``model.state_dict()``: each param this optimizer trains
        replaced by its fp32 master weights (CPU tensors, bit for bit), frozen params as
        they are. With N ranks a collective (every rank calls it) that returns the dict on
        rank ``to`` and None elsewhere. Finishes a pending delayed update first."""
        self._check_open()
        self._drain()
        with host_threads(self.cpu_threads):
            return master_state_dict(self, model, to=to)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved with any number of ranks; each rank keeps its shard, on the
        host. No collective: every rank must pass the same whole state."""
        self._check_open()
        self._drain()
        self.copier.streams.finish_uploads()  # no upload may land over the loaded params
        self._consolidated = None
        with host_threads(self.cpu_threads):
            load_state_dict(self, state_dict)
        self._watch.note_written()

    def load_master_state_dict(self, model: torch.nn.Module, state_dict: dict) -> None:
        """The inverse of `master_state_dict`: the entries of ``state_dict`` for the params
        of ``model`` this optimizer trains become their fp32 master weights (a 16-bit param
        alone would round them) and the params their values in the compute dtype; moments
        and step counts stay. Params without an entry keep theirs; other entries are left
        to the caller. No collective: every rank passes the same whole tensors."""
        self._check_open()
        self._drain()
        self.copier.streams.finish_uploads()  # no upload may land over the loaded params
        self._consolidated = None
        with host_threads(self.cpu_threads):
            load_master_state_dict(self, model, state_dict)
        self._watch.note_written()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this ZeroOffloadOptimizer was closed (close()): it holds no "
                               "state any more; use the optimizer that replaced it")

    def close(self) -> None:
        """Remove this optimizer's hooks from the params and the model and drop its host
        state, once every copy in flight is done; the params keep their current values. For
        a caller that replaces the optimizer (the Trainer after an out-of-memory retry):
        the hooks would otherwise stay until the engine is garbage, and a second engine over
        the same params would get every gradient after the first had taken it."""
        if self.closed:
            return
        self.schedule.close()
        self.exchange.complete()
        for b in self.buckets:
            self.copier.of(b).wait_landed(b.layout.index)
            self.copier.of(b).wait_uploaded(b.layout.index)
        for h in self._hooks:
            h.remove()
        self.exchange.attach([], self._check, None)
        self.host_pool, self.buckets, self._where = None, [], {}
        self._watch = ParamWatch([])
        self.phase, self.closed = Phase.CLOSED, True

    # ------------------------------------------------------------- reporting
    def memory_report(self, *, accumulates: bool = False) -> dict:
        """Bytes this optimizer holds on this rank, by kind, in `memory.estimate()`'s
        structure (see `memory.engine_report`), and its ``buckets`` (how many keep their state
        on the host, how many on the device); ``accumulates``: also the buffers gradient
        accumulation over micro-steps will add, allocated or not."""
        p = self.plugin
        return engine_report(EngineFacts(
            tuple(self.buckets), self.host_pool, self.frozen, self.n_frozen, self.dtype,
            self.device, self.exchange.world, self.exchange.params_on_host, p.state_dtype,
            p.master_dtype, p.delayed_update, p.offload_fraction_value, p.overlap_step),
            accumulates=accumulates)

    @property
    def collective_bytes(self) -> dict[str, int]:
        """Bytes this rank has handed to each of the engine's own collectives since it was
        built, by collective (reduce_scatter, all_gather, all_reduce, gather); empty with one
        process. What scripts/bench/bench_offload.py counts per step."""
        return dict(self.exchange.sent)


def _buckets(n: int) -> str:
    return f"{n} bucket{'' if n == 1 else 's'}"
