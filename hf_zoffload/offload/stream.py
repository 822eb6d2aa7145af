"""Moving bucket data between the device and the host.

`CudaTransport` overlaps copies with compute on a side stream; `HostTransport` is the same
interface for parameters that live on the CPU (no streams, no pinning), which is how the
engine runs on a machine without a GPU and in the test suite.

The engine drives a bucket through:
  collect_buffer -> (grads copied in by hooks) -> send -> wait_grads -> CPU-Adam -> upload
and calls `finish_uploads` once per step.
"""

from __future__ import annotations

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

    def collect_buffer(self, bucket: Bucket) -> torch.Tensor:
        # Hooks write straight into the host grad buffer: there is nothing to copy later.
        # Zeroed because params that get no grad in this backward keep their slot.
        return bucket.grad_host.zero_()

    def send(self, bucket: Bucket, buf: torch.Tensor) -> None:
        pass

    def wait_grads(self, bucket: Bucket) -> None:
        pass

    def staging(self, bucket: Bucket) -> torch.Tensor | None:
        # The CPU-Adam writes the new 16-bit params directly into the params' storage,
        # unless a staging buffer exists (the delayed update must not write params that
        # the next forward is reading).
        if bucket.param_host is not None:
            return bucket.param_host
        return bucket.params if bucket.params.dtype != torch.float32 else None

    def wait_staging(self, bucket: Bucket) -> None:
        pass

    def upload(self, bucket: Bucket) -> None:
        if bucket.param_host is not None:
            bucket.params.copy_(bucket.param_host)
        elif bucket.params.dtype == torch.float32:
            bucket.params.copy_(bucket.master)

    def finish_uploads(self) -> float:
        return 0.0


class CudaTransport:
    """Parameters on a CUDA device; copies run on one side stream, ordered by events."""

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
        return torch.zeros(bucket.numel, dtype=bucket.params.dtype, device=self.device)

    def send(self, bucket: Bucket, buf: torch.Tensor) -> None:
        # The side stream must not read `buf` before the compute stream has finished
        # writing it (the hooks' copies and the check kernel run on the compute stream).
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            bucket.grad_host.copy_(buf, non_blocking=self.pinned)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        # `buf` is freed by the engine right after this call; record_stream keeps the
        # caching allocator from handing its memory out again before the copy is done.
        buf.record_stream(self.stream)
        self._grad_done[bucket.index] = ev

    def wait_grads(self, bucket: Bucket) -> None:
        # The CPU reads grad_host next: wait until that bucket's copy has landed.
        ev = self._grad_done.pop(bucket.index, None)
        if ev is not None:
            ev.synchronize()

    def staging(self, bucket: Bucket) -> torch.Tensor | None:
        return bucket.param_host

    def wait_staging(self, bucket: Bucket) -> None:
        # The CPU-Adam is about to overwrite param_host: last step's upload of this
        # bucket must have finished reading it.
        ev = self._upload_done.pop(bucket.index, None)
        if ev is not None:
            ev.synchronize()

    def upload(self, bucket: Bucket) -> None:
        src = bucket.param_host if bucket.param_host is not None else bucket.master
        # The previous forward/backward may still be reading the params on the compute
        # stream (the host runs ahead): the side stream waits for it before writing.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            bucket.params.copy_(src, non_blocking=self.pinned and src is bucket.param_host)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._upload_done[bucket.index] = ev

    def finish_uploads(self) -> float:
        """Make the next forward wait for the new params, without a host sync; returns the
        host time spent (0 here: the wait is queued on the device)."""
        t0 = time.perf_counter()
        # Compute stream waits for every upload: the next forward must not start before
        # its params have landed. This is a device-side dependency, not a host sync.
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return time.perf_counter() - t0
