"""Data-parallel ZeRO-Offload: each rank owns 1/N of every bucket's host state (ZeRO-2).

Layout. A bucket's flat range is padded to a multiple of the world size N and cut into N
contiguous shards of ``shard = padded / N`` elements; rank r owns ``[r * shard, (r+1) * shard)``.
Its host holds the master weights, both moments and the staging buffers of that shard only:
12/N B/param of optimizer state instead of 12. The padding (< N elements per bucket) belongs
to no param: it stays 0 and no update touches it.

A step, on every rank, always in bucket index order (collectives pair up by their order on
each rank, not by name: a rank whose bucket 2 completes before bucket 1 holds it back):

  backward  a complete bucket is reduce-scattered (ReduceOp.AVG) asynchronously while the
            rest of backward runs; the rank's averaged shard is checked (inf/nan flag, sum
            of squares) and copied to the host: 2/N B/param down instead of 2
  step      ONE small all-reduce (SUM, float64) of [overflow flag, sum of squares, one
            "got a gradient" count per param]; CPU-Adam on the shard; upload of the new
            16-bit shard into a transient flat bucket; an all-gather of it, copied out to
            the params (each has its own storage)

Bytes each rank sends per step, ring algorithms, 16-bit: (N-1)/N x (2 + 2) B/param. gloo's
reduce-scatter runs an all-reduce underneath and sends twice the ring's share: 3.0 B/param
in all at N = 2, 4.0 at N = 3, measured (scripts/bench_offload.py --world_size N).

AVG rather than SUM with 1/N folded into the CPU-Adam's grad_scale: NCCL implements AVG on
floats as a multiply by 1/N before the sum, so an fp16 sum of N loss-scaled grads cannot
overflow where their mean would not; the check then sees the very gradient the update uses
(no 1/N^2 correction of the norm) and there is no extra pass. gloo in torch 2.13 does AVG
for fp32/fp16/bf16 (checked with two processes).

Accumulation, checkpoints and failures: `PartitionedGrads`, the engine's data-parallel half.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from . import checkpoint
from .stream import host_empty

_TIMEOUT_HINT = (
    "A collective waits at most the process group's timeout, set by "
    "torch.distributed.init_process_group(timeout=timedelta(...)), by accelerate's "
    "InitProcessGroupKwargs(timeout=...) kwargs handler, or by the Trainer's --ddp_timeout "
    "(seconds).")

# torch 2.13 renamed these (the old names warn); keep working on versions before the rename.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _why_unsupported(p: torch.Tensor) -> str | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        DTensor = ()
    if isinstance(p, DTensor):
        return ("tensor parallelism or FSDP2 (the param is a DTensor, as with transformers' "
                "tp_plan / tp_size or torch's fully_shard)")
    if getattr(p, "_is_flat_param", False):
        return "FSDP (the param is an FSDP FlatParameter)"
    return None


def check_params(params) -> None:
    """Raise before anything changes if a param is sharded by another form of parallelism."""
    for i, p in enumerate(params):
        why = _why_unsupported(p)
        if why:
            raise ValueError(f"param {i}: ZeRO-Offload with {why} is not supported yet; "
                             "use plain data parallelism (no model wrapper) or one process")


def check_model(model: torch.nn.Module) -> None:
    """For the integrations: the model must reach the engine unwrapped and unsharded.

    The engine averages gradients itself; DistributedDataParallel around the model would
    all-reduce them a second time and keep a full gradient copy on the device."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError("ZeRO-Offload averages gradients itself: do not wrap the model in "
                         "DistributedDataParallel (prepare it without DDP)")
    if type(model).__name__ in ("FullyShardedDataParallel", "FSDPModule") or any(
            type(m).__name__.startswith("FSDP") for m in model.modules()):
        raise ValueError("ZeRO-Offload with FSDP is not supported yet")
    for attr in ("tp_size", "fsdp_size"):
        if (getattr(model, attr, None) or 1) > 1:
            raise ValueError(f"ZeRO-Offload with a model loaded with {attr}="
                             f"{getattr(model, attr)} is not supported yet")
    check_params(model.parameters())


def _accelerate_sync() -> bool | None:
    """accelerate's GradientState.sync_gradients when accelerate holds a state, else None.

    Read without constructing GradientState(): that would create the shared state."""
    try:
        from accelerate.state import GradientState
    except ImportError:
        return None
    shared = GradientState._shared_state
    return bool(shared.get("sync_gradients", True)) if shared else None


