"""`ZeroOffloadOptimizer`: the ZeRO-Offload data path.

Device: the model's trainable params become ``compute_dtype`` views of one flat buffer per
bucket. Host: fp32 master weights and Adam moments per bucket, updated by the one-pass
CPU-Adam, which also writes the new 16-bit params for the copy back.

Per backward, a post-accumulate-grad hook moves each gradient into its bucket's flat buffer
and frees ``param.grad``; a complete bucket is checked (inf/nan flag and squared norm, one
kernel) and copied to the host. Gradient accumulation needs no boundary signal: every backward
since the last ``step()`` / ``zero_grad()`` is summed, the second and later ones into an fp32
host buffer, with no round trip back to the device.
"""

from __future__ import annotations

import math
import threading
import time

import torch
from torch.autograd import Variable

from ..config import ZeroOffloadPlugin
from ..ops.cpu_adam import adam_update
from ..ops.scaling import unscale_check_
from ..optim.loss_scaler import DynamicLossScaler
from . import checkpoint
from .buckets import Slot, build_buckets
from .memory import make_report
from .stream import CudaTransport, HostTransport, host_empty

_DTYPE_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


def _check_hyper(where: str, lr, betas, eps, weight_decay) -> None:
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"{where}: lr must be a number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"{where}: eps must be a number >= 0, got {eps!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"{where}: weight_decay must be a number >= 0, got {weight_decay!r}")


