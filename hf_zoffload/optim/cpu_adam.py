"""CPUAdam: torch.optim.AdamW's drop-in over CPU fp32 parameters, on the compiled one-pass kernel.

State uses torch's own keys (``step`` as a float32 scalar tensor, ``exp_avg``, ``exp_avg_sq``) and
param groups carry torch's ``decoupled_weight_decay`` flag for the mode, so a state_dict moves
between CPUAdam, torch.optim.AdamW and torch.optim.Adam in either direction with its meaning.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from hf_zoffload.ops.adam_kernels import (
    adam_update_many_unchecked,
    bump_steps,
    check_disjoint,
    check_hyper,
    many_buffers,
)

__all__ = ["CPUAdam"]

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Keys torch.optim.Adam(W) groups carry that only pick torch's implementation; a loaded torch
# state_dict brings them along and they do not change the result here.
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable")


def _where(group: dict, gi: int, pi: int) -> str:
    names = group.get("param_names")
    return f"parameter {names[pi]!r}" if names else f"parameter {pi} of param group {gi}"


def _hyper(group: dict, gi: int) -> dict:
    """The group's hyperparameters as plain floats/bools, or ValueError/TypeError naming them."""
    where = f"param group {gi}"
    for key in ("amsgrad", "maximize", "differentiable"):
        if group.get(key, False):
            raise ValueError(f"{key}=True in {where} is not supported by CPUAdam")
    for key in ("decoupled_weight_decay", "bias_correction"):
        if not isinstance(group[key], bool):
            raise TypeError(f"{key} of {where} must be a bool, got {group[key]!r}")
    lr, beta1, beta2, eps, weight_decay = check_hyper(
        group["lr"], group["betas"], group["eps"], group["weight_decay"], where=where)
    return {
        "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
        "adamw_mode": group["decoupled_weight_decay"],
        "bias_correction": group["bias_correction"],
    }


def _check_param(p, where: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(p).__name__}")
    if p.layout != torch.strided:
        raise TypeError(f"{where} must be a dense tensor, got layout {p.layout}")
    if p.device.type != "cpu":
        raise ValueError(f"{where} must be on the CPU, got device {p.device}")
    if p.dtype != torch.float32:
        raise TypeError(f"{where} must be float32, got {p.dtype}")
    if not p.is_contiguous():
        raise ValueError(f"{where} must be contiguous, got stride {p.stride()}")


def _check_grad(p, where: str) -> None:
    g = p.grad
    if g.layout != torch.strided:
        raise TypeError(f"gradient of {where} must be dense, got layout {g.layout}")
    if g.device.type != "cpu":
        raise ValueError(f"gradient of {where} must be on the CPU, got device {g.device}")
    if g.dtype not in _GRAD_DTYPES:
        raise TypeError(f"gradient of {where} must be float32/float16/bfloat16, got {g.dtype}")
    if g.shape != p.shape:
        raise ValueError(
            f"gradient of {where} has shape {tuple(g.shape)}, the parameter {tuple(p.shape)}"
        )
    if not g.is_contiguous():
        raise ValueError(f"gradient of {where} must be contiguous, got stride {g.stride()}")


def _check_state(state: dict, p, where: str) -> None:
    if not state:
        return
    for key in ("step", "exp_avg", "exp_avg_sq"):
        if key not in state:
            raise ValueError(f"optimizer state of {where} lacks {key!r}")
    for key in ("exp_avg", "exp_avg_sq"):
        t = state[key]
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != p.shape
                or t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(
                f"optimizer state {key!r} of {where} must be a contiguous CPU float32 tensor of "
                f"shape {tuple(p.shape)}"
            )


def _fast_ok(p, g, state) -> bool:
    """True when _check_param, _check_grad and _check_state would pass (the common case, in
    one expression: the named checks cost ~10 us a param, most of a small param's step;
    is_cpu, not device.type, which builds a torch.device per call; the param's size read once
    for the three compares, where each .shape of a Parameter took ~0.2 us: 0.46 -> 0.37 ms
    over 201 params)."""
    size = p.size()
    ok = (p.is_cpu and g.is_cpu and p.dtype is torch.float32 and g.dtype in _GRAD_DTYPES
          and p.layout is torch.strided and g.layout is torch.strided and g.size() == size
          and p.is_contiguous() and g.is_contiguous())
    if not ok or not state:
        return ok
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    return ("step" in state and type(m) is torch.Tensor and type(v) is torch.Tensor
            and m.is_cpu and v.is_cpu and m.dtype is torch.float32 and v.dtype is torch.float32
            and m.size() == size and v.size() == size and m.is_contiguous()
            and v.is_contiguous())


