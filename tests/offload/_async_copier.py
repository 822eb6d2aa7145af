"""`AsyncCopier`: the copier interfaces (hf_zoffload/offload/copier.py: `Streams` and the host
`Transport`) with `CudaCopier`'s ordering on CPU tensors, so that a missing wait shows up on a
machine without a GPU.

Most of the CUDA path's correctness is ordering: a copy must finish before its destination is
read and before its source is overwritten (docs/design.md, "Stream rules"). `HostCopier` copies
at once and cannot miss a wait; this one runs every copy on ONE worker thread, the emulated
side stream, in FIFO order, each after a random sleep and in up to three chunks with sleeps in
between. A read that skips its wait then sees stale or half-written data, and the engine's
result stops being bitwise that of `HostCopier`.

What stands for what:

- the caller's thread is the compute stream (its ops run at once, so "the side stream waits
  for the compute stream", rule 1, always holds);
- an event is a job's sequence number; waiting for it blocks until the worker has completed
  that many jobs, which on an in-order stream is what a CUDA event means;
- ``side()`` waits until the worker is idle, then runs its body inline: the body is work
  queued behind everything on the side stream (it cannot run on the worker: it is caller code,
  collectives included). This drains the queue on the host, so it can hide a missing wait of
  a read that follows a ``side()`` block;
- ``finish_uploads()`` makes the *compute stream* wait (rule 4): with ``lazy_uploads`` (the
  default) it only records how far, and the next forward waits there, through a global module
  forward pre-hook (`forward_waits`), so the host runs ahead as on CUDA and a CPU-Adam that
  overwrites an upload's source without ``wait_uploaded`` races its upload. Anything else that
  reads params "on the device" must call `synchronize()` first (tests comparing params do);
- ``mark_ready(key)`` notes the last job queued for a bucket's params and ``wait_ready(keys)``
  (the engine's per-module forward waits) blocks the caller, the compute stream, until those
  jobs are done: only those, so a forward that reads a bucket it did not wait for sees it
  half-uploaded;
- device buffers (`device_buffer(zero=False)`, `side_buffer`, `to_device`) start as NaN, never as a
  host buffer: the host buffer changes only when the worker copies into it;
- a device buffer dropped after its copy was queued stays referenced by the job (rule 2).

A worker error is kept and raised on the caller at its next call (sticky, as CUDA errors
are); later jobs are skipped but still complete, so nothing waits forever.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
import weakref

import torch

from hf_zoffload.offload.copier import Streams, Transport

_live: weakref.WeakSet = weakref.WeakSet()  # open copiers, for the forward pre-hook


class AsyncCopier(Streams, Transport):
    cuda_path = True  # as CUDA: new params go up through to_params / to_flat

    def updates_in_place(self, delayed: bool) -> bool:
        return not self.cuda_path and not delayed  # else as HostCopier

    def forwards_wait(self) -> bool:
        return self.cuda_path

    def __init__(self, seed: int = 0, *, max_delay_s: float = 0.003,
                 chunk_delay_s: float = 0.001, max_chunks: int = 3,
                 lazy_uploads: bool = True, timeout_s: float = 120.0):
        self.max_delay_s, self.chunk_delay_s = max_delay_s, chunk_delay_s
        self.max_chunks, self.lazy_uploads, self.timeout_s = max_chunks, lazy_uploads, timeout_s
        self._rng = random.Random(seed)  # drawn on the worker only: a seeded schedule
        self._cv = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = self._done = 0
        self._compute_at = 0  # the compute stream waits for jobs up to here (finish_uploads)
        self._landed: dict[int, int] = {}
        self._uploaded: dict[int, int] = {}
        self._ready: dict[int, int] = {}
        self.ready_waits: list[tuple[int, ...]] = []  # the keys of each wait_ready, in order
        self._error: BaseException | None = None
        self._held = threading.Event()
        self._held.set()
        self.counts = dict.fromkeys(("jobs", "chunked", "to_host", "to_device", "to_params",
                                     "to_flat", "after_landed", "jobs_read"), 0)
        self._thread = threading.Thread(target=self._work, name="async-copier", daemon=True)
        self._thread.start()
        _live.add(self)

    # ------------------------------------------------------------- the worker
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, _keep = job
            self._held.wait()
            if self._error is None:
                try:
                    time.sleep(self._rng.uniform(0.0, self.max_delay_s))
                    fn()
                except BaseException as exc:  # raised on the caller at its next call
                    self._error = exc
            del fn, _keep, job  # rule 2: the buffers may go now
            with self._cv:
                self._done += 1
                self._cv.notify_all()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` in up to ``max_chunks`` pieces with sleeps in between, so a
        premature read sees part new, part old."""
        n = dst.numel()
        k = min(self._rng.randint(1, self.max_chunks), n) if dst.is_contiguous() \
            and src.is_contiguous() and src.numel() == n else 1
        if k <= 1:
            dst.copy_(src)
            return
        self.counts["chunked"] += 1
        d, s = dst.view(-1), src.reshape(-1)
        cuts = [0, *sorted(self._rng.sample(range(1, n), k - 1)), n]
        for i, (a, z) in enumerate(zip(cuts, cuts[1:])):
            if i:
                time.sleep(self._rng.uniform(0.0, self.chunk_delay_s))
            d[a:z].copy_(s[a:z])

    def _copy_to_params(self, layout, src: torch.Tensor) -> None:
        n = src.numel()
        k = max(1, min(self._rng.randint(1, self.max_chunks), n))
        cuts = [0, *sorted(self._rng.sample(range(1, n), k - 1)), n]
        self.counts["chunked"] += k > 1
        for i, (a, z) in enumerate(zip(cuts, cuts[1:])):
            if i:
                time.sleep(self._rng.uniform(0.0, self.chunk_delay_s))
            # src holds bucket elements [start, start + n): this piece starts at start + a.
            # Through `.data`, which shares no version counter: the counter was bumped when
            # the copy was queued (to_params), as a CUDA copy_ bumps it at launch.
            for slot, i, j in layout.pieces(layout.start + a, layout.start + z):
                o = slot.offset + i - layout.start - a
                slot.param.data.view(-1)[i:j].copy_(src[a:z][o:o + j - i])

    # ---------------------------------------------------------- the plumbing
    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("AsyncCopier: a copy on the worker thread failed") from self._error

    def _enqueue(self, kind: str, fn, *keep) -> int:
        self._raise()
        if not self._thread.is_alive():
            raise RuntimeError("AsyncCopier: used after close()")
        with self._cv:
            self._queued += 1
            self.counts["jobs"] += 1
            self.counts[kind] += 1
            self._queue.put((fn, keep))
            return self._queued

    def _wait(self, seq: int, what: str) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._done >= seq, timeout=self.timeout_s):
                raise RuntimeError(f"AsyncCopier: {what} still not done after "
                                   f"{self.timeout_s} s (held: {not self._held.is_set()})")
        self._raise()

    # ------------------------------------------------------- the interface
    def device_buffer(self, key: int, numel: int, dtype: torch.dtype, host, *,
                      zero: bool) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype) if zero else _garbage(numel, dtype)

    def side_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return _garbage(numel, dtype)

    @contextlib.contextmanager
    def side(self):
        self._wait(self._queued, "side(): the work queued before it")
        yield

    def to_host(self, key: int, dst: torch.Tensor, src: torch.Tensor, *keep) -> None:
        seq = self._enqueue("to_host", lambda: self._copy(dst, src), src, *keep)
        with self._cv:
            self._landed[key] = seq

    def after_landed(self, key: int, fn) -> None:
        # host work after the landed copy: a job behind it, in order, so the next copy into
        # the same buffer follows it; wait_landed(key) waits for it
        seq = self._enqueue("after_landed", fn)
        with self._cv:
            self._landed[key] = seq

    def to_device(self, key: int, host: torch.Tensor) -> torch.Tensor:
        buf = _garbage(host.numel(), host.dtype)
        seq = self._enqueue("to_device", lambda: self._copy(buf, host))
        # rule 5: the compute stream waits before the hooks add into `buf`; here that is
        # the caller, so the host waits
        self._wait(seq, "to_device")
        return buf

    def wait_landed(self, key: int) -> None:
        with self._cv:
            seq = self._landed.pop(key, None)
        if seq is not None:
            self._wait(seq, f"wait_landed({key})")
        self._raise()

    def to_params(self, key: int, layout, src: torch.Tensor) -> None:
        for slot, _, _ in layout.pieces(layout.start, layout.start + src.numel()):
            torch.autograd.graph.increment_version(slot.param)  # at launch, as on CUDA
        seq = self._enqueue("to_params", lambda: self._copy_to_params(layout, src))
        with self._cv:
            self._uploaded[key] = seq

    def to_flat(self, key: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        seq = self._enqueue("to_flat", lambda: self._copy(dst, src))
        with self._cv:
            self._uploaded[key] = seq

    def wait_uploaded(self, key: int) -> None:
        with self._cv:
            seq = self._uploaded.pop(key, None)
        if seq is not None:
            self._wait(seq, f"wait_uploaded({key})")
        self._raise()

    def device_times(self) -> dict[str, float]:
        return {}  # emulated copies: no device time to report

    def queue_on_side(self, fn) -> None:
        """``fn`` (a read of params, say) as a job on the side stream, after everything
        queued so far and before anything queued later; the caller does not wait."""
        self._enqueue("jobs_read", fn)

    def mark_ready(self, key: int) -> None:
        with self._cv:
            self._ready[key] = self._queued

    def wait_ready(self, keys) -> None:
        keys = tuple(keys)
        self.ready_waits.append(keys)
        for key in keys:
            with self._cv:
                seq = self._ready.pop(key, None)
            if seq is not None:
                self._wait(seq, f"wait_ready({key})")
        self._raise()

    def finish_uploads(self) -> float:
        t0 = time.perf_counter()
        with self._cv:
            self._ready.clear()
            self._compute_at = max(self._compute_at, self._queued)
        if not self.lazy_uploads:
            self.compute_wait()
        self._raise()
        return time.perf_counter() - t0

    def join_side(self) -> None:
        # the compute stream (the caller) waits for every job queued so far
        self._wait(self._queued, "join_side")

    # ------------------------------------------- for tests: the compute stream
    def compute_wait(self) -> None:
        """The compute stream reaches the point ``finish_uploads`` made it wait for."""
        self._wait(self._compute_at, "finish_uploads' wait (at a forward)")

    def synchronize(self) -> None:
        """torch.cuda.synchronize(): every queued copy done (before reading params)."""
        self._wait(self._queued, "synchronize")

    @contextlib.contextmanager
    def hold(self):
        """The worker starts no job inside (a copy already started finishes)."""
        self._held.clear()
        try:
            yield
        finally:
            self._held.set()

    def close(self) -> None:
        """Finish what is queued, stop the worker; raise its error if it had one."""
        _live.discard(self)
        self._held.set()
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(self.timeout_s)
        self._raise()


def _garbage(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh "device" buffer: torch.empty on CUDA; NaN here, so a read of it shows."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full((numel,), float("nan"), dtype=dtype)
    return torch.full((numel,), -7, dtype=dtype)


def _forward_pre_hook(module, args):
    for c in list(_live):
        c.compute_wait()


@contextlib.contextmanager
def forward_waits():
    """While inside, every module's forward first waits for what ``finish_uploads`` made
    the compute stream wait for (rule 4), on every open AsyncCopier."""
    handle = torch.nn.modules.module.register_module_forward_pre_hook(_forward_pre_hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def installed(seed: int, *, cuda_path: bool = True, **options):
    """Engines built inside use a fresh `AsyncCopier` each (seeds seed, seed + 1, ...), and
    forwards wait as on CUDA. ``cuda_path``: the CPU-Adam writes the new params over the
    16-bit grads and they go up through ``to_params`` / ``to_flat``, as on CUDA (else the
    engine writes them into the params in place and uploads nothing, as on the CPU).
    Yields the list of copiers made; closes them on the way out."""
    import hf_zoffload.offload.build as build

    made: list[AsyncCopier] = []

    def make_copier(device, *, pin, threads):
        made.append(AsyncCopier(seed + len(made), **options))
        made[-1].cuda_path = cuda_path
        return made[-1]

    saved = build.make_copier
    build.make_copier = make_copier
    ok = False
    try:
        with forward_waits():
            yield made
        ok = True
    finally:
        build.make_copier = saved
        errors = []
        for c in made:
            try:
                c.close()
            except RuntimeError as exc:
                errors.append(exc)
        if errors and ok:  # else the error already on its way says more
            raise errors[0]


def synchronize(opt) -> None:
    """Before reading params "on the device": no-op for the other copiers."""
    sync = getattr(opt.copier.streams, "synchronize", None)
    if sync is not None:
        sync()
