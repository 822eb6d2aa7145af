"""`state_dict` / `load_state_dict` of the engine, in torch.optim.AdamW's format.

Per-param state uses torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``) plus ``master``, the
fp32 weights (the 16-bit model params alone lose precision), so an AdamW checkpoint loads into
the engine (master taken from the params) and ours into AdamW (``master`` is ignored there).
Everything is plain tensors and numbers: it loads with ``torch.load(weights_only=True)``.
Loading copies into the host buffers, so state stays on the host whatever ``map_location`` put
the tensors on.

With N ranks the format is the same, whole state (gathered onto one rank when saving), so a
checkpoint saved with N ranks loads with any M: each rank copies out its own shard. Chosen
over per-rank shard files because it needs no index, loads into torch's AdamW and into one
process, and costs the saving rank one full copy of the state (16 B/param) at save time.
With tensor parallelism every tensor is the whole param (the shards gathered), so a checkpoint
saved with any tensor-parallel size loads with any other, or with none.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from ..ops.adam_kernels import check_hyper
from ..ops.masters import MASK32, SR_SEED
from .support import is_dtensor

FORMAT_VERSION = 1
_HYPER = ("lr", "betas", "eps", "weight_decay")


def state_dict(opt, *, to: int = 0) -> dict:
    """The whole state; with N ranks a collective that leaves it on rank ``to`` only (the
    other ranks get the same dict with no state, marked so that loading it fails).

    Reads the engine's public facts: ``buckets`` (layout and host state), ``param_steps``,
    ``exchange`` (world, gather, and its span's whole_tensors, keeps_gathered), ``loss_scaler``,
    ``skipped_steps``,
    ``applied_steps``."""
    ex = opt.exchange
    parts = []
    for b in opt.buckets:
        # the whole bucket (of local tensors) on rank `to`, else None
        got = ex.gather(b, [b.state.master_fp32(), *b.state.moments_fp32()], to=to)
        if got is None:
            continue
        got = [t.cpu() for t in got]  # a device bucket's state (offload_fraction) too
        for s in b.layout.slots:
            if opt.param_steps[s.index] == 0:
                continue  # torch keeps no state for a param that never stepped
            sl = slice(s.offset, s.offset + s.numel)
            parts.append((s, [t[sl] for t in got]))  # master, exp_avg, exp_avg_sq
    parts.sort(key=lambda x: x[0].index)  # `whole` is a collective per param: one order
    state, empty_here = {}, not ex.span.keeps_gathered(to)
    for (s, _), (master, exp_avg, exp_avg_sq) in zip(parts, ex.span.whole_tensors(parts)):
        # clone: a view would pickle the whole flat bucket storage with each param
        state[s.index] = {
            "step": torch.tensor(float(opt.param_steps[s.index])),
            "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone(),
            "master": master.clone(),
        }
    if empty_here:
        state = {}
    groups, index = [], 0
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(index, index + len(g["params"])))
        index += len(g["params"])
        groups.append(packed)
    return {
        "state": state,
        "param_groups": groups,
        "zero_offload": {
            "format_version": FORMAT_VERSION,
            "loss_scaler": opt.loss_scaler.state_dict(),
            "skipped_steps": opt.skipped_steps,
            "applied_steps": opt.applied_steps,
            "world_size": ex.world,
            "bucket_order": opt.bucket_order,
            "sr_seed": opt.sr_seed,  # a bf16 master's stochastic rounding: a resume continues
            # the key is part of the saved format: a rank's dict without the state
            **({"shell_of_rank": ex.span.rank} if empty_here else {}),
        },
    }


def master_state_dict(opt, model: torch.nn.Module, *, to: int = 0) -> dict | None:
    """``model.state_dict()`` with each param the engine trains replaced by its fp32 master
    weights (CPU tensors, bit for bit); with N ranks a collective that gathers them onto rank
    ``to`` (the others get None). Entries of params the engine does not train are the
    model's own tensors, detached, in their own dtype (a DTensor's whole tensor: a
    collective over its mesh)."""
    ex, parts = opt.exchange, []
    for b in opt.buckets:
        got = ex.gather(b, [b.state.master_fp32()], to=to)
        if got is not None:
            master = got[0].cpu()  # a device bucket's master too
            parts += [(s, [master[s.offset:s.offset + s.numel]]) for s in b.layout.slots]
    parts.sort(key=lambda x: x[0].index)  # `whole` is a collective per param: one order
    masters = {id(s.param): m for (s, _), (m,) in zip(parts, ex.span.whole_tensors(parts))}
    trained = {id(s.param) for b in opt.buckets for s in b.layout.slots}
    others = {name: t.detach() for name, t in model.state_dict(keep_vars=True).items()
              if id(t) not in trained}
    for name, t in others.items():  # frozen DTensors: every rank of the mesh gathers
        if is_dtensor(t):
            others[name] = t.full_tensor()
    if not ex.span.keeps_gathered(to):
        return None
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        m = masters.get(id(t))
        out[name] = others[name] if m is None else m.clone()  # clone: not a view of a bucket
    if masters and not any(id(t) in masters for t in model.state_dict(keep_vars=True).values()):
        raise ValueError("master_state_dict: none of the optimizer's params belongs to this "
                         "model; pass the model the optimizer was built on (unwrapped)")
    return out


def load_master_state_dict(opt, model: torch.nn.Module, sd: dict) -> None:
    """The inverse of `master_state_dict`: each entry of ``sd`` (names as
    ``model.state_dict()``'s) that is a param the engine trains becomes its master weights,
    in full precision, and the device param its value in the compute dtype; moments and step
    counts stay. Such a param without an entry keeps its master; other entries are the
    caller's (the model loads them). Every rank passes whole tensors and keeps its part, or,
    for a DTensor param, a DTensor laid out as the param (what a DTensor model's
    ``load_state_dict`` hands its hooks once a pre-hook has cut the whole tensors into
    parts, as the integrations' does): its local tensor is this rank's part. Shapes and
    layouts are checked before anything is written."""
    ours = {s.param: (b, s) for b in opt.buckets for s in b.layout.slots}
    todo = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t not in ours or name not in sd or t in todo:
            continue  # not trained here, not given, or a tied param given already
        value = sd[name]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(t.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"master weights for {name!r}: got {got}, the param has shape "
                             f"{tuple(t.shape)}")
        if is_dtensor(value) and not (is_dtensor(t) and value.device_mesh == t.device_mesh
                                      and value.placements == t.placements):
            where = (f"{tuple(t.placements)} on {t.device_mesh}" if is_dtensor(t)
                     else "a plain tensor")
            raise ValueError(f"master weights for {name!r}: a DTensor with placements "
                             f"{tuple(value.placements)} on {value.device_mesh}; the param is "
                             f"{where}: pass the whole tensor")
        todo[t] = value
    for p, value in todo.items():
        b, s = ours[p]
        own, mine = b.layout.owned(s)
        value = value.detach()
        whole = (value.to_local().to("cpu", torch.float32).reshape(-1) if is_dtensor(value)
                 else opt.exchange.span.local_part(s, value.to("cpu", torch.float32)))
        b.state.master[own].copy_(whole[mine])
        s.flat().copy_(whole)  # every rank holds all of its local tensor


def _master_from_param(h, own: slice, value: torch.Tensor) -> None:
    """The master becomes the param's value, unless the param is the master rounded to the
    compute dtype already: then the master is the more precise of the two (the Trainer
    loads fp32 weights before it builds the engine, and resumes from a stock checkpoint)."""
    if value.dtype == torch.float32 or not torch.equal(h.master[own].to(value.dtype), value):
        h.master[own].copy_(value)


class LoadPlan(NamedTuple):
    """What a validated state_dict loads (`plan_load`), for `apply_load`."""

    groups: list[dict]  # the saved param_groups
    params: list[tuple[torch.Tensor, dict]]  # (a param the engine trains, its saved state)
    scaler: dict | None  # the loss scaler's state, when both sides scale
    bucket_order: list[int] | None
    extra: dict  # the saved "zero_offload" entry


def load_state_dict(opt, sd: dict) -> None:
    """Validate everything first (`plan_load`), then copy (`apply_load`); a bad checkpoint
    changes nothing."""
    apply_load(opt, plan_load(opt, sd))


def plan_load(opt, sd: dict) -> LoadPlan:
    """Check ``sd`` against the engine (groups, params, shapes, hyperparameters, the loss
    scaler's state, the bucket order) without changing anything; raises naming what is
    wrong."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("optimizer state_dict must have 'state' and 'param_groups'")
    if "shell_of_rank" in sd.get("zero_offload", {}):
        raise ValueError(
            f"this optimizer state_dict was returned on rank {sd['zero_offload']['shell_of_rank']}"
            " of a data-parallel run and holds no state: save the one rank 0 returns")
    groups = sd["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(groups)} param groups, the optimizer has "
                         f"{len(opt.param_groups)}")
    index_map = {}
    for gi, (saved, ours) in enumerate(zip(groups, opt.param_groups)):
        if len(saved["params"]) != len(ours["params"]):
            raise ValueError(f"param group {gi}: state_dict has {len(saved['params'])} "
                             f"params, the optimizer has {len(ours['params'])}")
        for pos, (saved_id, p) in enumerate(zip(saved["params"], ours["params"])):
            index_map[saved_id] = (gi, pos, p)
    ours_by_param = {s.param: s for b in opt.buckets for s in b.layout.slots}
    plan = []
    for saved_id, st in sd["state"].items():
        if saved_id not in index_map:
            raise ValueError(f"state_dict has state for unknown param id {saved_id!r}")
        gi, pos, p = index_map[saved_id]
        if p not in ours_by_param:
            continue  # frozen here: nothing to restore
        s = ours_by_param[p]
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if key in st and tuple(st[key].shape) != tuple(s.param.shape):
                raise ValueError(
                    f"param group {gi} param {pos}: the state_dict's {key} has shape "
                    f"{tuple(st[key].shape)}, the param {tuple(s.param.shape)}: a checkpoint "
                    "of another model, or of the same model with its params in another order")
        if "step" not in st or "exp_avg" not in st or "exp_avg_sq" not in st:
            raise ValueError(f"param group {gi} param {pos}: state needs step, exp_avg, "
                             "exp_avg_sq")
        plan.append((p, st))
    for gi, saved in enumerate(groups):
        hyper = {k: saved.get(k, opt.param_groups[gi][k]) for k in _HYPER}
        check_hyper(hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"],
                    where=f"state_dict param group {gi}")
        for flag in ("amsgrad", "maximize"):
            if saved.get(flag):
                raise ValueError(f"state_dict param group {gi} has {flag}=True, which the "
                                 "engine does not support")
    extra = sd.get("zero_offload", {})
    scaler_sd = extra.get("loss_scaler") or None  # {}: saved by a disabled scaler
    if scaler_sd is not None and opt.loss_scaler.is_enabled():
        copy.deepcopy(opt.loss_scaler).load_state_dict(scaler_sd)  # raises here, not midway
    else:
        scaler_sd = None

    seed = extra.get("sr_seed", SR_SEED)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MASK32:
        raise ValueError(f"state_dict's zero_offload.sr_seed must be an int in [0, 2**32), "
                         f"got {seed!r}")

    order = extra.get("bucket_order")
    if order is not None and (not isinstance(order, (list, tuple)) or
                              not all(isinstance(i, int) for i in order)):
        raise ValueError("state_dict's zero_offload.bucket_order must be a list of param "
                         f"indices, got {type(order).__name__}")

    return LoadPlan(groups, plan, scaler_sd, order, extra)


def apply_load(opt, lp: LoadPlan) -> None:
    """Copy a validated state into the engine (host state, params, steps, scaler)."""
    groups, extra, scaler_sd = lp.groups, lp.extra, lp.scaler
    if lp.bucket_order is not None:  # the buckets as the saved run had them (reorder.py)
        opt.set_bucket_order(lp.bucket_order)
    for saved, ours in zip(groups, opt.param_groups):
        for k in _HYPER:
            if k in saved:
                ours[k] = tuple(saved[k]) if k == "betas" else saved[k]
    loaded = set()
    ours_by_param = {s.param: (b, s) for b in opt.buckets for s in b.layout.slots}
    for p, st in lp.params:
        b, s = ours_by_param[p]
        own, mine = b.layout.owned(s)  # this rank's part: host slice, slice of the param
        h = b.state
        part = opt.exchange.span.local_part  # a whole tensor's elements of this rank's local one
        h.set_moments(own.start, part(s, st["exp_avg"])[mine], part(s, st["exp_avg_sq"])[mine])
        if "master" in st:
            master = part(s, st["master"])
            h.master[own].copy_(master[mine])
            # the device params follow the master weights (every rank has all of them)
            s.flat().copy_(master)
        else:  # an AdamW checkpoint: the params are the weights
            _master_from_param(h, own, s.flat()[mine])
        opt.param_steps[s.index] = int(float(st["step"]))
        loaded.add(s.index)
    for b in opt.buckets:
        h = b.state
        for s in b.layout.slots:
            if s.index not in loaded:  # no saved state: as if it never stepped
                own, mine = b.layout.owned(s)
                zero = torch.zeros(own.stop - own.start)
                h.set_moments(own.start, zero, zero)
                _master_from_param(h, own, s.flat()[mine])
                opt.param_steps[s.index] = 0
    if scaler_sd is not None:
        opt.loss_scaler.load_state_dict(scaler_sd)
    opt.sr_seed = int(extra.get("sr_seed", SR_SEED))
    opt.skipped_steps = int(extra.get("skipped_steps", 0))
    opt.applied_steps = int(extra.get("applied_steps", 0))
    opt.zero_grad()
