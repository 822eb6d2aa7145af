"""ZeRO-Offload in a plain Accelerate loop: `prepare_zero_offload` replaces `accelerator.prepare`.

The loop itself is unchanged::

    from hf_zoffload import prepare_zero_offload                                      # + 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    scheduler = get_scheduler("linear", optimizer, ...)
    model, optimizer, loader, scheduler = prepare_zero_offload(                       # ~ 2
        accelerator, model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

The AdamW is replaced by a `ZeroOffloadOptimizer` with the same param groups and
hyper-parameters (after the model is on the device, as the engine casts it in place), and the
schedulers passed along are re-pointed at it. Precision: the compute dtype is accelerate's
mixed_precision (fp32 for "no") unless ``compute_dtype`` is set (argument, HF_ZOFFLOAD_*,
sidecar); the engine casts the trained params to it in place and keeps their fp32 masters on
the host. Saving (``save_model``, ``save_state``, ``get_state_dict``) gives the fp32 masters
(``save_dtype``, `core.saved_state_dict`). A `ZeroOffloadOptimizer` built by hand is taken
as is. The wiring shared with `ZeroOffloadTrainer` (accelerate's optimizer wrapper, the
clip route and fp16 loss scaler on this accelerator, the frozen-param cast, the flush before
saving) is `hf_zoffload.integrations.core`; tensor parallelism's setup is
`hf_zoffload.integrations.parallel`. Settings: arguments > HF_ZOFFLOAD_* > the sidecar
yaml named by HF_ZOFFLOAD_CONFIG; HF_ZOFFLOAD_ENABLED=false (or `zero_offload: false` in the
sidecar) makes it plain `accelerator.prepare`.

Accelerate internals relied on (accelerate 1.15; tests/integrations/test_accelerate.py pins
them): `prepare_optimizer` keeps an optimizer marked `_is_accelerate_prepared` as is;
`AcceleratedOptimizer(optimizer, device_placement, scaler)` and its `step_was_skipped`;
`Accelerator.backward` scales by `accelerator.scaler`; `AcceleratedScheduler` skips when
`step_was_skipped`.
"""

from __future__ import annotations

import functools
import logging

import torch
from accelerate.utils import FullyShardedDataParallelPlugin

from ..config import ZeroOffloadPlugin, check_values, enabled_from_sources, sourced_values
from ..offload.engine import ZeroOffloadOptimizer
from ..offload.modes.fsdp2_offload import fsdp2_states
from . import core, parallel
from .plan import ACCELERATE, make_plan, prepare_unwrapped

__all__ = ["prepare_zero_offload", "zero_offload_enabled"]

logger = logging.getLogger(__name__)


def zero_offload_enabled(*, environ=None) -> bool:
    """HF_ZOFFLOAD_ENABLED if set, else the sidecar's ``zero_offload:``, else True."""
    return enabled_from_sources(default=True, environ=environ)


def _plugin(accelerator, settings: dict) -> ZeroOffloadPlugin:
    mp = str(accelerator.mixed_precision)
    # Unset everywhere, the compute dtype follows accelerate's mixed precision, as the stock
    # `accelerator.prepare` would train: fp16/bf16, or fp32 for "no" (not the plugin's bf16
    # default, which would turn an fp32 loop into a pure bf16 one without a word). Set
    # anywhere, it must agree with accelerate's fp16/bf16 (checked below).
    if "compute_dtype" not in settings and "compute_dtype" not in sourced_values()[0]:
        settings = {**settings, "compute_dtype": mp if mp in ("fp16", "bf16") else "fp32"}
    return ZeroOffloadPlugin.from_sources(**settings)


def _check_dtype(accelerator, plugin) -> None:
    mp = str(accelerator.mixed_precision)
    if mp in ("fp16", "bf16") and plugin.compute_dtype != mp:
        raise ValueError(
            f"accelerate mixed_precision is {mp} but ZeRO-Offload compute_dtype is "
            f"{plugin.compute_dtype}: make them agree (or set accelerate's to 'no').")


