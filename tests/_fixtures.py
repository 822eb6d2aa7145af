"""The engine tests' shared fixtures: ``make_engine`` (an engine with its test module's
defaults, closed at the test's end) and ``train`` (the training loop they all run). The
conftest.py of each folder whose tests use them imports them; the root one does not, because
importing the engine costs a pytest process that runs no engine test (the scripts' and
gpu_check.sh's probes) triton's import, ~5-14 s on the 2-vCPU VM."""

from __future__ import annotations

import weakref

import pytest
import torch

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin

# The optimizer's own arguments; every other keyword is a ZeroOffloadPlugin setting.
_OPTIMIZER_ARGS = ("lr", "betas", "eps", "weight_decay", "process_group", "param_order")


class Engines:
    """``make_engine(params, model=None, **kw)``: a ZeroOffloadOptimizer over ``params`` (a
    module, meaning its parameters, or what torch optimizers take; ``model=`` is the engine's
    own argument, ``model=True`` that module), with a plugin built from the settings in ``kw`` over
    the test module's ``ENGINE_DEFAULTS`` (unset ones: the plugin's defaults, never the
    caller's HF_ZOFFLOAD_* environment). The engines it made that are still alive are closed at
    the test's end (their hooks, host state and delayed-update thread), held weakly so that a
    test of an engine being freed still sees it freed."""

    def __init__(self, defaults: dict):
        self.defaults = dict(defaults)
        self._made: list[weakref.ref] = []

    def __call__(self, params, **kw) -> ZeroOffloadOptimizer:
        kw = {**self.defaults, **kw}
        model = kw.pop("model", None)
        if model is True:  # the engine holds the module it is built over
            if not isinstance(params, torch.nn.Module):
                raise TypeError("make_engine: model=True needs a module as params")
            model = params
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        opt_args = {k: kw.pop(k) for k in _OPTIMIZER_ARGS if k in kw}
        opt = ZeroOffloadOptimizer(params, plugin=ZeroOffloadPlugin(**kw), model=model,
                                   **opt_args)
        self._made.append(weakref.ref(opt))
        return opt

    def close_all(self) -> None:
        for ref in self._made:
            opt = ref()
            if opt is not None:
                opt.close()
        self._made.clear()


def lm_loss(model: torch.nn.Module, ids: torch.Tensor, step: int) -> torch.Tensor:
    """A causal LM's loss on ``ids`` predicting themselves (the tiny models of tests/_tiny)."""
    return model(input_ids=ids, labels=ids).loss


class Loop:
    """``train(model, opt, steps, start=0, **kw)``: ``steps`` steps numbered from ``start``,
    each of ``accum`` micro-steps: micro-step j of step i backpropagates
    ``loss(model, batch(i * accum + j), i) / accum``; then the clip to ``clip`` (the engine's
    ``clip_grad_norm_``, or torch's over the params holding a grad for any other optimizer),
    ``opt.step()``, ``sched.step()`` and the grads zeroed through ``zero`` ("optimizer":
    ``opt.zero_grad()``; "model": ``model.zero_grad(set_to_none=True)``, as the Trainer does).
    ``batch``, ``loss`` (default ``lm_loss``), ``accum``, ``clip``, ``sched`` and ``zero`` come
    from ``kw`` over the test module's ``TRAIN_DEFAULTS``. Returns each step's loss, the sum of
    its micro-steps'."""

    KEYS = ("batch", "loss", "accum", "clip", "sched", "zero")

    def __init__(self, defaults: dict):
        unknown = set(defaults) - set(self.KEYS)
        if unknown:
            raise ValueError(f"TRAIN_DEFAULTS: unknown {sorted(unknown)}; allowed {self.KEYS}")
        self.defaults = dict(defaults)

    def __call__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
                 start: int = 0, **kw) -> list[float]:
        unknown = set(kw) - set(self.KEYS)
        if unknown:
            raise TypeError(f"train: unknown {sorted(unknown)}; allowed {self.KEYS}")
        kw = {"loss": lm_loss, "accum": 1, "clip": None, "sched": None, "zero": "optimizer",
              **self.defaults, **kw}
        if "batch" not in kw:
            raise TypeError("train: no batch (give batch= or the module's TRAIN_DEFAULTS)")
        batch, loss, accum, zero = kw["batch"], kw["loss"], kw["accum"], kw["zero"]
        if not (isinstance(accum, int) and accum >= 1):
            raise ValueError(f"train: accum must be an int >= 1, got {accum!r}")
        if zero not in ("optimizer", "model"):
            raise ValueError(f"train: zero must be 'optimizer' or 'model', got {zero!r}")
        engine = isinstance(opt, ZeroOffloadOptimizer)
        losses = []
        for step in range(start, start + steps):
            total = 0.0
            for micro in range(accum):
                part = loss(model, batch(step * accum + micro), step)
                if accum > 1:  # one micro-step: the loss as it is, bit for bit
                    part = part / accum
                part.backward()
                total += part.item()
            if kw["clip"] is not None:
                if engine:
                    opt.clip_grad_norm_(kw["clip"])
                else:
                    torch.nn.utils.clip_grad_norm_(
                        [p for p in model.parameters() if p.grad is not None], kw["clip"])
            opt.step()
            if kw["sched"] is not None:
                kw["sched"].step()
            if zero == "model":
                model.zero_grad(set_to_none=True)
            else:
                opt.zero_grad()
            losses.append(total)
        return losses


@pytest.fixture
def make_engine(request):
    """``make_engine(params, model=None, **kw)`` with the test module's ``ENGINE_DEFAULTS``
    (optimizer arguments and plugin settings) under ``kw`` (``Engines``)."""
    engines = Engines(getattr(request.module, "ENGINE_DEFAULTS", {}))
    yield engines
    engines.close_all()


@pytest.fixture(name="train")
def train_fixture(request):
    """``train(model, opt, steps, start=0, **kw)`` with the test module's ``TRAIN_DEFAULTS``
    under ``kw`` (``Loop``)."""
    return Loop(getattr(request.module, "TRAIN_DEFAULTS", {}))
