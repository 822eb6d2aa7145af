"""`ZeroOffloadOptimizer`: the ZeRO-Offload data path.

Device: the trainable params, cast to ``compute_dtype``, each in its own storage: not views of
one flat buffer, since safetensors refuses shared storage and accelerate's ``save_state`` keeps
one name per storage (tied weights), which dropped all but one param per bucket. Host: fp32
master weights and Adam moments per bucket, updated by the one-pass CPU-Adam, which also
writes the new 16-bit params: to a flat host staging buffer copied back one copy per param
(CUDA, delayed update), or on the CPU straight into each param's storage (no copy).

Per backward, a post-accumulate-grad hook moves each gradient into its bucket's flat buffer
and frees ``param.grad``; a complete bucket is checked (inf/nan flag and squared norm, one
kernel) and copied to the host. Gradient accumulation needs no boundary signal: every backward
since the last ``step()`` / ``zero_grad()`` is summed, the second and later ones into an fp32
host buffer, with no round trip back to the device.

Several processes (torch.distributed with N > 1 ranks): each rank holds the host state of
1/N of every bucket; gradients are reduce-scattered, params all-gathered (partition.py).
"""

from __future__ import annotations

import math
import threading
import time

import torch
from torch.autograd import Variable

from ..config import ZeroOffloadPlugin
from ..ops.cpu_adam import adam_update_unchecked
from ..ops.scaling import unscale_check_
from ..optim.loss_scaler import DynamicLossScaler
from . import checkpoint, partition
from .buckets import build_buckets, check_hyper, collect_slots
from .memory import engine_report
from .stream import CudaTransport, HostTransport, host_empty


