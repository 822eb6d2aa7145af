"""Moving bucket data between the device and the host.

`CudaTransport` overlaps copies with compute on a side stream; `HostTransport` is the same
interface for parameters that live on the CPU (no streams, no pinning), which is how the
engine runs on a machine without a GPU and in the test suite.

The engine drives a bucket through:
  collect_buffer -> (grads copied in by hooks) -> send -> wait_grads -> CPU-Adam -> upload
and calls `finish_uploads` once per step. `upload` writes each param's own storage (one copy
per param: params are not views of a flat buffer, see buckets.py). With data parallelism
(partition.py) the reduced shard reaches the host through `complete_collective` instead of
`send`, and `upload(bucket, dst)` writes this rank's shard into a transient flat buffer that
an all-gather completes and `DataParallel.wait_all` copies out to the params.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from .buckets import Bucket

logger = logging.getLogger(__name__)


def host_empty(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A host buffer, page-locked when ``pin`` (needed for truly async copies)."""
    if pin:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:  # e.g. RLIMIT_MEMLOCK in containers
            if not getattr(host_empty, "_warned", False):
                host_empty._warned = True
                logger.warning("pinning host memory failed (%s); using pageable memory, "
                               "device<->host copies will not overlap compute", exc)
    return torch.empty(numel, dtype=dtype)


class HostTransport:
    """Parameters on the CPU: the "device" buffers are host memory already."""

    pinned = False
    # gloo runs a collective on its own thread and only `wait()` blocks: the engine waits
    # as late as possible, so the reduce-scatters overlap the rest of backward.
    defers_collectives = True

    def collect_buffer(self, bucket: Bucket) -> torch.Tensor:
        # Hooks write straight into the host grad buffer: there is nothing to copy later.
        # Zeroed because params that get no grad in this backward keep their slot.
        return bucket.grad_host.zero_()

    def mirror(self, host: torch.Tensor, *, zero: bool) -> torch.Tensor:
        """The "device" twin of a host buffer: the buffer itself (nothing to copy)."""
        return host.zero_() if zero else host

    def collect_full(self, bucket: Bucket) -> torch.Tensor:
        # Data parallel: the whole (padded) bucket is reduce-scattered from here, or kept
        # as an unreduced micro-step (it is then the host copy too: nothing to send).
        if bucket.local_host is None:
            bucket.local_host = torch.empty(bucket.padded, dtype=bucket.dtype)
        return bucket.local_host.zero_()

    def send(self, bucket: Bucket, buf: torch.Tensor, host: torch.Tensor | None = None) -> None:
        pass

    def prefill(self, bucket: Bucket, host32: torch.Tensor) -> torch.Tensor:
        return host32  # hooks add into the host sum directly

    def complete_collective(self, bucket, work, inp, out, host, check) -> None:
        work.wait()
        check(out)

    def side(self):
        return contextlib.nullcontext()

    def wait_grads(self, bucket: Bucket) -> None:
        pass

    def staging(self, bucket: Bucket) -> torch.Tensor | None:
        # A staging buffer exists only for the delayed update (it must not write params
        # that the next forward is reading); see `in_place` for the usual case.
        return bucket.param_host

    def in_place(self, bucket: Bucket) -> bool:
        """Whether the CPU-Adam writes the new 16-bit values straight into the params'
        storage (the engine then calls it per param): no staging buffer and no copy."""
        return bucket.param_host is None and bucket.dtype != torch.float32

    def wait_staging(self, bucket: Bucket) -> None:
        pass

    def upload(self, bucket: Bucket, dst: torch.Tensor | None = None) -> None:
        """New params -> the params, or with ``dst`` -> this rank's shard of a flat gather
        buffer (data parallel; all of ``dst`` is written, padding as zeros)."""
        src = bucket.param_host if bucket.param_host is not None else \
            bucket.master if bucket.dtype == torch.float32 else None
        if dst is None:
            if src is not None:  # else the CPU-Adam wrote the params in place already
                bucket.copy_to_params(src, bucket.start)
        elif src is not None:
            dst.copy_(src)
        else:  # the params hold this rank's new values already (written in place)
            dst.zero_()
            bucket.copy_from_params(dst, bucket.start)

    def gather_buffer(self, bucket: Bucket) -> torch.Tensor:
        return torch.empty(bucket.padded, dtype=bucket.dtype)

    def finish_uploads(self) -> float:
        return 0.0


