"""Copies between the device and the host, and the waits that order them. No collective here.

Two interfaces, a docstring per method. `Streams` is the stream-wide part: the side stream
that every copy runs on, the joins of the compute stream onto it, the readiness of a bucket's
params for a forward (`mark_ready` / `wait_ready` / `finish_uploads`). `Transport` is the
per-bucket part, every call keyed by the bucket's index: `wait_landed(key)` before the host
reads what `to_host` wrote, `wait_uploaded(key)` before the host overwrites what
`to_params` / `to_flat` read. `CudaCopier` is both for params on a GPU (one side stream,
ordered by events), `HostCopier` both for params on the CPU (no streams, no pinning), which is
how the engine runs on a machine without a GPU and in the test suite. The stream rules are
stated where each copy is queued (docs/design.md, "Stream rules").

`Copier` is what the engine and its exchanges hold: the streams and each tier's transport
(tiers.py); ``copier.of(bucket)`` is the transport of the bucket's tier. A device bucket's
(``offload_fraction``) is `ResidentTransport`, which copies nothing (docs/design.md, "Device
buckets").
"""

from __future__ import annotations

import abc
import contextlib
import queue
import threading
import time

import torch

from .layout import BucketLayout
from .threads import host_threads
from .tiers import Tier


class Streams(abc.ABC):
    """The stream-wide part of the copies: the side stream, the compute stream's waits on it,
    and which buckets' params a forward may read. What each method promises is what
    `CudaCopier` must do on its streams; `HostCopier` keeps the same promises trivially
    (nothing is ever in flight). docs/design.md, "Stream rules"."""

    pinned = False  # host buffers that copies touch are page-locked

    # -------------------------------------------------- what the engine decides from
    def updates_in_place(self, delayed: bool) -> bool:
        """Whether the CPU-Adam may write the new 16-bit values straight into the params'
        own storage (params in host memory, no delayed update reading them meanwhile):
        then nothing is uploaded."""
        return False

    def forwards_wait(self) -> bool:
        """Whether uploads may still be in flight when a forward starts, so that each
        module must wait for its own buckets (`wait_ready`) before it reads its params:
        the copies are asynchronous."""
        return True

    # --------------------------------------------------------- the side stream
    @abc.abstractmethod
    def side_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A transient device buffer that only side-stream work uses (an all-gather's flat
        bucket); safe to drop once that work is queued."""

    @abc.abstractmethod
    def side(self):
        """A context: work queued inside runs after everything the compute stream queued
        before it, and on the copier's own stream (collectives' waits, check kernels)."""

    @abc.abstractmethod
    def queue_on_side(self, fn) -> None:
        """Queue ``fn`` (copies of device tensors) behind everything on the side stream,
        before anything queued there later; neither the host nor the compute stream waits
        for it (the gpu checks' reads of params after a step, which must not make the
        next forward's waits moot)."""

    @abc.abstractmethod
    def join_side(self) -> None:
        """The compute stream waits for everything queued on the side stream so far (a
        device-side wait, no host sync): before it reads a device buffer that side-stream
        work wrote (a device bucket's reduce-scatter output)."""

    # ------------------------------------------------------------- readiness
    @abc.abstractmethod
    def mark_ready(self, key: int) -> None:
        """Bucket ``key``'s params are all queued: forwards may wait for them."""

    @abc.abstractmethod
    def wait_ready(self, keys) -> None:
        """The compute stream waits for these buckets' params (before a module's forward);
        others may still be uploading."""

    @abc.abstractmethod
    def finish_uploads(self) -> float:
        """The compute stream waits for every upload queued so far; returns the host
        seconds that took (about 0: the wait is queued on the device)."""

    def device_times(self) -> dict[str, float]:
        """Seconds the device spent copying, by direction, since the last call ({} where
        copies are host work, timed by the engine)."""
        return {}


class Transport(abc.ABC):
    """The copies of one tier's buckets, each keyed by its bucket's index (``key``), and the
    waits for them."""

    # ------------------------------------------------------------- buffers
    @abc.abstractmethod
    def device_buffer(self, key: int, numel: int, dtype: torch.dtype, host, *,
                      zero: bool) -> torch.Tensor:
        """A device buffer whose contents will be copied to the host buffer ``host()`` (a
        callable: the host buffer may be made on first use), zeroed if ``zero``."""

    # ------------------------------------------------------- device to host
    @abc.abstractmethod
    def to_host(self, key: int, dst: torch.Tensor, src: torch.Tensor, *keep) -> None:
        """Device ``src`` -> host ``dst``; ``src`` and ``keep`` may be dropped by the
        caller at once. The host reads ``dst`` only after `wait_landed(key)`."""

    @abc.abstractmethod
    def wait_landed(self, key: int) -> None:
        """Block until key's copies to the host and its `after_landed` work are done."""

    @abc.abstractmethod
    def after_landed(self, key: int, fn) -> None:
        """Run host work ``fn`` once key's last copy to the host has landed (the fold of a
        micro-step into the fp32 sum); the next `to_host(key)` and `wait_landed(key)` wait
        for it first."""

    # ------------------------------------------------------- host to device
    @abc.abstractmethod
    def to_device(self, key: int, host: torch.Tensor) -> torch.Tensor:
        """A device copy of ``host`` that the compute stream may add to at once."""

    @abc.abstractmethod
    def to_params(self, key: int, layout: BucketLayout, src: torch.Tensor) -> None:
        """Host ``src`` (a bucket's new values) -> each param's own storage, after the
        compute stream is done reading the old values. The host overwrites ``src`` only
        after `wait_uploaded(key)`."""

    @abc.abstractmethod
    def to_flat(self, key: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host ``src`` -> device ``dst`` (a `Streams.side_buffer`); `wait_uploaded(key)`
        as above."""

    @abc.abstractmethod
    def wait_uploaded(self, key: int) -> None:
        """Block until key's uploads have read their source."""


class HostCopier(Streams, Transport):
    """Params on the CPU: a "device" buffer is host memory already, so the device buffer of
    a host buffer is that buffer, and nothing is ever in flight. Host work (`after_landed`)
    runs at once, on ``threads`` threads."""

    def __init__(self, *, threads: int = 1):
        self.threads = threads

    def updates_in_place(self, delayed: bool) -> bool:
        return not delayed  # a delayed update would write params the next forward reads

    def forwards_wait(self) -> bool:
        return False

    def device_buffer(self, key: int, numel: int, dtype: torch.dtype, host, *,
                      zero: bool) -> torch.Tensor:
        """``host()`` itself: hooks write straight into it, nothing is copied later."""
        buf = host()
        return buf.zero_() if zero else buf

    def side_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def side(self):
        return contextlib.nullcontext()

    def queue_on_side(self, fn) -> None:
        fn()  # nothing is in flight: the reads see the params as the last step left them

    def to_host(self, key: int, dst: torch.Tensor, src: torch.Tensor, *keep) -> None:
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)

    def to_device(self, key: int, host: torch.Tensor) -> torch.Tensor:
        return host

    def wait_landed(self, key: int) -> None:
        pass

    def after_landed(self, key: int, fn) -> None:
        with host_threads(self.threads):
            fn()  # nothing is in flight; the caller's next write may be into fn's input

    def to_params(self, key: int, layout: BucketLayout, src: torch.Tensor) -> None:
        layout.copy_to_params(src, layout.start)

    def to_flat(self, key: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def wait_uploaded(self, key: int) -> None:
        pass

    def mark_ready(self, key: int) -> None:
        pass

    def wait_ready(self, keys) -> None:
        pass

    def finish_uploads(self) -> float:
        return 0.0

    def join_side(self) -> None:
        pass


class _HostWork:
    """One thread that runs host work after a CUDA event, so that the thread queuing it
    (autograd's, in a grad hook) never waits for host arithmetic. Per key, `wait(key)`
    returns once that key's work is done, and raises a failure of it."""

    def __init__(self, device: torch.device, *, threads: int = 1):
        self.device = device
        self.threads = threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending: dict[int, int] = {}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None  # started by the first submit

    def submit(self, key: int, event, fn) -> None:
        if self._thread is None:  # runs without accumulation never need it
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name="zoffload-host-work")
            self._thread.start()
        with self._cv:
            self._pending[key] = self._pending.get(key, 0) + 1
        self._queue.put((key, event, fn))

    def _loop(self) -> None:
        torch.cuda.set_device(self.device)  # event waits on this thread: the params' device
        while True:
            key, event, fn = self._queue.get()
            try:
                if event is not None:
                    event.synchronize()
                with host_threads(self.threads):  # this thread's pool: OMP_NUM_THREADS
                    fn()
            except BaseException as exc:  # raised on the caller at its next wait
                self._error = exc
            with self._cv:
                self._pending[key] -= 1
                self._cv.notify_all()

    def wait(self, key: int) -> None:
        with self._cv:
            if self._pending.get(key):
                self._cv.wait_for(lambda: not self._pending.get(key))
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("host work after a device-to-host copy failed") from err


def _event(*, timing: bool = False) -> torch.cuda.Event:
    """Every event is made blocking: a host wait on one (wait_landed, wait_uploaded, the
    host-work thread's, and any a later change adds) then sleeps in the driver instead of
    spinning a core that the CPU-Adam needs; for an event only the device waits on, the flag
    costs nothing."""
    return torch.cuda.Event(enable_timing=timing, blocking=True)


class CudaCopier(Streams, Transport):
    """Params on a CUDA device; every copy runs on one side stream."""

    def __init__(self, device: torch.device, *, pin: bool, threads: int = 1):
        self.device = device
        self.pinned = pin
        self.stream = torch.cuda.Stream(device=device)
        self._host_work = _HostWork(device, threads=threads)
        self._landed: dict[int, torch.cuda.Event] = {}
        self._uploaded: dict[int, torch.cuda.Event] = {}
        self._ready: dict[int, torch.cuda.Event] = {}  # params written, not yet waited for
        self._timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def device_buffer(self, key: int, numel: int, dtype: torch.dtype, host, *,
                      zero: bool) -> torch.Tensor:
        """A fresh device buffer from the caching allocator (``host`` is not called: the
        host buffer may never be needed): only buckets still collecting or in flight hold
        device memory, never a full gradient copy."""
        make = torch.zeros if zero else torch.empty
        return make(numel, dtype=dtype, device=self.device)

    def side_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A transient device buffer that only the side stream uses (the all-gather's flat
        bucket). Allocated on the compute stream; record_stream keeps the allocator from
        handing its memory out again before the side stream is past its last use, whenever
        the caller drops it."""
        buf = torch.empty(numel, dtype=dtype, device=self.device)
        buf.record_stream(self.stream)
        return buf

    @contextlib.contextmanager
    def side(self):
        """Work queued inside runs on the side stream, after everything the compute stream
        has queued so far: a buffer the compute stream wrote (grads, the check kernel) or is
        still reading (params in the previous forward; the host runs ahead) is then safe."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def queue_on_side(self, fn) -> None:
        """``fn`` on the side stream behind the uploads queued so far; the uploads queued
        later follow it on the same stream, so they cannot overwrite what it reads."""
        with self.side():
            fn()

    def _start(self) -> torch.cuda.Event:
        ev = _event(timing=True)
        ev.record(self.stream)
        return ev

    def _record(self, events: dict, key: int, kind: str, start: torch.cuda.Event) -> None:
        # Timed, so that the copy's duration on the device can be read later (device_times).
        ev = _event(timing=True)
        ev.record(self.stream)
        events[key] = ev
        self._timed.append((kind, start, ev))

    def device_times(self) -> dict[str, float]:
        """Seconds the side stream spent copying, by direction ("d2h_copy", "h2d_copy"),
        over the copies finished since the last call; copies still running are counted at
        a later call. Reads only finished events: no sync."""
        out, keep = {}, []
        for kind, a, z in self._timed:
            if z.query():
                out[kind] = out.get(kind, 0.0) + a.elapsed_time(z) / 1e3
            else:
                keep.append((kind, a, z))
        self._timed = keep
        return out

    def to_host(self, key: int, dst: torch.Tensor, src: torch.Tensor, *keep) -> None:
        """Device ``src`` -> host ``dst`` on the side stream; `wait_landed(key)` before
        the host reads ``dst``."""
        # Host work queued by after_landed(key) may still read the buffer this overwrites
        # (the fold of the previous micro-step): it had a whole backward to finish.
        self._host_work.wait(key)
        with self.side():
            t0 = self._start()
            dst.copy_(src, non_blocking=self.pinned)
            self._record(self._landed, key, "d2h_copy", t0)
        # The caller drops `src` (and `keep`, e.g. a collective's input) now: the allocator
        # must not reuse their memory before the side stream is past this copy.
        for t in (src, *keep):
            t.record_stream(self.stream)

    def to_device(self, key: int, host: torch.Tensor) -> torch.Tensor:
        """A device copy of ``host`` that the compute stream may add to (an fp32 sum of
        earlier micro-steps that this backward's grads join)."""
        buf = torch.empty(host.numel(), dtype=host.dtype, device=self.device)
        with self.side():
            buf.copy_(host, non_blocking=self.pinned)
            ev = _event()
            ev.record(self.stream)
        buf.record_stream(self.stream)
        # The hooks add into `buf` on the compute stream: only after it has landed.
        torch.cuda.current_stream(self.device).wait_event(ev)
        return buf

    def wait_landed(self, key: int) -> None:
        self._host_work.wait(key)
        ev = self._landed.pop(key, None)
        if ev is not None:
            ev.synchronize()

    def after_landed(self, key: int, fn) -> None:
        """Run host work ``fn`` once key's last copy to the host has landed, on a thread
        of its own: the caller does not wait (the fold of a micro-step's grads into the fp32
        sum, ~30 ms for a 32M-element bucket on 2 cores, would otherwise stall the autograd
        thread in a grad hook, and with it the kernel launches). The next `to_host(key)`
        and `wait_landed(key)` wait for it first."""
        self._host_work.submit(key, self._landed.pop(key, None), fn)

    def to_params(self, key: int, layout: BucketLayout, src: torch.Tensor) -> None:
        """Host ``src`` (this bucket's new values) -> each param's own storage, one copy per
        param, after the compute stream is done reading the old values."""
        nb = self.pinned and src.is_pinned()  # the fp32 master is pageable: a blocking copy
        with self.side():
            t0 = self._start()
            layout.copy_to_params(src, layout.start, non_blocking=nb)
            # One event after all of the bucket's copies: wait_uploaded needs them all done.
            self._record(self._uploaded, key, "h2d_copy", t0)

    def to_flat(self, key: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host ``src`` -> a device buffer the side stream owns (this rank's slice of an
        all-gather). The side stream's wait on the compute stream also orders a ``dst`` the
        compute stream allocated before its first use here."""
        nb = self.pinned and src.is_pinned()
        with self.side():
            t0 = self._start()
            dst.copy_(src, non_blocking=nb)
            self._record(self._uploaded, key, "h2d_copy", t0)

    def wait_uploaded(self, key: int) -> None:
        # The host is about to overwrite the upload's source (the bucket's 16-bit buffer).
        ev = self._uploaded.pop(key, None)
        if ev is not None:
            ev.synchronize()

    def mark_ready(self, key: int) -> None:
        """Bucket ``key``'s params are all queued on the side stream (uploads, or the copies
        out of an all-gather): an event the compute stream can wait for."""
        ev = _event()
        ev.record(self.stream)
        self._ready[key] = ev

    def wait_ready(self, keys) -> None:
        """The compute stream waits for these buckets' params (a device-side wait, queued
        before a module's forward); the other buckets may still be uploading."""
        stream = torch.cuda.current_stream(self.device)
        for key in keys:
            ev = self._ready.pop(key, None)
            if ev is not None:
                stream.wait_event(ev)

    def finish_uploads(self) -> float:
        """The compute stream waits for every upload queued so far, without a host sync;
        returns the host time spent (about 0: the wait is queued on the device)."""
        t0 = time.perf_counter()
        if self._ready:
            self._ready.clear()
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return time.perf_counter() - t0

    def join_side(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class ResidentTransport(Transport):
    """The transport of buckets whose state stays on the params' device (``offload_fraction``,
    docs/design.md, "Device buckets"): their "host" buffers are device memory, so nothing is
    copied. A device buffer is the bucket's own (``host()``); a landing is the buffer itself;
    host work (the fold into the fp32 sum) and param writes run at once on the compute
    stream, in order with the hooks and the device update. What orders streams is
    ``streams``' (the engine's): `wait_landed` makes the compute stream wait for side-stream
    work that wrote a device bucket (a reduce-scatter's output and its check, data
    parallel)."""

    def __init__(self, streams: Streams):
        self.streams = streams

    def device_buffer(self, key: int, numel: int, dtype: torch.dtype, host, *,
                      zero: bool) -> torch.Tensor:
        buf = host()
        return buf.zero_() if zero else buf

    def to_host(self, key: int, dst: torch.Tensor, src: torch.Tensor, *keep) -> None:
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)

    def wait_landed(self, key: int) -> None:
        self.streams.join_side()

    def after_landed(self, key: int, fn) -> None:
        self.streams.join_side()  # the last landing may be a reduce-scatter's, side stream
        fn()

    def to_device(self, key: int, host: torch.Tensor) -> torch.Tensor:
        return host

    def to_params(self, key: int, layout: BucketLayout, src: torch.Tensor) -> None:
        layout.copy_to_params(src, layout.start)

    def to_flat(self, key: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def wait_uploaded(self, key: int) -> None:
        pass


class Copier:
    """What the engine and its exchanges hold: ``streams`` (stream-wide) and the transport
    of each tier, ``host`` for host buckets (often the same object as ``streams``: one
    implementation of both), `ResidentTransport` for device buckets. Nobody asks which
    bucket is where: `of` answers from the bucket's tier."""

    def __init__(self, streams: Streams, host: Transport):
        self.streams = streams
        self.transports: dict[Tier, Transport] = {Tier.HOST: host,
                                                   Tier.DEVICE: ResidentTransport(streams)}

    def of(self, bucket) -> Transport:
        """The transport of ``bucket``'s tier (`state.Bucket.tier`)."""
        return self.transports[bucket.tier]


def make_copier(device: torch.device, *, pin: bool, threads: int):
    """The streams and host transport (one object) for params on ``device``; its host work
    runs on ``threads`` threads."""
    if device.type == "cuda":
        return CudaCopier(device, pin=pin, threads=threads)
    return HostCopier(threads=threads)