class ZeroOffloadOptimizer(partition.PartitionedGrads, torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments in host memory (ZeRO-Offload).

    Build it after the model is on its device. It casts the trainable params passed to it to
    ``plugin.compute_dtype`` in place; frozen params are left alone. Use it as any torch
    optimizer (schedulers change ``param_groups[i]["lr"]``); for fp16, scale the loss with
    ``optimizer.backward(loss)`` or through ``accelerator.backward`` once the engine's
    ``loss_scaler`` is installed as accelerate's scaler.

    Accumulation boundary: ``step()`` applies the sum of every backward since the previous
    ``step()`` / ``zero_grad()``; callers step only at the boundary (accelerate's
    ``sync_gradients`` does this for ``AcceleratedOptimizer``). ``model.zero_grad()`` does not
    discard streamed gradients; ``optimizer.zero_grad()`` does.

    Delayed update (``plugin.delayed_update``): after ``delayed_update_warmup_steps`` applied
    steps, ``step()`` starts the CPU update of step i in a background thread and returns; the
    new params are copied to the device at the next ``step()``. So the forward/backward of
    step i+1 runs on the params of step i-1: each gradient is applied one step late.
    ``state_dict()``, ``load_state_dict()`` and ``zero_grad()`` first finish a pending update.

    Data parallel (torch.distributed initialized with N > 1 ranks, or ``process_group=``):
    every rank builds the engine over the same params, unwrapped (no DDP), ends each step
    with identical params and holds 1/N of the optimizer state. The accumulation boundary
    (``sync_gradients``, ``no_sync()``), checkpoints and failures: `partition.PartitionedGrads`.
    """

    fused_loss_scaling = True  # the scaler protocol: we unscale and check inside step()

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 plugin: ZeroOffloadPlugin | None = None, process_group=None):
        check_hyper("ZeroOffloadOptimizer", lr, betas, eps, weight_decay)
        if plugin is None:
            plugin = ZeroOffloadPlugin.from_sources()
        if not isinstance(plugin, ZeroOffloadPlugin):
            raise TypeError(f"plugin must be a ZeroOffloadPlugin, got {type(plugin).__name__}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)  # rejects a param listed in two groups
        self.plugin = plugin
        self._threads = plugin.cpu_threads or torch.get_num_threads()
        slots = collect_slots(self.param_groups)
        self.device = slots[0].param.device
        self.dtype = plugin.torch_dtype
        on_cuda = self.device.type == "cuda"
        pin = on_cuda and plugin.pin_memory
        self.transport = CudaTransport(self.device, pin=pin) if on_cuda else HostTransport()
        self._init_dp(process_group)
        self.buckets = build_buckets(slots, bucket_numel=max(1, int(plugin.bucket_size_mb * 2**19)))
        self._where = {}
        for b in self.buckets:
            if self.dp is not None:
                self.dp.assign(b)
            b.place(self.dtype, self.device, pin=pin, staging=on_cuda or plugin.delayed_update,
                    flat=self.dp.broadcast_bucket(b) if self.dp is not None else None)
            for i, s in enumerate(b.slots):
                self._where[s.param] = (b, i)
        self._steps = {s.index: 0 for s in slots}  # per-param Adam step, as torch keeps it
        self._n_frozen = sum(p.numel() for g in self.param_groups for p in g["params"]
                             if not p.requires_grad)

        self.loss_scaler = DynamicLossScaler(
            init_scale=plugin.init_scale, growth_factor=plugin.growth_factor,
            backoff_factor=plugin.backoff_factor, growth_interval=plugin.growth_interval,
            hysteresis=plugin.hysteresis, min_scale=plugin.min_scale,
            enabled=plugin.compute_dtype == "fp16")
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._sumsq = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._ones = torch.ones(1, dtype=torch.float32, device=self.device)
        self._in_backward = False
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._uploads_pending = False
        self._applied_steps = 0
        self.grad_norm: float | None = None
        self.last_step_skipped = False
        self.skipped_steps = 0
        self.timings = {"fwd_bwd": 0.0, "d2h": 0.0, "cpu_adam": 0.0, "h2d": 0.0}
        self._t_step_end: float | None = None
        self._reset_window()
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._grad_hook)
                       for s in slots]

    # ----------------------------------------------------------- grad stream
    def _grad_hook(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        b, i = self._where[p]
        if not self._in_backward:
            self._in_backward = True
            if self.dp is not None:
                self._begin_backward_dp()
            # Buckets with a param that got no grad never complete: flush them at the end.
            Variable._execution_engine.queue_callback(self._end_backward)
        if b.pending is None:
            self._open(b)
        s = b.slots[i]
        dst = b.pending[s.offset:s.offset + s.numel]
        (dst.add_ if b.prefilled else dst.copy_)(p.grad.reshape(-1))
        p.grad = None  # the device keeps no full gradient copy
        b.present[i] = True
        b.arrived += 1
        if b.arrived == len(b.slots):
            self._flush(b)

    def _open(self, b) -> None:
        if self._final is not None:
            raise RuntimeError("backward after clip_grad_norm_() and before step(): "
                               "clip only once the gradients of this step are complete")
        if self.dp is not None:
            return self._open_dp(b)
        self._fold(b)  # on the CPU the collect buffer is grad_host itself
        b.pending = self.transport.collect_buffer(b)
        b.last = b.grad_host

    def _fold(self, b) -> None:
        """Before new grads land: move the last landed ones into the fp32 sum."""
        if not b.flushed:
            return
        if self.dp is not None:
            self.dp.complete(b)
        self.transport.wait_grads(b)
        if b.grad_acc is None:
            b.grad_acc = torch.empty(b.shard, dtype=torch.float32)
        if b.flushed == 1:
            b.grad_acc.copy_(b.last)
        else:
            b.grad_acc.add_(b.last)

    def _check(self, buf) -> None:
        inv = self.loss_scaler.inv_scale_tensor(self.device) if self.loss_scaler.is_enabled() \
            else self._ones
        unscale_check_(buf, inv, self._found_inf, self._sumsq, backend=self.plugin.kernels)

    def _flush(self, b) -> None:
        if self.dp is not None:
            self._flush_dp(b)
        else:
            self._check(b.pending)
            self.transport.send(b, b.pending)
            b.flushed += 1
        b.pending, b.arrived, b.prefilled = None, 0, False

    def _end_backward(self) -> None:
        ended, self._in_backward = self._in_backward, False
        for b in self.buckets:
            if b.pending is not None:
                self._flush(b)
        if self.dp is not None and ended and self._sync:
            self._reduce_rest()

    # ------------------------------------------------------------------ step
    def _finalize(self) -> tuple[bool, float]:
        """Wait for this window's grads; return (overflow, unscaled global norm)."""
        if self._final is not None:
            return self._final
        self._end_backward()
        t0 = time.perf_counter()
        if self.dp is not None:
            self._end_window_dp()
        live = [b for b in self.buckets if b.flushed]
        for b in live:
            self.transport.wait_grads(b)
        self.timings["d2h"] = time.perf_counter() - t0
        accumulated = any(b.flushed > 1 for b in live)
        for b in live:
            if b.flushed > 1:
                b.grad_acc.add_(b.last)
        flag, sumsq = torch.stack([self._found_inf[0], self._sumsq[0]]).tolist()  # one read
        if accumulated:  # the device norm summed micro-steps' squares: recompute on the host
            inv = self._inv_scale()
            sumsq = sum(float(torch.linalg.vector_norm(self._grad_of(b), dtype=torch.float32)
                              * inv) ** 2 for b in live)
        if self.dp is not None:  # so far this rank's shards only
            flag, sumsq = self._share_stats(flag, sumsq)
        self._final = (flag != 0.0, math.sqrt(sumsq) if math.isfinite(sumsq) else sumsq)
        return self._final

    def _inv_scale(self) -> float:
        # The scale the window's losses were multiplied by; step() may have updated the
        # scaler already, so it is remembered per window.
        return 1.0 / self._window_scale if self.loss_scaler.is_enabled() else 1.0

    def _grad_of(self, b) -> torch.Tensor:
        return b.grad_acc if b.flushed > 1 else b.last

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
        """Clip the coming step's gradient to ``max_norm`` (torch's rule: scale by
        ``min(1, max_norm / (norm + 1e-6))``); return its unscaled global norm."""
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_: only norm_type=2 is supported, got {norm_type}")
        if error_if_nonfinite:
            raise ValueError("clip_grad_norm_: error_if_nonfinite=True is not supported (fp16 "
                             "overflow skips the step instead)")
        if not float(max_norm) >= 0.0:
            raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
        self._clip = float(max_norm)
        return torch.tensor(self._finalize()[1])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t_start = time.perf_counter()
        if self._t_step_end is not None:
            self.timings["fwd_bwd"] = t_start - self._t_step_end
        overflow, norm = self._finalize()
        self.grad_norm = norm
        self._consolidated = None  # a consolidated state_dict is stale from here
        delayed = self.plugin.delayed_update and \
            self._applied_steps >= self.plugin.delayed_update_warmup_steps
        self._drain()  # a pending delayed update lands before anything else
        if self.loss_scaler.is_enabled():
            self.loss_scaler.update_scale(overflow)
        self.last_step_skipped = bool(overflow and self.loss_scaler.is_enabled())
        if self.last_step_skipped:
            self.skipped_steps += 1
        else:
            # An explicit clip_grad_norm_ follows torch (0 zeroes the update); the plugin's
            # max_grad_norm uses 0 for "off".
            max_norm = self._clip if self._clip is not None else self.plugin.max_grad_norm
            coef = min(1.0, max_norm / (norm + 1e-6)) \
                if self._clip is not None or max_norm > 0 else 1.0
            work = self._plan(self._inv_scale() * coef)
            self._applied_steps += 1
            if delayed:
                self._start_thread(work)
            else:
                self._run(work, upload=True)
                self.timings["h2d"] = self.transport.finish_uploads()
        self._reset_window()
        self._t_step_end = time.perf_counter()
        return loss

    def _plan(self, grad_scale: float) -> list:
        """(bucket, grad, [(lo, hi, step, group)]) per bucket with a grad, hyperparams read
        now; lo, hi index this rank's host buffers (runs outside its shard are dropped, but
        every rank counts every param's steps)."""
        work = []
        for b in self.buckets:
            if not any(b.present):
                continue
            runs = []
            for run in b.runs(lambda s: (s.group, self._steps[s.index])):
                for s in run:
                    self._steps[s.index] += 1
                lo = max(run[0].offset, b.lo)
                hi = min(run[-1].offset + run[-1].numel, b.hi)
                if lo >= hi:
                    continue
                g = {k: v for k, v in self.param_groups[run[0].group].items() if k != "params"}
                runs.append((lo - b.start, hi - b.start, self._steps[run[0].index], g,
                             grad_scale))
            work.append((b, self._grad_of(b), runs))
        return work

    def _run(self, work, *, upload: bool) -> None:
        t_adam, gathers = 0.0, []
        # Resolved on the caller's thread: torch.get_num_threads() reads a per-thread
        # OpenMP setting, and the delayed update runs this in a thread of its own.
        threads = self._threads
        for b, grad, runs in work:
            self.transport.wait_staging(b)
            out = self.transport.staging(b)
            t0 = time.perf_counter()
            for lo, hi, step, g, grad_scale in runs:
                # In place, the new 16-bit values go straight into each param's own storage:
                # one call per param (the kernel is bitwise the same for any split).
                parts = b.param_pieces(lo, hi) if self.transport.in_place(b) else \
                    [(lo, hi, None if out is None else out[lo:hi])]
                for a, z, out16 in parts:
                    # Unchecked: every buffer here was built and sized by this engine; the
                    # checks cost ~100 us a call, 10% of a GPT-2-124M step on 2 cores.
                    adam_update_unchecked(
                        b.master[a:z], grad[a:z], b.exp_avg[a:z], b.exp_avg_sq[a:z],
                        step=step, lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1],
                        eps=g["eps"], weight_decay=g["weight_decay"], grad_scale=grad_scale,
                        out16=out16, num_threads=threads)
            t_adam += time.perf_counter() - t0
            if upload:  # async on CUDA: overlaps the next bucket's update
                self._publish(b, gathers)
        if self.dp is not None:
            self.dp.wait_all(gathers)
        self.timings["cpu_adam"] = t_adam

    def _publish(self, b, gathers: list) -> None:
        """Copy the bucket's new values to its params; with N ranks, upload this rank's new
        shard and all-gather the bucket (async, overlapping the next bucket's update)."""
        if self.dp is None:
            self.transport.upload(b)
        else:
            self.dp.all_gather(b, gathers)

    def _start_thread(self, work) -> None:
        # The background update reads this step's grads while the next backward streams
        # new ones: give the hooks the other grad buffers (allocated on first use).
        for b, _, _ in work:
            if b.grad_host_alt is None:
                b.grad_host_alt = host_empty(b.shard, self.dtype, pin=self.transport.pinned)
            b.grad_host, b.grad_host_alt = b.grad_host_alt, b.grad_host
            b.grad_acc, b.grad_acc_alt = b.grad_acc_alt, b.grad_acc
            b.grad_host32, b.grad_host32_alt = b.grad_host32_alt, b.grad_host32

        def run():
            try:
                self._run(work, upload=False)
            except BaseException as exc:  # re-raised on the caller's thread in _drain
                self._thread_error = exc

        self._thread = threading.Thread(target=run, name="zoffload-cpu-adam", daemon=True)
        self._thread.start()
        self._uploads_pending = True

    def _drain(self) -> None:
        """Finish a pending delayed update and copy its params to the device."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            self._thread = None
            self.timings["cpu_adam_wait"] = time.perf_counter() - t0
            if self._thread_error is not None:
                err, self._thread_error = self._thread_error, None
                raise RuntimeError("the delayed CPU-Adam update failed") from err
        if self._uploads_pending:
            self._uploads_pending = False
            gathers = []
            for b in self.buckets:
                self._publish(b, gathers)
            if self.dp is not None:
                self.dp.wait_all(gathers)
            self.timings["h2d"] = self.transport.finish_uploads()

    def _reset_window(self) -> None:
        for b in self.buckets:
            b.flushed, b.arrived, b.pending, b.last = 0, 0, None, None
            b.local, b.prefilled = 0, False
            b.present = [False] * len(b.slots)
        self._unsynced = False
        self._found_inf.zero_()
        self._sumsq.zero_()
        self._final, self._clip = None, None
        self._window_scale = self.loss_scaler.loss_scale

    def flush(self) -> None:
        """Finish a pending delayed update and copy its params to the device. The
        integrations call it before the model is saved or evaluated; a plain loop using
        ``delayed_update`` calls it before it evaluates or saves the model itself."""
        self._drain()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient accumulated since the last step. ``set_to_none`` has no
        effect: streamed gradients never stay on the params. A pending delayed update keeps
        running (loops call this right after ``step()``)."""
        if self.dp is not None:
            self.dp.complete()
        for b in self.buckets:
            self.transport.wait_grads(b)
            for s in b.slots:
                s.param.grad = None
        self._reset_window()

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` with the fp16 loss scale applied (a no-op scale otherwise)."""
        self.loss_scaler.scale(loss).backward(**kwargs)

    # ------------------------------------------------------------- reporting
    def memory_report(self) -> dict:
        """Bytes this optimizer holds on this rank, by kind, in `memory.estimate()`'s
        structure (see `memory.engine_report`)."""
        return engine_report(self)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The whole state in torch.optim.AdamW's per-param format. With N ranks: a
        collective (rank 0 gets the state, the others a shell that refuses to load), unless
        `consolidate_state_dict` ran since the last step."""
        if self._consolidated is not None:
            sd, self._consolidated = self._consolidated, None
            return sd
        self._drain()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved with any number of ranks; each rank keeps its shard, on the
        host. No collective: every rank must pass the same whole state."""
        self._drain()
        self._consolidated = None
        checkpoint.load_state_dict(self, state_dict)