class CPUAdam(Optimizer):
    """Adam/AdamW for CPU fp32 parameters; a drop-in for ``torch.optim.AdamW``.

    Args:
        params: parameters or param groups (each group may override every hyperparameter).
        lr, betas, eps, weight_decay: as in torch.optim.AdamW.
        adamw_mode: True: decoupled weight decay (AdamW); False: L2 added to the gradient
            (torch.optim.Adam).  Stored per group as torch's ``decoupled_weight_decay``.
        bias_correction: False skips Adam's bias corrections (torch has no such switch).
        amsgrad: accepted for signature compatibility; only False is supported.

    Gradients may be fp32, fp16 or bf16 (of the parameter's shape); parameters whose grad is
    None are skipped.  The update runs in the compiled kernel with torch.get_num_threads()
    threads and is bitwise independent of the thread count.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, *,
                 adamw_mode: bool = True, bias_correction: bool = True, amsgrad: bool = False):
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": False,
            "decoupled_weight_decay": adamw_mode,
            "bias_correction": bias_correction,
        }
        _hyper(defaults, 0)  # fail on bad defaults even before looking at params
        self._disjoint_checked = None  # check_disjoint's last passing buffers
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        if isinstance(param_group, dict) and "adamw_mode" in param_group:
            param_group = dict(param_group)
            mode = param_group.pop("adamw_mode")
            if param_group.setdefault("decoupled_weight_decay", mode) != mode:
                raise ValueError("param group sets adamw_mode and decoupled_weight_decay apart")
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        try:
            _hyper(group, gi)
            for pi, p in enumerate(group["params"]):
                _check_param(p, _where(group, gi, pi))
        except (TypeError, ValueError):
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._disjoint_checked = None
        for group in self.param_groups:
            # A torch.optim.Adam(W) state_dict brings its own keys and lacks ours.
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])
            group.setdefault("bias_correction", self.defaults["bias_correction"])
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Validate everything first: a bad parameter anywhere leaves every state untouched.
        params, grads, ms, vs, steps, hypers, at = [], [], [], [], [], [], []
        fresh = []  # params whose state this step creates
        for gi, group in enumerate(self.param_groups):
            hyper = _hyper(group, gi)
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                state = self.state.get(p)
                if not _fast_ok(p, g, state):  # the named checks say what is wrong
                    where = _where(group, gi, pi)
                    _check_param(p, where)
                    _check_grad(p, where)
                    _check_state(state, p, where)
                params.append(p)
                grads.append(g)
                hypers.append(hyper)
                at.append((gi, pi))
                if state:
                    ms.append(state["exp_avg"])
                    vs.append(state["exp_avg_sq"])
                    steps.append(state["step"])
                else:
                    fresh.append(len(ms))
                    ms.append(None)
                    vs.append(None)
                    steps.append(None)
        if not params:
            return loss
        for i in fresh:
            p = params[i]
            state = self.state[p]
            state["step"] = steps[i] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = ms[i] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = vs[i] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)
        bufs = many_buffers(params, grads, ms, vs)
        # The same addresses and sizes as the last step's checked ones (the usual case: the
        # same tensors, grads reallocated in place by malloc) need no new sort of 4 per param.
        if (bufs.ptrs, bufs.ns, bufs.grad_sizes) != self._disjoint_checked:
            try:
                check_disjoint(bufs, lambda i: _where(self.param_groups[at[i][0]], *at[i]))
            except ValueError:
                for i in fresh:  # leave the optimizer as it was
                    del self.state[params[i]]
                raise
            self._disjoint_checked = (bufs.ptrs, bufs.ns, bufs.grad_sizes)
        # One parallel region over every param (adam_update_many), not one call per param: a
        # Llama's hundreds of tensors, many of a few thousand elements, each paid a fork/join
        # and ~100 us of Python.  The steps as torch.optim keeps them, float32 tensors.
        counts = bump_steps(steps)
        adam_update_many_unchecked(bufs, steps=counts, hypers=hypers)
        # The kernel writes through raw pointers; tell autograd the tensors changed.
        torch.autograd.graph.increment_version(params + ms + vs)
        return loss
