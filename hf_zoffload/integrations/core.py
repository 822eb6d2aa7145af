"""What the Trainer and the Accelerate integrations share: how an engine is wired in.

Both `ZeroOffloadTrainer` (trainer.py) and `prepare_zero_offload` (accelerate.py) build a
`ZeroOffloadOptimizer` their own way, then hand it here:

- `OffloadedOptimizer`: the engine as accelerate sees it, an `AcceleratedOptimizer` already
  marked prepared (``accelerator.prepare`` registers it as is: the stock wrapper would copy the
  host state to the device, 12 B/param, and patch ``step`` for a torch GradScaler we do not
  use). Its ``step_was_skipped`` is the engine's overflow skip, so the scheduler holds on those
  steps; it also sums the engine's per-step timings for the Trainer's log window, and holds
  the non-finite stop (`nonfinite.NonFiniteStop`, ``max_nonfinite_steps``), judged after
  each optimizer step.
- `install`: the one place an accelerator is patched, on that instance only (no class is
  touched): the fp16 loss scaler becomes ``accelerator.scaler`` and ``clip_grad_norm_`` /
  ``clip_grad_value_`` route the engine's params to the engine (their gradients were streamed
  to host buckets during backward; ``param.grad`` is None).
- `prepare_models`: frozen float params of the trained model(s) join the compute dtype (the
  engine casts only the params it trains; a frozen fp32 weight next to them would make the
  matmuls mix dtypes; frozen params of other dtypes, a quantized base's codes, stay as they
  are), and reading their weights (``state_dict``) first lands a pending delayed update.
  Models holding none of the engine's params (e.g. a teacher) are left alone.
- Saved weights (`saved_state_dict`): with ``save_dtype=fp32`` (the default) the model's
  weights are saved as the fp32 master weights, as a stock mixed-precision run saves its fp32
  params; the device copy is in the compute dtype and would lose what the masters hold. With
  N ranks the masters are sharded: they are gathered onto each saving rank. The Trainer saves
  through it, and `install` routes ``accelerator.get_state_dict`` (``save_model``,
  ``save_state``) to it. ``save_pretrained`` of a trained model writes ``dtype: float32``
  into its config when given such a dict, so ``from_pretrained`` loads what was saved.
- Tensor parallelism: the saved weights (masters, or with ``save_dtype=compute`` the model's
  tensors) and the optimizer state (the engine's ``consolidate_state_dict``) are
  gathered whole onto the first rank, every rank taking part; a checkpoint loads with any
  tensor-parallel size, or none: a model with DTensor params (tensor-parallel, or FSDP2's
  shards) takes whole tensors in ``load_state_dict`` (`take_whole_tensors`).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import types
import weakref
from collections import OrderedDict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from accelerate.optimizer import AcceleratedOptimizer
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel
from transformers.utils import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from .nonfinite import NonFiniteStop

__all__ = ["SHARES", "TIMINGS", "OffloadedOptimizer", "ClipRoute", "WholeWeights", "MasterWeights",
           "engine_params", "tensor_parallel", "trains", "prepare_models", "take_whole_tensors",
           "saved_state_dict",
           "remove_model_weights", "show_info_logs", "install", "attached_engine"]

# The engine's per-step timings (ZeroOffloadOptimizer.timings says what each measures);
# the copy times exist on CUDA only and are logged only where they were reported.
# The overlapped schedule's (overlap_step) two timings and its running hit rate come on top.
TIMINGS = ("fwd_bwd", "grad_wait", "cpu_adam", "upload_host", "d2h_copy", "h2d_copy",
           "cpu_adam_early", "correction")
SHARES = ("hit_share",)  # logged as they are (the last step's value), not as _ms means
# On the accelerator instance: the engine installed, and what `install` replaced.
_ENGINE_ATTR, _OWN_ATTR = "_zero_offload_engine", "_zero_offload_own"
# model -> its state_dict pre-hook that lands the engine's delayed update (prepare_models)
_FLUSH_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# models whose load_state_dict takes whole tensors for their DTensor params (take_whole_tensors)
_TAKES_WHOLE: weakref.WeakSet = weakref.WeakSet()


# --------------------------------------------------------------------------- optimizer
class OffloadedOptimizer(AcceleratedOptimizer):
    """The engine as accelerate sees it: no state move to the device, no GradScaler patch
    (the engine unscales, checks and skips inside its own step), and the engine's skip
    reported to the Trainer / the scheduler. Also sums the engine's per-step timings for a
    log window (`take_window`)."""

    def __init__(self, engine):
        # device_placement=False: accelerate round-trips the state dict through the device
        # (state_dict -> .to(device) -> load_state_dict): that would copy the host fp32 master
        # and both moments (12 B/param, 84 GB for 7B) to the GPU. scaler=None: the engine
        # unscales and checks overflow itself.
        super().__init__(engine, device_placement=False, scaler=None)
        self._is_accelerate_prepared = True  # prepare() then registers it as is
        self.window = dict.fromkeys(TIMINGS, 0.0)
        self.counts = dict.fromkeys(TIMINGS, 0)
        self.first = True  # the engine times fwd_bwd from the previous step's end: none yet
        # max_nonfinite_steps (nonfinite.py); the Trainer numbers its steps and feeds losses
        self.nonfinite = NonFiniteStop(engine.plugin.max_nonfinite_steps)

    @property
    def step_was_skipped(self) -> bool:
        # Read by the Trainer and AcceleratedScheduler: an fp16 overflow skips the LR step too.
        return bool(self.optimizer.last_step_skipped)

    def step(self, closure=None):
        synced = self.gradient_state.sync_gradients
        out = super().step(closure)
        if synced:
            for k in TIMINGS:  # the copy times are reported on CUDA only
                if k in self.optimizer.timings:
                    if not (k == "fwd_bwd" and self.first):
                        self.window[k] += self.optimizer.timings[k]
                        self.counts[k] += 1
            self.first = False
            self.nonfinite.after_step(self.optimizer)
        return out

    def take_window(self) -> dict:
        """Mean milliseconds per step since the last call, then reset. ``fwd_bwd`` is the wall
        time between two optimizer steps: forward, backward and the loop's own work. A timing
        no step of the window measured is left out, not given as 0: the first step has no
        ``fwd_bwd`` (no step before it to time from), so a window of that step alone has none.
        With ``overlap_step`` also ``hit_share``: the share of steps so far whose early updates
        stood."""
        out = {f"{k}_ms": round(1e3 * v / self.counts[k], 3)
               for k, v in self.window.items() if self.counts[k]}
        out.update({k: round(self.optimizer.timings[k], 4) for k in SHARES
                    if k in self.optimizer.timings})
        self.window = dict.fromkeys(TIMINGS, 0.0)
        self.counts = dict.fromkeys(TIMINGS, 0)
        return out


# --------------------------------------------------------------------------- models
def engine_params(engine) -> list[torch.nn.Parameter]:
    """The params the engine trains, in group order."""
    return [p for g in engine.param_groups for p in g["params"]]


def tensor_parallel(engine) -> bool:
    """Whether the engine trains tensor-parallel (DTensor) params."""
    return any(isinstance(p, DTensor) for p in engine_params(engine))


def trains(model: torch.nn.Module, engine) -> bool:
    """Whether ``model`` holds at least one of the engine's params."""
    ours = {id(p) for p in engine_params(engine)}
    return any(id(p) in ours for p in model.parameters())


