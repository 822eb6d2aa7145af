"""CPUAdam: torch.optim.AdamW's drop-in over CPU fp32 parameters, on the compiled one-pass kernel.

State uses torch's own keys (``step`` as a float32 scalar tensor, ``exp_avg``, ``exp_avg_sq``) and
param groups carry torch's ``decoupled_weight_decay`` flag for the mode, so a state_dict moves
between CPUAdam, torch.optim.AdamW and torch.optim.Adam in either direction with its meaning.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from hf_zoffload.ops.adam_kernels import adam_update, check_hyper

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
        work = []
        for gi, group in enumerate(self.param_groups):
            hyper = _hyper(group, gi)
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = _where(group, gi, pi)
                _check_param(p, where)
                _check_grad(p, where)
                _check_state(self.state.get(p), p, where)
                work.append((p, hyper))
        for p, hyper in work:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            m, v = state["exp_avg"], state["exp_avg_sq"]
            adam_update(
                p.view(-1), p.grad.view(-1), m.view(-1), v.view(-1),
                step=int(state["step"].item()), **hyper,
            )
            # The kernel writes through raw pointers; tell autograd the tensors changed.
            torch.autograd.graph.increment_version((p, m, v))
        return loss
