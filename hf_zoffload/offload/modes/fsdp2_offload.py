"""FSDP2 parameter offload (``fully_shard`` with ``CPUOffloadPolicy``) with our CPU step.

FSDP2 moves the params: each forward and backward it copies a layer's sharded host params to
the device and all-gathers them, and after backward it reduce-scatters the gradients and
leaves each rank's sharded gradient on the host as the sharded param's ``.grad``, then calls
the param's post-accumulate-grad hooks. The engine is the optimizer: its hook takes that
gradient into the bucket's landing buffer (as with one process: the gradient is already
reduced), the step's one all-reduce spans the shard ranks, and the CPU-Adam writes the new
values in place into FSDP2's sharded host params, which FSDP2 brings up at the next forward.

`Fsdp2Exchange` is the one-process exchange (the gradient is reduced already) holding the
span of FSDP2's 1-D shard mesh (mesh.py: the shards are DTensor ``Shard(0)`` local tensors,
so the norm, the checkpoints' whole tensors and a load's local part are tensor parallelism's
protocol), plus what FSDP2 needs: after the engine gave each param its compute-dtype local
tensor, FSDP2 re-reads it (as ``FSDPModule.to`` does), so that its sharded host param IS the
engine's 16-bit copy and FSDP2 moves 16-bit both ways. resolve.py chooses it when ``model``
holds FSDP2 modules, after `sharded_params` has refused, before anything changes, the FSDP2
layouts it cannot train. The protocol: docs/protocols/exchange_fsdp2.md; the measured facts
behind it: docs/measurements.md, "Protocol figures".

FSDP2 keeps its per-param records (``FSDPParam``) in private attributes of its module state;
they are read here only, in one place (`fsdp2_param_groups`), in both of torch's layouts: 2.11's
``FSDPState._fsdp_param_group`` (one group or None) and 2.13's ``_fsdp_param_groups`` (a list,
with per-param meshes; 2.13 keeps the singular as a property that raises beside several groups).

[Note: FSDP2's grad copy to the host]: with CPU offload and pinned memory, FSDP2's reduce-scatter
copies each rank's reduced gradient shard to the host and then calls the sharded param's
post-accumulate-grad hooks, where the engine reads ``.grad``. torch 2.11 makes that copy
non-blocking (it records ``FSDPParam.grad_offload_event`` on the copy's stream) and waits for
the event only in ``finalize_backward``, after the hooks: a hook that reads at once reads pages
still being written. torch 2.13 copies synchronously when the param has such a hook (no event).
So the engine's hook first waits for the param's event when FSDP2 recorded one
(`Fsdp2Exchange.wait_for_grad`): on 2.11 one host wait per param, as in FSDP2's own
``finalize_backward``, a no-op where the copy was synchronous.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from .collectives import Collectives
from .exchange import LocalExchange
from .mesh import MeshSpan


def fsdp2_states(model: torch.nn.Module | None) -> list:
    """The FSDP2 states of ``model``'s ``fully_shard`` modules, outermost first."""
    if model is None:
        return []
    return [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp2_param_groups(state) -> list:
    """The ``FSDPParamGroup``s of one FSDP2 module ``state`` (module docstring: torch 2.13's
    list, else 2.11's one group or None)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def fsdp2_params(states: list) -> dict:
    """id(sharded param) -> its ``FSDPParam``, over ``states``' param groups."""
    return {id(fp.sharded_param): fp for st in states for pg in fsdp2_param_groups(st)
            for fp in pg.fsdp_params}


class Fsdp2Exchange(LocalExchange):
    """The exchange for FSDP2's sharded host params (``fsdp_params``: their ``FSDPParam``s)
    over ``mesh``, its 1-D shard mesh; the step's all-reduce runs on the mesh's device."""

    params_on_host = True  # FSDP2's sharded params are the host's 16-bit copy

    def __init__(self, copier, *, mesh, fsdp_params: list):
        coll = Collectives(mesh.get_group(), device=torch.device(mesh.device_type))
        super().__init__(copier, span=MeshSpan(mesh, tp=mesh.size(), coll=coll))
        self.fsdp_params = fsdp_params
        self._note_params()

    def _note_params(self) -> None:
        self._fsdp_param_of = {id(fp.sharded_param): fp for fp in self.fsdp_params}

    def params_recast(self) -> None:
        """FSDP2 re-reads each param's local tensor (`state.state_from_params` gave it a new
        one in the compute dtype): its all-gather input, padded where the shard is short, which the
        param's local tensor then views. FSDP2's lazy init, at the first forward, takes the
        new dtype as the param's own, so it moves 16-bit params up and 16-bit gradients
        down (`sharded_params` refused an FSDP2 that had run a forward already)."""
        with torch.no_grad():
            for fp in self.fsdp_params:
                fp.reset_sharded_param()
        self._note_params()  # reset_sharded_param follows a param the module swapped

    def wait_for_grad(self, param) -> None:
        """See [Note: FSDP2's grad copy to the host]."""
        event = getattr(self._fsdp_param_of.get(id(param)), "grad_offload_event", None)
        if event is not None:
            event.synchronize()
        super().wait_for_grad(param)


def _why_not(states, found, slots, *, process_group, dtype) -> str | None:
    if any(st._is_root is not None for st in states):  # first: the root's params are
        # unsharded after a forward, and model.parameters() gives those
        return ("FSDP2 has run a forward already (its lazy init is done): build the "
                "optimizer after fully_shard and before the first forward")
    if process_group is not None:
        return ("process_group= was given; with FSDP2 the shard mesh of fully_shard is the "
                "group (pass none)")
    for s in slots:
        fp = found.get(id(s.param))
        if fp is None:
            return (f"param {s.index} is trainable but not sharded by fully_shard: apply "
                    "fully_shard to the root module too, so that FSDP2 reduces every gradient")
        if not fp.offload_to_cpu:
            return ("FSDP2 without CPU offload (fully_shard(..., offload_policy="
                    "CPUOffloadPolicy()) keeps the sharded params on the host, where the "
                    "CPU-Adam writes them; without it use ZeRO-Offload without FSDP)")
        if s.param.device_mesh.ndim != 1:
            return "FSDP2 on a 2-D mesh (HSDP); only a 1-D shard mesh is supported"
        want = fp.mp_policy.param_dtype
        if want is not None and want != dtype:
            return (f"FSDP2's MixedPrecisionPolicy(param_dtype={want}) differs from the "
                    f"compute dtype {dtype}: leave param_dtype unset (the engine casts the "
                    "sharded params to the compute dtype) or set it to the compute dtype")
    return None


def sharded_params(states, slots, *, process_group, dtype) -> list:
    """The ``FSDPParam`` of each of ``slots``' params (``states``: `fsdp2_states`). Refuses an
    FSDP2 layout the engine cannot train (no CPU offload, HSDP, a trainable param FSDP2 does
    not shard, a forward already run, a MixedPrecisionPolicy param dtype other than the
    compute dtype) before anything changes."""
    found = fsdp2_params(states)
    why = _why_not(states, found, slots, process_group=process_group, dtype=dtype)
    if why:
        raise ValueError(f"ZeRO-Offload with FSDP2: {why}")
    return [found[id(s.param)] for s in slots]