def prepare_models(engine, models: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """For each model holding some of the engine's params: cast its frozen float params to
    the compute dtype, and land a pending delayed update before its weights are read.
    Returns those models; the others (a teacher, a reference model) are not touched."""
    dtype = engine.plugin.torch_dtype
    trained = [m for m in models if trains(m, engine)]
    for model in trained:
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        # With the delayed update the last step's params land only at the next step: whatever
        # reads the model's weights (save_state, save_pretrained, get_state_dict, the
        # Trainer's checkpoints) lands them first. state_dict covers every save path. One
        # set of hooks per model, for its latest engine, held weakly: an engine replaced on
        # the same model (the Trainer's out-of-memory retry) is neither kept alive nor flushed.
        for handle in _FLUSH_HOOKS.pop(model, ()):
            handle.remove()
        _FLUSH_HOOKS[model] = [model.register_state_dict_pre_hook(_flusher(engine))]
        if engine.plugin.delayed_update:
            _FLUSH_HOOKS[model] += _flush_before_inference(engine, model)
        if isinstance(model, PreTrainedModel) and "save_pretrained" not in vars(model):
            # Bound to this instance (a deepcopy rebinds it to the copy); the class is untouched.
            model.save_pretrained = types.MethodType(_save_pretrained, model)
        if any(isinstance(p, DTensor) for p in model.parameters()):
            take_whole_tensors(model)  # tensor-parallel or FSDP2: what we save loads back
    return trained


def take_whole_tensors(model: torch.nn.Module) -> None:
    """Make ``model.load_state_dict`` take whole tensors for its DTensor params (tensor
    parallelism, FSDP2's shards): what the integrations save, what a Trainer resuming from a
    checkpoint or loading its best one loads. Each becomes this rank's part of it, cut where
    DTensor puts the local shard (no collective; FSDP2 cuts its shards by the same rule,
    torch.chunk's), and ``copy_`` writes that part into the param's local tensor."""
    if model in _TAKES_WHOLE:
        return
    _TAKES_WHOLE.add(model)

    def whole_to_parts(module, state_dict, prefix, *_args):
        # remove_duplicate=False: a tied param's every name (a state dict may hold both)
        for name, p in module.named_parameters(remove_duplicate=False):
            got = state_dict.get(prefix + name)
            if isinstance(p, DTensor) and isinstance(got, torch.Tensor) and \
                    not isinstance(got, DTensor) and got.shape == p.shape:
                state_dict[prefix + name] = distribute_tensor(
                    got, p.device_mesh, p.placements, src_data_rank=None)

    model.register_load_state_dict_pre_hook(whole_to_parts)


def _flusher(engine, *, only_without_grad: bool = False):
    ref = weakref.ref(engine)

    def flush(*_args, **_kw):
        if only_without_grad and torch.is_grad_enabled():
            return
        alive = ref()
        if alive is None or alive.closed or (only_without_grad and not alive.update_in_flight):
            return
        alive.flush()
    return flush


def _flush_before_inference(engine, model: torch.nn.Module) -> list:
    """With the delayed update, a forward of ``model`` without grad (``generate``, as TRL's
    GRPO and online trainers run with the model being trained; a log-prob pass; a callback's
    evaluation) first lands the pending update, so that it computes on the params of the last
    step taken; a training forward (grad enabled) keeps running on the params one step behind,
    as the delayed update is meant to. The hooks sit on the model and on each module holding
    the engine's params directly: a peft model's ``generate`` calls the inner model's forward,
    not its own."""
    ours = {id(p) for p in engine_params(engine)}
    hook = _flusher(engine, only_without_grad=True)
    modules = [model] + [m for m in model.modules() if m is not model and any(
        id(p) in ours for p in m.parameters(recurse=False))]
    return [m.register_forward_pre_hook(hook) for m in modules]


# --------------------------------------------------------------------------- saving
class WholeWeights(OrderedDict):
    """A model state dict of whole tensors gathered from tensor-parallel shards (or the
    master weights): `_save_pretrained` writes it as is, without transformers' own gather.
    An OrderedDict, so accelerate's safetensors path drops tied duplicates as it does for
    ``state_dict()``."""

    def __reduce__(self):
        # Pickled (save_state with safe_serialization=False) as a plain OrderedDict, so that
        # torch.load(weights_only=True) reads it without this class.
        return OrderedDict, (list(self.items()),)


class MasterWeights(WholeWeights):
    """A model state dict whose trained params are the fp32 master weights."""


def saved_state_dict(engine, model: torch.nn.Module, *, saves_here: bool):
    """The weights to save for ``model`` (the unwrapped model the engine trains), or None.

    ``save_dtype=compute``: None (the caller saves ``model.state_dict()`` as usual), but with
    tensor parallelism a `WholeWeights` of the model's tensors gathered whole. ``fp32``: a
    `MasterWeights` on each rank where ``saves_here``, None elsewhere. With N ranks (or
    tensor parallelism) a collective every rank enters; with tensor parallelism the first
    rank is the one saving rank (the integrations refuse save_on_each_node)."""
    tp = tensor_parallel(engine)
    if engine.plugin.save_dtype != "fp32":
        return _whole_model(model, saves_here=saves_here) if tp else None
    ex = engine.exchange
    targets, rank = [0], ex.rank
    if tp:
        rank = dist.get_rank()  # the engine gathers onto a global rank (ex.rank is the dp one)
    elif ex.world > 1:
        # The saving ranks: rank 0, or each node's first with save_on_each_node.
        flags = [None] * ex.world
        dist.all_gather_object(flags, bool(saves_here))
        targets = [r for r, f in enumerate(flags) if f]
    out = None
    for target in targets:
        sd = engine.master_state_dict(model, to=target)
        if target == rank:
            out = sd
    if out is None:
        return None
    # Tied params (GPT-2's lm_head and wte) share one tensor again, so that savers drop the
    # duplicate as they do for model.state_dict().
    first, shared = {}, MasterWeights()
    for name, t in model.state_dict(keep_vars=True).items():
        shared[name] = shared[first[id(t)]] if id(t) in first else out[name]
        first.setdefault(id(t), name)
    return shared


def _whole_model(model: torch.nn.Module, *, saves_here: bool):
    """``model.state_dict()`` with each DTensor gathered whole (a collective per DTensor, in
    the same order on every rank), CPU tensors, on the first rank only."""
    out, rank = WholeWeights(), dist.get_rank()
    for name, t in model.state_dict().items():
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if rank == 0:
            out[name] = t.detach().cpu() if isinstance(t, torch.Tensor) else t
    return out if rank == 0 and saves_here else None


def _variant(name: str, variant: str | None) -> str:
    # transformers' naming of a variant: model.safetensors -> model.fp16.safetensors
    if not variant:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def remove_model_weights(folder: str, variant: str | None = None) -> list[str]:
    """Remove the whole-model weights a previous save left in ``folder``, in either layout
    and format (one file, or an index and its shards; safetensors or ``.bin``), of
    ``variant``; returns the names removed. Run before a model is saved there.

    transformers' ``save_pretrained`` (5.x) removes only the shards of its own pattern that
    its new split does not write: a sharded save over one file leaves ``model.safetensors``,
    a one-file save over shards leaves the index, and either leaves ``pytorch_model*.bin``.
    The Trainer's resume reads ``model.safetensors`` (else ``pytorch_model.bin``) before any
    index, so the stale file is what would be loaded."""
    names = {_variant(n, variant) for n in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME,
                                            WEIGHTS_NAME, WEIGHTS_INDEX_NAME)}
    stems = "|".join(re.escape(_variant(n, variant).rsplit(".", 1)[0])
                     for n in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME))
    shard = re.compile(rf"({stems})-\d{{5}}-of-\d{{5}}\.(safetensors|bin)")
    removed = sorted(n for n in os.listdir(folder) if (n in names or shard.fullmatch(n))
                     and os.path.isfile(os.path.join(folder, n)))
    for n in removed:
        os.remove(os.path.join(folder, n))
    return removed


