"""The engine's collectives over one process group, and the data-parallel sync decision.

Collectives pair up by their order on each rank, not by name; the exchange (partitioned.py)
issues them in the same order everywhere. Every call is wrapped so that a dead or stuck peer
gives one error naming this rank, the collective and where the timeout is set.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_TIMEOUT_HINT = (
    "A collective waits at most the process group's timeout, set by "
    "torch.distributed.init_process_group(timeout=timedelta(...)), by accelerate's "
    "InitProcessGroupKwargs(timeout=...) kwargs handler, or by the Trainer's --ddp_timeout "
    "(seconds).")

# torch 2.13 renamed these (the old names warn); keep working on versions before the rename.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

try:
    from accelerate.state import GradientState
except ImportError:  # accelerate is optional for a plain loop
    GradientState = None


def accelerate_sync() -> bool | None:
    """accelerate's GradientState.sync_gradients when accelerate holds a state, else None.

    Read without constructing GradientState(): that would create the shared state."""
    if GradientState is None:
        return None
    shared = GradientState._shared_state
    return bool(shared.get("sync_gradients", True)) if shared else None


def wants_sync(flag: bool | None) -> bool:
    """Whether the backward that is starting ends an accumulation window (reduces grads):
    ``flag`` (the engine's ``sync_gradients``: True/False, None for automatic) wins; else
    accelerate's ``GradientState().sync_gradients``, which ``accelerator.accumulate`` and
    the Trainer set on every micro-step; else True."""
    if flag is not None:
        return bool(flag)
    acc = accelerate_sync()
    return True if acc is None else acc


def resolve_group(process_group, device: torch.device):
    """The group to partition over, or None for one process. A group given explicitly is
    used even with one rank (that runs the partitioned path, which tests use)."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        process_group = dist.group.WORLD
    # get_backend() says 'undefined' for a group set up per device type (accelerate
    # launch on CPUs gives 'cpu:gloo'); the config string names each device's backend.
    backend = str(dist.get_backend_config(process_group)
                  if hasattr(dist, "get_backend_config") else dist.get_backend(process_group))
    if device.type == "cpu" and "gloo" not in backend:
        raise ValueError(f"params on the CPU need a process group with the gloo backend, "
                         f"got {backend!r}")
    if device.type == "cuda" and "nccl" not in backend:
        raise ValueError(f"params on CUDA need a process group with the nccl backend, "
                         f"got {backend!r}")
    return process_group


class Collectives:
    """One process group. ``sent`` counts the bytes handed to each kind of collective
    (input tensors); scripts/bench/bench_offload.py compares them with what reaches the sockets."""

    def __init__(self, group, *, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device  # collectives run on the params' device: gloo cpu, nccl cuda
        self.sent = dict.fromkeys(("reduce_scatter", "all_gather", "all_reduce", "gather"), 0)

    @contextlib.contextmanager
    def guard(self, what: str):
        try:
            yield
        except RuntimeError as exc:  # DistBackendError and gloo's errors derive from it
            raise RuntimeError(
                f"ZeRO-Offload rank {self.rank} of {self.world}: {what} failed "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); another rank "
                f"probably exited or stopped. {_TIMEOUT_HINT}") from exc

    def broadcast_from_first(self, t: torch.Tensor, what: str) -> None:
        with self.guard(what):
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)

    def reduce_scatter_avg(self, out: torch.Tensor, inp: torch.Tensor, what: str):
        with self.guard(what):
            work = _reduce_scatter(out, inp, op=dist.ReduceOp.AVG, group=self.group,
                                   async_op=True)
        self.sent["reduce_scatter"] += inp.numel() * inp.element_size()
        return work

    def all_gather(self, flat: torch.Tensor, own: torch.Tensor, what: str):
        with self.guard(what):
            work = _all_gather(flat, own, group=self.group, async_op=True)
        self.sent["all_gather"] += own.numel() * own.element_size()
        return work

    def all_reduce_sum(self, values: list[float], what: str) -> list[float]:
        """float64 keeps counts and sums of squares exact."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with self.guard(what):
            dist.all_reduce(t, group=self.group)
        self.sent["all_reduce"] += t.numel() * t.element_size()
        return t.tolist()

    def gather_to(self, local: torch.Tensor, to: int, what: str) -> list | None:
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == to else None
        with self.guard(what):
            dist.gather(local, parts, dst=dist.get_global_rank(self.group, to), group=self.group)
        self.sent["gather"] += local.numel() * local.element_size()
        return parts