class ZeroOffloadOptimizer(torch.optim.Optimizer):
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
    """

    fused_loss_scaling = True  # the scaler protocol: we unscale and check inside step()

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 plugin: ZeroOffloadPlugin | None = None):
        _check_hyper("ZeroOffloadOptimizer", lr, betas, eps, weight_decay)
        if plugin is None:
            plugin = ZeroOffloadPlugin.from_sources()
        if not isinstance(plugin, ZeroOffloadPlugin):
            raise TypeError(f"plugin must be a ZeroOffloadPlugin, got {type(plugin).__name__}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)  # rejects a param listed in two groups
        self.plugin = plugin
        slots = self._validate_groups()
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise ValueError(
                f"ZeroOffloadOptimizer got world size {torch.distributed.get_world_size()}: "
                "data-parallel ZeRO-Offload (state partitioned across ranks) is not "
                "supported yet; run a single process")

        self.device = slots[0].param.device
        self.dtype = plugin.torch_dtype
        on_cuda = self.device.type == "cuda"
        pin = on_cuda and plugin.pin_memory
        self.transport = CudaTransport(self.device, pin=pin) if on_cuda else HostTransport()
        self.buckets = build_buckets(slots, bucket_numel=max(1, int(plugin.bucket_size_mb * 2**19)))
        self._where = {}
        for b in self.buckets:
            self._place(b, pin=pin, staging=on_cuda or plugin.delayed_update)
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

    # ------------------------------------------------------------------ set-up
    def _validate_groups(self) -> list[Slot]:
        slots, devices, index = [], set(), 0
        for gi, g in enumerate(self.param_groups):
            if g.get("amsgrad"):
                raise ValueError(f"param group {gi}: amsgrad=True is not supported")
            _check_hyper(f"param group {gi}", g["lr"], g["betas"], g["eps"], g["weight_decay"])
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

    def _place(self, b, *, pin: bool, staging: bool) -> None:
        """Host state from the params' current values, then params -> flat compute dtype."""
        b.master = torch.empty(b.numel, dtype=torch.float32)
        b.exp_avg = torch.zeros(b.numel, dtype=torch.float32)
        b.exp_avg_sq = torch.zeros(b.numel, dtype=torch.float32)
        b.params = torch.empty(b.numel, dtype=self.dtype, device=self.device)
        for s in b.slots:
            src = s.param.detach().reshape(-1)
            b.master[s.offset:s.offset + s.numel].copy_(src)  # from the original precision
            b.params[s.offset:s.offset + s.numel].copy_(src)
            s.param.data = b.params[s.offset:s.offset + s.numel].view_as(s.param)
        b.grad_host = host_empty(b.numel, self.dtype, pin=pin)
        if staging and self.dtype != torch.float32:
            # Mirrors the device params at all times, so uploading a whole bucket never
            # changes params that got no gradient.
            b.param_host = host_empty(b.numel, self.dtype, pin=pin)
            b.param_host.copy_(b.params)

    # ----------------------------------------------------------- grad stream
    def _grad_hook(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        b, i = self._where[p]
        if not self._in_backward:
            self._in_backward = True
            # Buckets with a param that got no grad never complete: flush them at the end.
            Variable._execution_engine.queue_callback(self._end_backward)
        if b.pending is None:
            self._open(b)
        s = b.slots[i]
        b.pending[s.offset:s.offset + s.numel].copy_(p.grad.reshape(-1))
        p.grad = None  # the device keeps no full gradient copy
        b.present[i] = True
        b.arrived += 1
        if b.arrived == len(b.slots):
            self._flush(b)

    def _open(self, b) -> None:
        if self._final is not None:
            raise RuntimeError("backward after clip_grad_norm_() and before step(): "
                               "clip only once the gradients of this step are complete")
        if b.flushed:  # an earlier micro-step's grads sit in grad_host: fold them into fp32
            self.transport.wait_grads(b)
            if b.grad_acc is None:
                b.grad_acc = torch.empty(b.numel, dtype=torch.float32)
            if b.flushed == 1:
                b.grad_acc.copy_(b.grad_host)
            else:
                b.grad_acc.add_(b.grad_host)
        b.pending = self.transport.collect_buffer(b)

    def _flush(self, b) -> None:
        inv = self.loss_scaler.inv_scale_tensor(self.device) if self.loss_scaler.is_enabled() \
            else self._ones
        unscale_check_(b.pending, inv, self._found_inf, self._sumsq, backend=self.plugin.kernels)
        self.transport.send(b, b.pending)
        b.pending, b.arrived = None, 0
        b.flushed += 1

    def _end_backward(self) -> None:
        self._in_backward = False
        for b in self.buckets:
            if b.pending is not None:
                self._flush(b)

    # ------------------------------------------------------------------ step
    def _finalize(self) -> tuple[bool, float]:
        """Wait for this window's grads; return (overflow, unscaled global norm)."""
        if self._final is not None:
            return self._final
        self._end_backward()
        t0 = time.perf_counter()
        live = [b for b in self.buckets if b.flushed]
        for b in live:
            self.transport.wait_grads(b)
        self.timings["d2h"] = time.perf_counter() - t0
        accumulated = any(b.flushed > 1 for b in live)
        for b in live:
            if b.flushed > 1:
                b.grad_acc.add_(b.grad_host)
        flag, sumsq = torch.stack([self._found_inf[0], self._sumsq[0]]).tolist()  # one read
        if accumulated:  # the device norm summed micro-steps' squares: recompute on the host
            inv = self._inv_scale()
            sumsq = sum(float(torch.linalg.vector_norm(self._grad_of(b), dtype=torch.float32)
                              * inv) ** 2 for b in live)
        self._final = (flag != 0.0, math.sqrt(sumsq) if math.isfinite(sumsq) else sumsq)
        return self._final

    def _inv_scale(self) -> float:
        # The scale the window's losses were multiplied by; step() may have updated the
        # scaler already, so it is remembered per window.
        return 1.0 / self._window_scale if self.loss_scaler.is_enabled() else 1.0

    def _grad_of(self, b) -> torch.Tensor:
        return b.grad_acc if b.flushed > 1 else b.grad_host

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **_ignored) -> torch.Tensor:
        """Clip the coming step's gradient to ``max_norm``; return its unscaled global norm."""
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_: only norm_type=2 is supported, got {norm_type}")
        if _ignored.get("error_if_nonfinite"):
            raise ValueError("clip_grad_norm_: error_if_nonfinite=True is not supported")
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
        delayed = self.plugin.delayed_update and \
            self._applied_steps >= self.plugin.delayed_update_warmup_steps
        self._drain()  # a pending delayed update lands before anything else
        if self.loss_scaler.is_enabled():
            self.loss_scaler.update_scale(overflow)
        self.last_step_skipped = bool(overflow and self.loss_scaler.is_enabled())
        if self.last_step_skipped:
            self.skipped_steps += 1
        else:
            max_norm = self._clip if self._clip is not None else self.plugin.max_grad_norm
            coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
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
        """(bucket, grad, [(lo, hi, step, group)]) per live bucket, hyperparams read now."""
        work = []
        for b in self.buckets:
            if not b.flushed:
                continue
            runs = []
            for run in b.runs(lambda s: (s.group, self._steps[s.index])):
                for s in run:
                    self._steps[s.index] += 1
                lo, hi = run[0].offset, run[-1].offset + run[-1].numel
                g = {k: v for k, v in self.param_groups[run[0].group].items() if k != "params"}
                runs.append((lo, hi, self._steps[run[0].index], g, grad_scale))
            work.append((b, self._grad_of(b), runs))
        return work

    def _run(self, work, *, upload: bool) -> None:
        t_adam = 0.0
        threads = self.plugin.cpu_threads or None
        for b, grad, runs in work:
            self.transport.wait_staging(b)
            out = self.transport.staging(b)
            t0 = time.perf_counter()
            for lo, hi, step, g, grad_scale in runs:
                adam_update(
                    b.master[lo:hi], grad[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi],
                    step=step, lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1],
                    eps=g["eps"], weight_decay=g["weight_decay"], grad_scale=grad_scale,
                    out16=None if out is None else out[lo:hi], num_threads=threads)
            t_adam += time.perf_counter() - t0
            if upload:  # async on CUDA: overlaps the next bucket's update
                self.transport.upload(b)
        self.timings["cpu_adam"] = t_adam

    def _start_thread(self, work) -> None:
        # The background update reads this step's grads while the next backward streams
        # new ones: give the hooks the other grad buffers (allocated on first use).
        for b, _, _ in work:
            if b.grad_host_alt is None:
                b.grad_host_alt = host_empty(b.numel, self.dtype, pin=self.transport.pinned)
            b.grad_host, b.grad_host_alt = b.grad_host_alt, b.grad_host
            b.grad_acc, b.grad_acc_alt = b.grad_acc_alt, b.grad_acc

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
            for b in self.buckets:
                self.transport.upload(b)
            self.timings["h2d"] = self.transport.finish_uploads()

    def _reset_window(self) -> None:
        for b in self.buckets:
            b.flushed, b.arrived, b.pending = 0, 0, None
            b.present = [False] * len(b.slots)
        self._found_inf.zero_()
        self._sumsq.zero_()
        self._final, self._clip = None, None
        self._window_scale = self.loss_scaler.loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient accumulated since the last step."""
        self._drain()
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
        """Bytes this optimizer holds, by kind, in `memory.estimate()`'s structure."""
        def nbytes(name):
            return sum(t.numel() * t.element_size() for b in self.buckets
                       for t in [getattr(b, name, None)] if t is not None)
        largest = max(b.numel for b in self.buckets) * _DTYPE_BYTES[self.dtype]
        on_cuda = isinstance(self.transport, CudaTransport)
        device = {"params": nbytes("params") + self._n_frozen * _DTYPE_BYTES[self.dtype],
                  "grad_buckets": min(2 * largest, nbytes("params")) if on_cuda else 0}
        host = {"master": nbytes("master"), "exp_avg": nbytes("exp_avg"),
                "exp_avg_sq": nbytes("exp_avg_sq"),
                "grad_staging": nbytes("grad_host") + nbytes("grad_host_alt"),
                "param_staging": nbytes("param_host"),
                "grad_accumulation": nbytes("grad_acc") + nbytes("grad_acc_alt")}
        n = sum(b.numel for b in self.buckets)
        return make_report(device, host, n_params=n, n_frozen=self._n_frozen,
                           param_bytes=_DTYPE_BYTES[self.dtype])

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        self._drain()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        self._drain()
        checkpoint.load_state_dict(self, state_dict)