def _save_pretrained(model, save_directory, *args, state_dict=None, **kwargs):
    """``save_pretrained`` of a model the engine trains. transformers writes the params' dtype
    into the config (``dtype``), which ``from_pretrained`` loads in; given the fp32 master
    weights the config must say float32, or the fp32 file would be loaded as 16-bit. The
    weights of an earlier save in the other layout are removed first (`remove_model_weights`)."""
    given = inspect.signature(PreTrainedModel.save_pretrained).bind(
        model, save_directory, *args, state_dict=state_dict, **kwargs).arguments
    if given.get("is_main_process", True) and os.path.isdir(save_directory):
        remove_model_weights(save_directory, given.get("variant"))
    # A model sharded at load time gathers its shards inside save_pretrained and then waits
    # for every rank at a barrier; the dict given is whole already and only this rank saves.
    sharded_at_load = getattr(model.config, "distributed_config", None)
    if isinstance(state_dict, WholeWeights):
        model.config.distributed_config = None
    try:
        out = type(model).save_pretrained(model, save_directory, *args, state_dict=state_dict,
                                          **kwargs)
    finally:
        if sharded_at_load is not None:
            model.config.distributed_config = sharded_at_load
    if isinstance(state_dict, MasterWeights) and kwargs.get("is_main_process", True):
        written = model.config.dtype
        model.config.dtype = "float32"
        try:
            model.config.save_pretrained(save_directory)
        finally:
            model.config.dtype = written
    return out


