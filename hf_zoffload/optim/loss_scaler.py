"""DynamicLossScaler: fp16 loss scaling with hysteresis, usable as accelerate's scaler."""

from __future__ import annotations

import logging
import math
import struct
import warnings

import torch

from hf_zoffload.ops.scaling import scale_loss, unscale_check_

logger = logging.getLogger(__name__)

__all__ = ["DynamicLossScaler"]

_FP32_MAX = 3.4028234663852886e38
_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def _fp32(x: float) -> float:
    # The scale is kept fp32-representable so the host float and the device copy agree
    # bit for bit, and products round as GradScaler's fp32 scale tensor rounds them.
    return struct.unpack("f", struct.pack("f", x))[0] if abs(x) <= _FP32_MAX else math.inf


def _device_key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class DynamicLossScaler:
    """Dynamic loss scale for fp16 training.

    The scale is a host float (no device read is ever needed to know it); `scale_tensor`
    and `inv_scale_tensor` hand out cached 1-element fp32 device copies that `update_scale`
    refreshes with asynchronous `fill_`s on the current stream.

    Semantics, applied once per optimizer step by `update_scale(overflow)`:

    - Each overflowing step (an inf or nan in the gradients) is skipped, and counted in
      `skipped_steps`; it also restarts the count of clean steps toward growth.
    - Hysteresis (DeepSpeed's delayed shift): a counter starts at `hysteresis` and loses one
      per overflow; when it reaches 0 the scale is multiplied by `backoff_factor` and the
      counter refills to `hysteresis`. Clean steps do NOT refill it (DeepSpeed's default,
      consecutive_hysteresis=False): overflows count toward backoff whether or not clean
      steps lie between them, so sporadic overflows still lower an over-large scale instead
      of skipping steps forever. The counter also refills when the scale grows, as a full
      clean growth window shows the scale is healthy.
    - After `growth_interval` consecutive clean steps the scale is multiplied by
      `growth_factor` (skipped if the result would exceed the fp32 range, as GradScaler).
    - The scale never goes below `min_scale`; the first backoff that lands on the floor
      warns once (RuntimeWarning): overflows there usually mean nan from the model or data.
    - With `hysteresis=1` (and a `min_scale` never reached) the trajectory equals
      torch.amp.GradScaler's on the same overflow sequence, fp32 rounding included.
    - Skipped steps are logged at INFO on the first skip and then once every `log_every`
      skips, with counts; never one line per skip.

    Protocol (`scale`, `unscale_`, `step`, `update`, `get_scale`, `is_enabled`,
    `state_dict`, `load_state_dict`): it can stand where accelerate keeps its GradScaler.
    An optimizer with `fused_loss_scaling = True` (the ZeRO-offload engine) checks and
    unscales inside its own step and calls `update_scale` itself: for it `unscale_` is a
    no-op, `step` just steps and `update` adds nothing. Other optimizers get GradScaler's
    behaviour: their fp32 `.grad`s are unscaled in place by `unscale_check_`, `step` skips
    `optimizer.step()` on overflow (one host read per step), and `update` applies
    `update_scale` once for all of them.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 hysteresis: int = 2, min_scale: float = 1.0, enabled: bool = True, *,
                 log_every: int = 50):
        self._set_config(init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         hysteresis=hysteresis, min_scale=min_scale)
        if init_scale < min_scale:
            raise ValueError(f"init_scale must be >= min_scale={min_scale!r}, "
                             f"got {init_scale!r}")
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be an integer >= 1, got {log_every!r}")
        self.log_every = log_every
        self._enabled = bool(enabled)
        self._scale = _fp32(float(init_scale))
        self._growth_tracker = 0
        self._hysteresis_left = self.hysteresis
        self.skipped_steps = 0  # overflowing steps, all skipped
        self.steps = 0  # update_scale calls
        self._floor_warned = False
        self._tensors: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._per_optimizer: dict[int, dict] = {}
        self._device = "cuda"  # read by accelerate (FSDP2 load path)

    # ----------------------------------------------------------------- validation
    def _set_config(self, **kw) -> None:
        def number(name, ok, rule):
            value = kw[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or not ok(value):
                raise ValueError(f"{name} must be {rule}, got {value!r}")
            return value

        def integer(name, low):
            value = kw[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
            return value

        number("init_scale", lambda v: 0 < v <= _FP32_MAX, "in (0, fp32 max]")
        checked = {
            "growth_factor": float(number("growth_factor", lambda v: v > 1, "> 1")),
            "backoff_factor": float(number("backoff_factor", lambda v: 0 < v < 1, "in (0, 1)")),
            "growth_interval": integer("growth_interval", 1),
            "hysteresis": integer("hysteresis", 1),
            "min_scale": _fp32(float(number("min_scale", lambda v: _fp32(v) > 0,
                                            "> 0 in fp32"))),
        }
        # Assigned only once all are valid: a bad checkpoint leaves the scaler untouched.
        for key, value in checked.items():
            setattr(self, key, value)

    # ------------------------------------------------------------- state machine
    @property
    def loss_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def update_scale(self, overflow: bool) -> None:
        """Advance one optimizer step; `overflow` is the step's host-side flag."""
        if not self._enabled:
            return
        self.steps += 1
        old = self._scale
        if overflow:
            self.skipped_steps += 1
            self._growth_tracker = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self._hysteresis_left = self.hysteresis
                # min(...): a scale loaded below the floor must not rise on backoff.
                floor = min(self.min_scale, old)
                self._scale = max(_fp32(old * self.backoff_factor), floor)
                if self._scale <= floor and not self._floor_warned:
                    self._floor_warned = True
                    warnings.warn(
                        f"fp16 loss scale is at its floor min_scale={self.min_scale:g}; "
                        "overflows from here on cannot lower it and keep skipping steps "
                        "(often nan from the model or the data)",
                        RuntimeWarning, stacklevel=2)
            self._log_skip(old)
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._growth_tracker = 0
                grown = _fp32(self._scale * self.growth_factor)
                if math.isfinite(grown):
                    self._scale = grown
                    self._hysteresis_left = self.hysteresis
        if self._scale != old:
            self._refresh_tensors()

    def _log_skip(self, old: float) -> None:
        if self.skipped_steps == 1 or self.skipped_steps % self.log_every == 0:
            logger.info("fp16 overflow: %d of %d steps skipped so far; loss scale %g -> %g "
                        "(%d more overflow(s) before the next backoff)",
                        self.skipped_steps, self.steps, old, self._scale,
                        self._hysteresis_left)

    # ------------------------------------------------------------ device copies
    def _cached(self, kind: str, device) -> torch.Tensor:
        key = (kind, _device_key(device))
        t = self._tensors.get(key)
        if t is None:
            t = torch.full((1,), self._value(kind), dtype=torch.float32, device=key[1])
            self._tensors[key] = t
        return t

    def _value(self, kind: str) -> float:
        # Reciprocal in double, then rounded to fp32: GradScaler's inv_scale.
        return self.loss_scale if kind == "scale" else _fp32(1.0 / self.loss_scale)

    def _refresh_tensors(self) -> None:
        for (kind, _), t in self._tensors.items():
            t.fill_(self._value(kind))  # a kernel with a host scalar: async, no sync

    def scale_tensor(self, device) -> torch.Tensor:
        """Cached 1-element fp32 tensor on `device` holding the current scale."""
        return self._cached("scale", device)

    def inv_scale_tensor(self, device) -> torch.Tensor:
        """Cached 1-element fp32 tensor on `device` holding 1 / scale."""
        return self._cached("inv", device)

    # ------------------------------------------------------ GradScaler protocol
    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self.loss_scale

    def get_growth_factor(self) -> float:
        return self.growth_factor

    def get_backoff_factor(self) -> float:
        return self.backoff_factor

    def get_growth_interval(self) -> int:
        return self.growth_interval

    def _lazy_init_scale_growth_tracker(self, device) -> None:
        """GradScaler internal that accelerate calls after loading; nothing to do here."""

    def scale(self, outputs):
        """Multiply a tensor (or nested list/tuple of tensors) by the scale, no host sync."""
        if not self._enabled:
            return outputs

        if isinstance(outputs, torch.Tensor):
            return scale_loss(outputs, self.scale_tensor(outputs.device))
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ValueError(f"outputs must be a Tensor or a list/tuple of Tensors, "
                         f"got {type(outputs).__name__}")

    @staticmethod
    def _is_fused(optimizer) -> bool:
        return getattr(optimizer, "fused_loss_scaling", False) is True

    def _state(self, optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": _READY,
                                                              "found_inf": []})

    def unscale_(self, optimizer) -> None:
        """Unscale the optimizer's fp32 grads in place and record inf/nan on the device."""
        if not self._enabled or self._is_fused(optimizer):
            return
        state = self._state(optimizer)
        if state["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer "
                               "since the last update().")
        if state["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")

        found, sums = {}, {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse or grad.dtype != torch.float32:
                    raise ValueError(f"unscale_ needs dense float32 grads, got "
                                     f"{'sparse ' if grad.is_sparse else ''}{grad.dtype}: "
                                     "keep fp32 params or use the ZeRO-offload optimizer")
                dev = _device_key(grad.device)
                if dev not in found:
                    found[dev] = torch.zeros(1, dtype=torch.float32, device=dev)
                    sums[dev] = torch.zeros(1, dtype=torch.float32, device=dev)
                flat = grad.view(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
                unscale_check_(flat, self.inv_scale_tensor(dev), found[dev], sums[dev],
                               out=flat)
                if flat.data_ptr() != grad.data_ptr():
                    grad.copy_(flat.view_as(grad))
        state["found_inf"] = list(found.values())
        state["stage"] = _UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """`optimizer.step(...)` unless the unscaled grads hold inf/nan (returns None)."""
        if not self._enabled or self._is_fused(optimizer):
            return optimizer.step(*args, **kwargs)
        state = self._state(optimizer)
        if state["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] == _READY:
            self.unscale_(optimizer)
        state["stage"] = _STEPPED
        # The one host read per step, as in GradScaler.
        if any(float(f.sum()) for f in state["found_inf"]):
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale=None) -> None:
        """Apply `update_scale` for the plain optimizers stepped since the last update;
        with `new_scale` (float or 1-element tensor) set the scale directly instead."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale)  # a tensor here is a user-requested read
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"new_scale must be a finite number > 0, got {value!r}")
            self._scale = _fp32(value)
            self._refresh_tensors()
        else:
            flags = [f for s in self._per_optimizer.values() for f in s["found_inf"]]
            if self._per_optimizer:
                self.update_scale(any(float(f.sum()) for f in flags))
        self._per_optimizer.clear()

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """GradScaler's keys plus ours; {} when disabled, as GradScaler."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval,
                "_growth_tracker": self._growth_tracker, "hysteresis": self.hysteresis,
                "_hysteresis_left": self._hysteresis_left, "min_scale": self.min_scale,
                "skipped_steps": self.skipped_steps, "steps": self.steps,
                "_floor_warned": self._floor_warned}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ours or a torch GradScaler's state. Missing config keys keep this
        instance's values; missing counters restart (hysteresis counter full, 0 skips)."""
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was "
                               "saved from a disabled instance of the scaler.")
        sd = dict(state_dict)
        for key in ("scale", "_growth_tracker"):
            if isinstance(sd.get(key), torch.Tensor):
                sd[key] = sd[key].item()
        config = {"init_scale": sd.get("scale", self._scale)}
        for key in ("growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                    "min_scale"):
            config[key] = sd.get(key, getattr(self, key))
        self._set_config(**config)
        self._scale = _fp32(float(config["init_scale"]))
        self._growth_tracker = int(sd.get("_growth_tracker", 0))
        self._hysteresis_left = int(sd.get("_hysteresis_left", self.hysteresis))
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.steps = int(sd.get("steps", 0))
        self._floor_warned = bool(sd.get("_floor_warned", False))
        self._per_optimizer.clear()
        self._refresh_tensors()

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.loss_scale:g}, enabled={self._enabled}, "
                f"hysteresis_left={self._hysteresis_left}/{self.hysteresis}, "
                f"skipped_steps={self.skipped_steps})")