def _engine_from_adam(opt: torch.optim.Optimizer, plugin, *, models, sharded, process_group):
    if opt.state:
        raise ValueError(
            f"{type(opt).__name__} has already stepped; its state cannot move to the host: "
            "call prepare_zero_offload before training (load checkpoints after it).")
    groups = []
    for i, g in enumerate(opt.param_groups):
        bad = [k for k in ("amsgrad", "maximize") if g.get(k)]
        if bad:
            raise ValueError(f"param group {i}: {', '.join(bad)}=True is not supported by "
                             "ZeRO-Offload's CPU-Adam; allowed: False")
        decoupled = isinstance(opt, torch.optim.AdamW) or g.get("decoupled_weight_decay")
        if g["weight_decay"] and not decoupled:
            raise ValueError(
                f"param group {i}: torch.optim.Adam's weight_decay={g['weight_decay']} is an "
                "L2 term added to the gradient; ZeRO-Offload decays as AdamW does. Use "
                "torch.optim.AdamW, or weight_decay=0.")
        # the engine skips frozen ones; `sharded`: the params tensor parallelism replaced
        groups.append({"params": [sharded.get(id(p), p) for p in g["params"]],
                       "lr": float(g["lr"]), "betas": tuple(float(b) for b in g["betas"]),
                       "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])})
    first = groups[0]
    engine = ZeroOffloadOptimizer(groups, lr=first["lr"], betas=first["betas"], eps=first["eps"],
                                  weight_decay=first["weight_decay"], plugin=plugin,
                                  # buckets by the models' layers, not by the groups; one
                                  # model: its modules wait for their own params' uploads
                                  param_order=[p for m in models for p in m.parameters()],
                                  model=models[0] if len(models) == 1 else None,
                                  process_group=process_group)
    # Keys a scheduler built on `opt` put in its groups (initial_lr, OneCycleLR's max_lr and
    # min_lr, ...) are read back by that scheduler: they move over. torch's own Adam options
    # stay behind (checked above or meaningless for the CPU-Adam).
    adam_keys = {"params", "lr", "betas", "eps", "weight_decay", "amsgrad", "foreach",
                 "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"}
    for src, dst in zip(opt.param_groups, engine.param_groups, strict=True):
        dst.update({k: v for k, v in src.items() if k not in adam_keys})
    return engine


def _track_steps_for_scheduler(engine) -> None:
    # torch's LRScheduler wraps the step of the optimizer it was built on to warn when
    # scheduler.step() runs first; re-pointed at the engine, it would warn on its first step
    # that "optimizer.step() has been overridden". Give the engine the same per-instance
    # marker (torch-private names: if they change, the cost is that one spurious warning).
    step = engine.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    @functools.wraps(step)
    def tracked(*args, **kwargs):
        engine._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    engine.step = tracked


def _repoint_schedulers(objects, old, engine) -> None:
    found = False
    for obj in objects:
        if not isinstance(obj, torch.optim.Optimizer) and getattr(obj, "optimizer", None) is old:
            obj.optimizer = engine
            found = True
    if found:
        _track_steps_for_scheduler(engine)
    elif getattr(old.step, "_wrapped_by_lr_sched", False):
        raise ValueError(
            "a learning-rate scheduler was built on this optimizer but is not among the "
            "objects passed to prepare_zero_offload: pass it too, so that it drives the "
            "ZeRO-Offload optimizer that replaces the optimizer.")


def prepare_zero_offload(accelerator, *objects, plugin: ZeroOffloadPlugin | None = None,
                         enabled: bool | None = None,
                         fsdp_plugin: FullyShardedDataParallelPlugin | None = None, **settings):
    """Drop-in for ``accelerator.prepare(*objects)`` that offloads the optimizer.

    ``objects`` are what `accelerator.prepare` takes; exactly one optimizer among them, a
    ``torch.optim.AdamW`` (or ``Adam`` without weight decay) or a ``ZeroOffloadOptimizer``.
    ``plugin`` or keyword ``settings`` (ZeroOffloadPlugin fields) override HF_ZOFFLOAD_* and
    the sidecar yaml. ``enabled`` (default HF_ZOFFLOAD_ENABLED, then the sidecar's
    ``zero_offload``, then True) False: plain ``accelerator.prepare``. Returns what
    ``accelerator.prepare`` returns, the optimizer being accelerate's wrapper of the engine.

    Tensor parallelism: ``Accelerator(parallelism_config=ParallelismConfig(tp_size=N))``
    (``hf_zoffload.integrations.parallel.ParallelismConfig`` on CPU processes). A whole
    model (the same weights on every rank) is sharded here with its transformers plan, before
    the engine is built over the AdamW's groups; one already sharded must match ``tp_size``.
    Data parallelism over the other ranks is ``dp_shard_size`` (integrations/parallel.py).

    FSDP2 parameter offload: accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2,
    cpu_offload=True, state_dict_type="FULL_STATE_DICT")``, given as ``fsdp_plugin`` (CPU
    processes: accelerate drops a plugin given to ``Accelerator``), or the accelerator's
    (GPU processes), or ``accelerate launch``'s FSDP environment. The whole model is sharded
    here with accelerate's ``fsdp2_prepare_model`` before the engine is built over the AdamW's
    groups (integrations/fsdp2.py); other FSDP layouts are refused before anything changes.
    """
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    models = [m for m in objects if isinstance(m, torch.nn.Module)]
    if plugin is not None and settings:
        raise TypeError("pass either plugin= or ZeRO-Offload settings as keywords, not both")
    # Unknown names and bad values fail whether offload is on or off, before anything runs.
    check_values(settings, lambda name: f"prepare_zero_offload({name}=...)")
    if enabled is None:
        enabled = zero_offload_enabled()
    if not enabled:
        if any(getattr(o, "fused_loss_scaling", False) for o in optimizers):
            raise ValueError("ZeRO-Offload is disabled (HF_ZOFFLOAD_ENABLED / zero_offload: "
                             "false) but a ZeroOffloadOptimizer was built; pass a torch AdamW")
        if settings or plugin is not None:  # a script's settings, launched with offload off
            logger.warning("ZeRO-Offload is off (enabled=False, HF_ZOFFLOAD_ENABLED or the "
                           "sidecar's zero_offload: false): the settings passed to "
                           "prepare_zero_offload are not used")
        return accelerator.prepare(*objects)
    if len(optimizers) != 1:
        raise ValueError(f"prepare_zero_offload needs exactly one optimizer among the objects, "
                         f"got {len(optimizers)}")
    old = optimizers[0]
    given_engine = isinstance(old, ZeroOffloadOptimizer)
    if given_engine and (plugin is not None or settings):
        raise TypeError("the ZeroOffloadOptimizer has its plugin already; pass settings to "
                        "it, not to prepare_zero_offload")
    if not given_engine and not isinstance(old, torch.optim.Adam):  # AdamW subclasses Adam
        raise TypeError(f"{type(old).__name__} cannot be offloaded; allowed: "
                        "torch.optim.AdamW, torch.optim.Adam, ZeroOffloadOptimizer")
    engine_plugin = old.plugin if given_engine else plugin or _plugin(accelerator, settings)
    trained_here = [m for m in models if core.trains(m, old)]
    plan = make_plan(accelerator, front=ACCELERATE, fsdp_plugin=fsdp_plugin,
                     dtype=engine_plugin.torch_dtype,
                     save_on_each_node=getattr(getattr(
                         accelerator, "project_configuration", None), "save_on_each_node", False))
    if plan.fsdp is not None:
        _check_fsdp(plan, old, trained_here)
    for m in trained_here:
        plan.check_model(m)
    if given_engine:
        engine = old
        for m in trained_here:
            if plan.tp > 1 and parallel.model_tp_size(m) == 1:  # sharding would strand it
                raise ValueError(f"the ZeroOffloadOptimizer was built on a whole model, but the "
                                 f"parallelism_config says tp_size={plan.tp}: build it after "
                                 "the model is sharded, or pass a torch AdamW "
                                 "(prepare_zero_offload then shards the model first)")
            plan.place(accelerator, m)  # sizes that do not fit raise; nothing to shard
    else:
        plugin = engine_plugin
        _check_dtype(accelerator, plugin)
        plugin.check_device(torch.device(accelerator.device).type)
        # tensor parallelism, or FSDP2: a whole model is sharded before it moves to the device
        sharded = {}
        for m in trained_here:
            sharded.update(plan.place(accelerator, m))
        plan.enter(accelerator)  # everything is checked: nothing refuses now
        if plan.fsdp is not None:
            sharded.update(plan.shard(accelerator, trained_here[0]))
        if accelerator.device_placement:  # as prepare_model would, but before the engine
            for m in models:
                # FSDP2 with CPU offload keeps its sharded params on the host and moves them
                # itself (offload/modes/fsdp2_offload.py)
                if not accelerator.verify_device_map(m) and not fsdp2_states(m):
                    m.to(accelerator.device)
        engine = _engine_from_adam(old, plugin, models=models, sharded=sharded,
                                   process_group=parallel.data_parallel_group(accelerator))
        _repoint_schedulers(objects, old, engine)
    _check_dtype(accelerator, engine.plugin)
    if accelerator.device_placement and not engine.exchange.params_on_host:
        wrong = {str(p.device) for p in core.engine_params(engine)
                 if not _same_device(p.device, accelerator.device)}
        if wrong:
            raise ValueError(f"the optimizer's parameters are on {sorted(wrong)}, not on "
                             f"{accelerator.device}: build the ZeroOffloadOptimizer after "
                             "model.to(accelerator.device), or pass a torch AdamW instead")
    # The fp16 loss scaler and the clip route; frozen float params of the trained model(s)
    # join the compute dtype, or matmuls would mix dtypes (not those of e.g. a teacher);
    # reading their weights lands a delayed update.
    wrapped = plan.wire(accelerator, engine, models)
    ready = []
    for o in objects:
        if o is old:
            o = wrapped
        elif core.trains(o, engine) if isinstance(o, torch.nn.Module) else False:
            o = prepare_unwrapped(accelerator, o)  # no DDP wrapper (plan.py)
        ready.append(o)
    return accelerator.prepare(*ready)


def _check_fsdp(plan, old, trained_here) -> None:
    """What the FSDP plugin needs of the objects passed, before anything changes (the plugin
    itself is checked by `make_plan`)."""
    if len(trained_here) != 1:
        raise ValueError(f"ZeRO-Offload with FSDP2 trains one model; the optimizer's params are "
                         f"in {len(trained_here)} of the models passed")
    plan.check_model(trained_here[0])  # sharded by hand already: refused
    if isinstance(old, ZeroOffloadOptimizer):
        raise ValueError("an FSDP plugin asks to shard the model, but the ZeroOffloadOptimizer "
                         "was built on the whole model: pass a torch AdamW (the model is "
                         "sharded first), or shard the model yourself before building it")


def _same_device(a: torch.device, b: torch.device) -> bool:
    # accelerate's device may carry no index ("cuda") where params say "cuda:0".
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