class CudaTransport:
    """Parameters on a CUDA device; copies run on one side stream, ordered by events."""

    # NCCL's wait() only orders streams; issuing it at once costs the host nothing.
    defers_collectives = False

    def __init__(self, device: torch.device, *, pin: bool):
        self.device = device
        self.pinned = pin
        self.stream = torch.cuda.Stream(device=device)
        self._grad_done: dict[int, torch.cuda.Event] = {}
        self._upload_done: dict[int, torch.cuda.Event] = {}

    def collect_buffer(self, bucket: Bucket) -> torch.Tensor:
        # A fresh buffer from the caching allocator per backward: only buckets still
        # collecting or in flight hold device memory (not a full gradient copy). Zeroed
        # because params that get no grad keep their slot.
        return torch.zeros(bucket.numel, dtype=bucket.dtype, device=self.device)

    def mirror(self, host: torch.Tensor, *, zero: bool) -> torch.Tensor:
        make = torch.zeros if zero else torch.empty
        return make(host.numel(), dtype=host.dtype, device=self.device)

    def collect_full(self, bucket: Bucket) -> torch.Tensor:
        return torch.zeros(bucket.padded, dtype=bucket.dtype, device=self.device)

    def send(self, bucket: Bucket, buf: torch.Tensor, host: torch.Tensor | None = None) -> None:
        # The side stream must not read `buf` before the compute stream has finished
        # writing it (the hooks' copies and the check kernel run on the compute stream).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            (bucket.grad_host if host is None else host).copy_(buf, non_blocking=self.pinned)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        # `buf` is freed by the engine right after this call; record_stream keeps the
        # caching allocator from handing its memory out again before the copy is done.
        buf.record_stream(self.stream)
        self._grad_done[bucket.index] = ev

    def prefill(self, bucket: Bucket, host32: torch.Tensor) -> torch.Tensor:
        """A device copy of an fp32 host sum that this backward's grads are added to."""
        buf = torch.empty(host32.numel(), dtype=torch.float32, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            buf.copy_(host32, non_blocking=self.pinned)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        buf.record_stream(self.stream)
        # The hooks add into `buf` on the compute stream: only after it has landed.
        torch.cuda.current_stream(self.device).wait_event(ev)
        return buf

    def complete_collective(self, bucket, work, inp, out, host, check) -> None:
        """After a reduce-scatter into `out`: check it and copy it to `host`, all queued on
        the side stream, so neither the host nor the rest of backward waits for it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            work.wait()  # the side stream (not the host) waits for the collective
            check(out)
            host.copy_(out, non_blocking=self.pinned)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        # The engine drops its references now; the allocator must not reuse the memory
        # before the side stream is past the copy (and so past the collective).
        inp.record_stream(self.stream)
        out.record_stream(self.stream)
        self._grad_done[bucket.index] = ev

    def side(self):
        """Collectives issued here queue behind the uploads on the side stream."""
        return torch.cuda.stream(self.stream)

    def wait_grads(self, bucket: Bucket) -> None:
        # The CPU reads grad_host next: wait until that bucket's copy has landed.
        ev = self._grad_done.pop(bucket.index, None)
        if ev is not None:
            ev.synchronize()

    def staging(self, bucket: Bucket) -> torch.Tensor | None:
        return bucket.param_host

    def in_place(self, bucket: Bucket) -> bool:
        return False  # the params are on the device: the CPU-Adam writes host staging

    def wait_staging(self, bucket: Bucket) -> None:
        # The CPU-Adam is about to overwrite param_host: last step's upload of this
        # bucket must have finished reading it.
        ev = self._upload_done.pop(bucket.index, None)
        if ev is not None:
            ev.synchronize()

    def upload(self, bucket: Bucket, dst: torch.Tensor | None = None) -> None:
        """New params (16-bit staging, or the fp32 master) -> each param, one copy per
        param; with ``dst`` -> this rank's shard of a flat gather buffer (data parallel)."""
        src = bucket.param_host if bucket.param_host is not None else bucket.master
        nb = self.pinned and src is bucket.param_host  # master is pageable: a blocking copy
        # The previous forward/backward may still be reading the params on the compute
        # stream (the host runs ahead): the side stream waits for it before writing. The
        # same wait orders a `dst` the compute stream allocated before its first use here.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if dst is None:
                bucket.copy_to_params(src, bucket.start, non_blocking=nb)
            else:
                dst.copy_(src, non_blocking=nb)
            # One event after all of the bucket's copies: wait_staging needs them all done.
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._upload_done[bucket.index] = ev

    def gather_buffer(self, bucket: Bucket) -> torch.Tensor:
        """A transient flat bucket for the all-gather, from the caching allocator on the
        compute stream. Only the side stream (and NCCL, ordered by the side stream's
        `work.wait()`) uses it: record_stream keeps the allocator from handing the memory
        out again before the side stream is past the copy-out, whenever the engine drops it."""
        buf = torch.empty(bucket.padded, dtype=bucket.dtype, device=self.device)
        buf.record_stream(self.stream)
        return buf

    def finish_uploads(self) -> float:
        """Make the next forward wait for the new params, without a host sync; returns the
        host time spent (0 here: the wait is queued on the device)."""
        t0 = time.perf_counter()
        # Compute stream waits for every upload: the next forward must not start before
        # its params have landed. This is a device-side dependency, not a host sync.
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return time.perf_counter() - t0