# --------------------------------------------------------------------------- logs
def show_info_logs(*, main_process: bool) -> bool:
    """Print the package's INFO lines (the memory report, the host memory check, the long
    host passes) on the main process when the user configured no logging: returns whether
    a handler was added.

    Why: the Trainer's default verbosity is WARNING and Python's default shows warnings only,
    so these lines, what a user most needs at the start of a run (what offload saves, whether
    it fits) and none of them a warning, showed only with INFO logging set up by hand. A user
    who set up logging (a root handler, as ``logging.basicConfig`` adds; or a handler or
    level on the ``hf_zoffload`` logger) keeps exactly what they chose (one set up after the
    Trainer is built gets these lines twice: set it up first); the other ranks print nothing
    more, as the Trainer's own replicas log less."""
    pkg = logging.getLogger(__name__.split(".")[0])
    if not main_process or pkg.handlers or pkg.level != logging.NOTSET \
            or logging.getLogger().handlers:
        return False
    handler = logging.StreamHandler()  # stderr, where Python's own last-resort output goes
    handler.setFormatter(logging.Formatter("%(message)s"))
    pkg.addHandler(handler)
    pkg.setLevel(logging.INFO)
    return True


# --------------------------------------------------------------------------- accelerator
class ClipRoute:
    """``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` once an engine is installed.

    The engine's gradients were streamed to host buckets during backward (``param.grad`` is
    None), so accelerate's ``torch.nn.utils.clip_grad_norm_`` would see none: over the
    engine's params, the engine computes the global norm from its buckets (unscaled) and
    applies the clip coefficient inside its next step. Other params go to the accelerator's
    own methods. Part of the engine's params, or the engine's mixed with other params that
    have gradients, raise; so does ``clip_grad_value_`` over the engine's params."""

    def __init__(self, engine, clip_norm, clip_value):
        self.engine = engine
        self.ours = {id(p) for p in engine_params(engine)}
        self.clip_norm, self.clip_value = clip_norm, clip_value  # the accelerator's own

    def split(self, parameters) -> tuple[list, bool]:
        """The params as a list, and whether they are the engine's (all of them)."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        mine = {id(p) for p in params} & self.ours
        if mine and mine != self.ours:
            raise ValueError(
                "accelerator.clip_grad_norm_ got part of the ZeRO-Offload optimizer's "
                "parameters: their gradients are in host buckets and are clipped together; "
                "pass all of them (model.parameters()).")
        others = [p for p in params if id(p) not in self.ours and p.grad is not None]
        if mine and others:
            raise ValueError("accelerator.clip_grad_norm_ mixes ZeRO-Offload parameters with "
                             "others that have gradients; clip them in two calls.")
        return params, bool(mine)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params, offloaded = self.split(parameters)
        if offloaded:
            return self.engine.clip_grad_norm_(max_norm, norm_type)
        return self.clip_norm(params, max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        params, offloaded = self.split(parameters)
        if offloaded:
            raise NotImplementedError("clip_grad_value_ is not supported with ZeRO-Offload "
                                      "(gradients live in host buckets); use clip_grad_norm_")
        return self.clip_value(params, clip_value)


def attached_engine(accelerator):
    """The engine `install` put on this accelerator, or None."""
    return getattr(accelerator, _ENGINE_ATTR, None)


def install(accelerator, engine, *, replace: bool = False) -> None:
    """The one place an accelerator is patched for ``engine``: this instance only, no class
    is touched. One engine per accelerator: a second raises, unless ``replace`` (the Trainer
    re-creating its optimizer for a re-initialised model), which first undoes the first.

    fp16: ``accelerator.scaler`` becomes the engine's dynamic loss scaler, so
    ``accelerator.backward`` scales the loss with it and ``save_state`` / the Trainer save it
    as ``scaler.pt`` (``unscale_gradients`` is then a no-op: the engine unscales). Clipping:
    ``clip_grad_norm_`` and ``clip_grad_value_`` become a `ClipRoute`'s."""
    if attached_engine(accelerator) is None:
        own = (accelerator.clip_grad_norm_, accelerator.clip_grad_value_, accelerator.scaler,
               accelerator.get_state_dict)
        setattr(accelerator, _OWN_ATTR, own)
    elif not replace:
        raise ValueError("this Accelerator already has a ZeRO-Offload optimizer; one per "
                         "Accelerator is supported")
    clip_norm, clip_value, scaler, get_state_dict = getattr(accelerator, _OWN_ATTR)
    setattr(accelerator, _ENGINE_ATTR, engine)
    accelerator.scaler = engine.loss_scaler if engine.loss_scaler.is_enabled() else scaler
    route = ClipRoute(engine, clip_norm, clip_value)
    accelerator.clip_grad_norm_ = route.clip_grad_norm_
    accelerator.clip_grad_value_ = route.clip_grad_value_
    accelerator.get_state_dict = _MasterStateDict(accelerator, engine, get_state_dict)


class _MasterStateDict:
    """``accelerator.get_state_dict`` once an engine is installed: for a model the engine
    trains, with ``save_dtype=fp32``, the fp32 master weights on the saving rank(s) and None
    on the others (accelerate's ``save_model`` then writes nothing there, and ``save_state``
    writes only on the saving ranks anyway); every rank must call it, as it must for
    ``save_model`` and ``save_state``. With tensor parallelism, ``save_dtype=compute`` too
    gives the model's tensors gathered whole. Other models and ``save_dtype=compute``:
    accelerate's."""

    def __init__(self, accelerator, engine, own):
        self.accelerator, self.engine, self.own = accelerator, engine, own

    def __call__(self, model, unwrap=True):
        acc = self.accelerator
        inner = acc.unwrap_model(model)
        if not trains(inner, self.engine) or (self.engine.plugin.save_dtype != "fp32"
                                              and not tensor_parallel(self.engine)):
            return self.own(model, unwrap=unwrap)
        each_node = acc.project_configuration.save_on_each_node
        saves = acc.is_main_process or (each_node and acc.is_local_main_process)
        return saved_state_dict(self.engine, inner, saves_here=saves)