def wants_sync(opt) -> bool:
    """Whether the backward that is starting ends an accumulation window (reduces grads).

    ``opt.sync_gradients`` (True/False, or None for automatic; ``opt.no_sync()`` sets False)
    wins; else accelerate's ``GradientState().sync_gradients``, which ``accelerator.accumulate``
    and the Trainer set on every micro-step; else True."""
    if opt.sync_gradients is not None:
        return bool(opt.sync_gradients)
    acc = _accelerate_sync()
    return True if acc is None else acc


class DataParallel:
    """The engine's collectives over one process group, in a fixed order on every rank.

    ``sent`` counts the bytes handed to each kind of collective (input tensors), by kind;
    scripts/bench_offload.py compares them with the bytes that reach the sockets."""

    def __init__(self, group, *, device: torch.device, transport):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device  # collectives run on the params' device: gloo cpu, nccl cuda
        self.transport = transport
        self.sent = dict.fromkeys(("reduce_scatter", "all_gather", "all_reduce", "gather"), 0)
        self._ready: dict[int, tuple] = {}
        self._next = 0
        self._inflight: list[tuple] = []

    @classmethod
    def create(cls, process_group, *, device: torch.device, transport):
        """None in one process; a process group given explicitly is used even with one rank
        (that runs the partitioned code path, which tests use)."""
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
        return cls(process_group, device=device, transport=transport)

    def assign(self, b) -> None:
        """This rank's shard of bucket ``b`` (see the module docstring)."""
        b.shard = -(-b.numel // self.world)
        b.padded = b.shard * self.world
        b.start = self.rank * b.shard
        b.lo, b.hi = min(b.start, b.numel), min(b.start + b.shard, b.numel)

    def broadcast_bucket(self, b) -> torch.Tensor:
        """Bucket ``b``'s params as rank 0 has them, flat fp32 (exact for fp32/bf16/fp16
        params): every rank starts from the same values, as DDP makes sure. Frozen params
        and buffers are left to the caller."""
        flat = torch.zeros(b.padded, dtype=torch.float32, device=self.device)
        for s in b.slots:
            flat[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        with self._guard(f"broadcast of bucket {b.index}'s initial params"):
            dist.broadcast(flat, src=dist.get_global_rank(self.group, 0), group=self.group)
        return flat

    @contextlib.contextmanager
    def _guard(self, what: str):
        try:
            yield
        except RuntimeError as exc:  # DistBackendError and gloo's errors derive from it
            raise RuntimeError(
                f"ZeRO-Offload rank {self.rank} of {self.world}: {what} failed "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); another rank "
                f"probably exited or stopped. {_TIMEOUT_HINT}") from exc

    # ------------------------------------------------------- gradient reduction
    def begin_round(self) -> None:
        """A reduction round starts: every bucket is submitted once, launched in order."""
        if self._ready:
            raise RuntimeError("internal: a reduction round started before the last ended")
        self._next = 0

    def submit(self, b, pending: torch.Tensor, landing: torch.Tensor, check) -> None:
        """Reduce-scatter ``pending`` (the full bucket) into ``landing`` (the host shard),
        as soon as every bucket with a lower index has been launched."""
        self._ready[b.index] = (b, pending, landing, check)
        while self._next in self._ready:
            self._launch(*self._ready.pop(self._next))
            self._next += 1

    def _launch(self, b, pending, landing, check) -> None:
        out = self.transport.mirror(landing, zero=False)
        with self._guard(f"reduce-scatter of bucket {b.index}"):
            work = _reduce_scatter(out, pending, op=dist.ReduceOp.AVG, group=self.group,
                                   async_op=True)
        self.sent["reduce_scatter"] += pending.numel() * pending.element_size()
        item = (b, work, pending, out, landing, check)
        if self.transport.defers_collectives:
            self._inflight.append(item)
        else:
            self._complete(item)

    def _complete(self, item) -> None:
        b, work, pending, out, landing, check = item
        with self._guard(f"reduce-scatter of bucket {b.index}"):
            self.transport.complete_collective(b, work, pending, out, landing, check)

    def complete(self, b=None) -> None:
        """Finish the deferred reductions of bucket ``b`` (of all buckets when None)."""
        keep = []
        for item in self._inflight:
            if b is None or item[0] is b:
                self._complete(item)
            else:
                keep.append(item)
        self._inflight = keep

    # ------------------------------------------------------------------ step
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """The step's one small collective; float64 keeps the counts and the sum exact."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with self._guard("all-reduce of the overflow flag and gradient norm"):
            dist.all_reduce(t, group=self.group)
        self.sent["all_reduce"] += t.numel() * t.element_size()
        return t.tolist()

    def all_gather(self, b, gathers: list) -> None:
        """Start gathering bucket ``b``'s new params into ``gathers``: this rank's new shard
        is uploaded into its slice of a transient flat device buffer, which the all-gather
        (in place) fills from every rank; `wait_all` copies it out to the params. Transient
        because each param keeps its own storage (buckets.py). At most two gathers stay in
        flight (the transient buffers then cost about two buckets, not a copy of the model):
        on CUDA finishing one only queues work on the side stream; with gloo it still
        overlaps the CPU-Adam of the next bucket."""
        flat = self.transport.gather_buffer(b)
        own = flat[b.start:b.start + b.shard]
        self.transport.upload(b, own)  # the whole shard, padding included
        with self.transport.side(), self._guard(f"all-gather of bucket {b.index}"):
            work = _all_gather(flat, own, group=self.group, async_op=True)
        self.sent["all_gather"] += own.numel() * own.element_size()
        gathers.append((b, work, flat))
        if len(gathers) > 2:
            self.wait_all([gathers.pop(0)])

    def wait_all(self, gathers) -> None:
        """Finish the all-gathers and copy every slot out of its flat buffer to its param.
        On CUDA all of it queues on the side stream: `wait()` makes that stream wait for the
        collective, so the buffer is complete before the copies read it. Every slot is
        copied, also those that got no grad: each rank's shard came from the staging copy
        (or master) that mirrors the params, so those params get their own values back."""
        with self.transport.side(), self._guard("all-gather of the updated params"):
            for b, work, flat in gathers:
                work.wait()
                b.copy_to_params(flat, 0)

    # ------------------------------------------------------------ checkpoints
    def gather_state(self, b, *, to: int) -> torch.Tensor | None:
        """[master, exp_avg, exp_avg_sq] of the whole (padded) bucket on rank ``to``, as a
        CPU [3, padded] tensor; None on the other ranks. One bucket at a time, so the extra
        memory is 12 B x one bucket (on the device with NCCL)."""
        local = torch.stack([b.master, b.exp_avg, b.exp_avg_sq]).to(self.device)
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == to else None
        with self._guard(f"gather of bucket {b.index}'s optimizer state to rank {to}"):
            dist.gather(local, parts, dst=dist.get_global_rank(self.group, to), group=self.group)
        self.sent["gather"] += local.numel() * local.element_size()
        return torch.cat(parts, dim=1).cpu() if parts is not None else None


class PartitionedGrads:
    """The data-parallel half of `ZeroOffloadOptimizer` (a mixin over the engine's state).

    Every rank builds the engine over the same params, on a model with no DDP wrapper
    (`check_model`), and must run the same sequence of backward / step / state_dict calls:
    the collectives pair up by their order.

    The accumulation boundary. A backward reduces gradients across ranks only when
    ``sync_gradients`` says so: the engine's attribute if set (True/False; ``with
    optimizer.no_sync():`` sets False), else accelerate's ``GradientState().sync_gradients``
    when accelerate holds a state (``accelerator.accumulate`` and the Trainer set it for
    every micro-step), else True. The flag decides when bytes move, never the result: any
    mix of synchronized and unsynchronized backwards gives the same gradient, and ``step()``
    reduces whatever is still unreduced.

    Where unreduced micro-steps accumulate: a backward without sync copies each bucket's
    full, unreduced grads to the host (2 B/param, as one process does) and they are summed
    there in fp32; the next synchronizing backward (or ``step()``) starts each bucket from
    that sum (uploaded, 4 B/param), adds its own grads and reduce-scatters in fp32. Host
    cost per rank: the full-bucket compute-dtype landing buffer plus the fp32 sum, 6 B/param
    with 16-bit compute, not divided by N, allocated only once accumulation is used. Why: the
    device keeps only its 16-bit params and the buckets in flight (an fp32 sum there would
    take 4 B/param of the memory ZeRO-Offload frees), and the sum is never rounded to 16
    bits, as with one process. The one fp32 reduction per window hands 4 B/param to the
    collective instead of 2 B/param per micro-step.

    Checkpoints: ``state_dict()`` is a collective (every rank calls it, as accelerate's
    ``save_state`` does); rank 0 gets the whole state in the one-process format, the others
    a shell that refuses to load. Where only rank 0 calls ``state_dict()`` (the Trainer),
    call ``consolidate_state_dict()`` on every rank first. ``load_state_dict()`` takes the
    whole state on every rank, saved with any number of ranks, and keeps its shard.

    Failures: a collective whose peer died raises at once (gloo sees the socket close) or,
    with a peer alive but stuck, after the process group's ``timeout``; the error names
    this rank, the collective and where the timeout is set. NCCL's watchdog aborts the
    process after the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING, on by default).
    """

    def _init_dp(self, process_group) -> None:
        self.dp = DataParallel.create(process_group, device=self.device, transport=self.transport)
        self.sync_gradients: bool | None = None  # None: follow accelerate, else True
        self._sync, self._unsynced, self._round = True, False, 0
        self._consolidated = None

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside reduce no gradients across ranks (micro-steps before the
        accumulation boundary); nothing changes with one process."""
        before, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = before

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the state onto rank ``to``, a collective: every rank calls it. Then
        ``state_dict()`` on rank ``to`` alone returns it, once, until the next step."""
        self._drain()
        self._consolidated = checkpoint.state_dict(self, to=to) if self.dp is not None else None

    # ------------------------------------------------------------- backward
    def _begin_backward_dp(self) -> None:
        self._sync = wants_sync(self)  # one decision per backward
        if self._sync:
            self._begin_round()
        else:
            self._unsynced = True

    def _begin_round(self) -> None:
        self._round += 1
        self.dp.begin_round()

    def _open_dp(self, b) -> None:
        self.dp.complete(b)  # this bucket's last reduction no longer reads its buffers
        self.transport.wait_grads(b)
        if b.local:  # fold the unreduced micro-steps held on the host into their fp32 sum
            if b.local_acc is None:
                b.local_acc = host_empty(b.padded, torch.float32, pin=self.transport.pinned)
            (b.local_acc.copy_ if b.local == 1 else b.local_acc.add_)(b.local_host)
        if self._sync and b.local:  # this backward's grads are added to the sum, in fp32
            b.pending, b.prefilled, b.local = self.transport.prefill(b, b.local_acc), True, 0
        else:
            b.pending = self.transport.collect_full(b)

    def _flush_dp(self, b) -> None:
        if not self._sync:  # no collective: the full unreduced bucket goes to the host
            if b.local_host is None:  # on the CPU, collect_full made it
                b.local_host = host_empty(b.padded, self.dtype, pin=self.transport.pinned)
            self.transport.send(b, b.pending, b.local_host)
            b.local += 1
            return
        fp32 = b.pending.dtype != self.dtype  # a sum over micro-steps
        if fp32 and b.grad_host32 is None:
            b.grad_host32 = host_empty(b.shard, torch.float32, pin=self.transport.pinned)
        landing = b.grad_host32 if fp32 else b.grad_host
        self._fold(b)  # an earlier reduced micro-step moves into grad_acc first
        self.dp.submit(b, b.pending, landing, self._check)
        b.last, b.sync_round = landing, self._round
        b.flushed += 1

    def _reduce_rest(self) -> None:
        """Submit every bucket not yet reduced in this round, in order: another rank may
        hold grads for a bucket this rank did not touch (zeros from here, then)."""
        for b in self.buckets:
            if b.sync_round != self._round:
                self._open_dp(b)
                self._flush(b)
        self._unsynced = False

    # ------------------------------------------------------------------ step
    def _end_window_dp(self) -> None:
        if self._unsynced:  # the window ended without a synchronizing backward
            self._sync = True
            self._begin_round()
            self._reduce_rest()
        self.dp.complete()

    def _share_stats(self, flag: float, sumsq: float) -> tuple[float, float]:
        """The step's one small collective: the overflow flag and the sum of squares over
        all shards, and which params got a grad on any rank (those step, on every rank)."""
        seen = [float(x) for b in self.buckets for x in b.present]
        flag, sumsq, *seen = self.dp.all_reduce_sum([flag, sumsq, *seen])
        it = iter(seen)
        for b in self.buckets:
            b.present = [next(it) > 0 for _ in b.slots]
        return flag, sumsq
