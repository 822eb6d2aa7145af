"""The overlapped schedule (``overlap_step``): during the backward that ends the window, each
host bucket's CPU-Adam starts on a background thread as soon as its gradient has landed,
speculating that the step stands as it is (no fp16 overflow, no clipping, the same
hyperparameters at ``step()``); ``step()`` then validates, corrects what speculation got
wrong, updates the buckets still left and publishes all of them in forward order.

Validation: a bucket's early update stands when a plan made at ``step()`` equals the one it
ran (same runs, step counts, hyperparameters and grad_scale: the clip coefficient is exactly
1.0 and the loss scale the window's). Then the result is bitwise the synchronous schedule's.
Otherwise its update is undone (`inverse.undo`, from the gradient, which the early update did
not overwrite: its new params go to the other set of landing buffers) and redone from the
step's plan, within `inverse.bound` of the synchronous result; after an fp16 overflow it is
only undone and the step skipped. Speculation ends early when it cannot hold: a non-finite
gradient, or a squared partial norm (this rank's buckets so far) over the last step's
max_norm squared, which the global one then exceeds too (docs/design.md, "Step schedules").
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time

import torch

from ..state import Bucket
from ..threads import host_threads
from ..tiers import Tier
from ..update import Work, check_betas, commit, forward_order, out_for, plan, run
from .base import Schedule, Steps
from .inverse import undo

logger = logging.getLogger(__name__)

_STOP = object()  # the worker's end-of-window mark


class Overlapped(Schedule):
    name = "overlapped"

    def __init__(self, cpu_threads: int):
        # One core stays with the Python thread that launches device work (and, on the CPU,
        # runs backward itself); on one core both share it.
        self.early_threads = max(1, cpu_threads - 1)
        self.cpu_threads = cpu_threads  # once backward has ended: the worker's last buckets
        self._early: dict[int, Work] = {}  # bucket index -> its early update, in run order
        self._summed: set[int] = set()  # buckets whose last grads joined the fp32 sum here
        self._final = False  # the current backward ends the window
        self._signalled = False  # this window's boundary was told (no_sync, accelerate)
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = False  # no more early updates in this window
        self._ended = False  # backward ended: queued buckets still run, on every thread
        self._t_backward_end: float | None = None
        self._hidden = 0  # host elements updated before backward ended
        self._over = False  # speculation ended for this window
        self._partial = 0.0  # squared norm of the buckets checked so far (this rank's)
        self._warned = False
        # steps whose speculation held (every early update stood) / was tried (had early
        # updates, or ended early: a partial norm over the limit or a non-finite gradient)
        self.hits = self.speculated = 0
        self._last: dict[str, float] = {}

    # ------------------------------------------------------------ backward
    def begin_backward(self, eng: Steps, *, final: bool, explicit: bool = False) -> None:
        started = bool(self._early) or self._thread is not None
        # The worker finishes what it was given first: which buckets took their last grads
        # into the sum is known only then, and the answer below must not depend on how far
        # the worker had got (it had summed none yet, at times, on a 2-core CI machine).
        if self._thread is not None:
            self.end_window(eng)
        if self._summed:
            raise RuntimeError(
                "a backward after the one that ended the accumulation window (sync_gradients "
                "was True, or outside no_sync()), with overlap_step: its buckets were updated "
                "already; call step() (or zero_grad()) first")
        if started:
            # The window did not end: a loop that accumulates without telling (no no_sync,
            # no accelerate). The early updates are undone; the next step is done at step().
            self._undo_all(eng)
            self._stop = self._ended = False
            self._t_backward_end = None
            if not self._warned:
                self._warned = True
                logger.warning("ZeRO-Offload overlap_step: a backward came after one that "
                               "looked final; use no_sync() (or accelerate's accumulate()) "
                               "for the micro-steps before the last, so the CPU update can "
                               "start during the last one")
        self._final = final
        self._signalled = self._signalled or explicit or not final

    def landed(self, eng: Steps, b: Bucket) -> None:
        if not self._final or self._stop or self._over or b.tier is Tier.DEVICE:
            return
        if not all(b.window.present):  # with N ranks another rank may have more params
            return
        if b.window.landed > 1 and not self._signalled:
            return  # accumulating without a told boundary: this may not be the last
        if self._thread is None:
            self._start(eng)
        self._queue.put(b)

    def _start(self, eng: Steps) -> None:
        self._queue, self._error, self._partial = queue.SimpleQueue(), None, 0.0
        self._thread = threading.Thread(target=self._work, args=(eng,), daemon=True,
                                        name="zoffload-overlapped-adam")
        self._thread.start()

    def _work(self, eng: Steps) -> None:
        try:
            if eng.device.type == "cuda":  # as offload.delayed: no context on GPU 0
                torch.cuda.set_device(eng.device)
            while (b := self._queue.get()) is not _STOP:
                if not (self._stop or self._over):
                    threads = self.cpu_threads if self._ended else self.early_threads
                    with host_threads(threads):
                        self._update_early(eng, b, threads)
        except BaseException as exc:  # re-raised on the caller's thread in end_window
            self._error = exc

    def _update_early(self, eng: Steps, b: Bucket, threads: int) -> None:
        t0 = time.perf_counter()
        idx = b.layout.index
        eng.copier.of(b).wait_landed(idx)
        if b.window.landed > 1:  # the last micro-step joins the window's fp32 sum
            b.state.grads.acc.add_(b.window.last)
            self._summed.add(idx)
        grad = b.grad()
        limit, inv = eng.speculation()
        if limit is not None:  # fp16 or clipping: the step may not stand as planned
            n = float(torch.linalg.vector_norm(grad, dtype=torch.float32)) * inv
            self._partial += n * n
            if not math.isfinite(self._partial) or (limit > 0 and self._partial > limit**2):
                self._over = True
                return
        out = b.out()
        if out.data_ptr() == grad.data_ptr():  # keep the gradient: the correction reads it
            out = eng.host_pool.get(("grad16", 1 - b.state.grads.which), idx, out.dtype)
        check_betas([b], eng.param_groups)
        work = plan(b, eng.param_groups, eng.param_steps, inv, out=out)
        run([work], copier=eng.copier, threads=threads, sr_seed=eng.sr_seed)
        self._early[idx] = work
        t1 = time.perf_counter()
        self._last["cpu_adam_early"] = self._last.get("cpu_adam_early", 0.0) + t1 - t0
        if self._t_backward_end is None:  # done while backward still ran
            self._hidden += b.layout.shard

    def end_backward(self, eng: Steps) -> None:
        if self._final and self._t_backward_end is None:
            self._t_backward_end = time.perf_counter()
            self._ended = True

    def end_window(self, eng: Steps) -> None:
        """The worker finishes what is queued (on every thread now) and stops."""
        self._ended = True
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join()
        self._thread, self._queue, self._stop = None, None, True
        if self._error is not None:
            err, self._error = self._error, None
            self._undo_all(eng)
            raise RuntimeError("the overlapped CPU-Adam update failed") from err

    def took_sum(self, b: Bucket) -> bool:
        return b.layout.index in self._summed

    # ---------------------------------------------------------------- step
    def step(self, eng: Steps, *, overflow: bool, norm: float) -> None:
        self.end_window(eng)
        early, self._early = self._early, {}
        grad_scale = eng.settle_step(overflow, norm)
        t_fix = 0.0
        stood = bool(early)
        if grad_scale is None:  # skipped: the early updates are undone, nothing else runs
            t0 = time.perf_counter()
            with host_threads(eng.cpu_threads):
                for w in early.values():
                    undo(w, threads=eng.cpu_threads)
            self._account(early, stood=False, t_fix=time.perf_counter() - t0, eng=eng)
            return
        check_betas(eng.buckets, eng.param_groups)
        in_place = eng.copier.streams.updates_in_place(False)
        t_adam = t_publish = 0.0
        done = []
        with host_threads(eng.cpu_threads):
            for b in forward_order(eng.buckets):
                e = early.get(b.layout.index)
                item = plan(b, eng.param_groups, eng.param_steps, grad_scale,
                            out=out_for(b, in_place=in_place) if e is None else e.out)
                if item is None:
                    continue
                done.append(item)
                if e is not None and _same(e, item):
                    t0 = time.perf_counter()
                    eng.exchange.publish(b, e.out)
                    t_publish += time.perf_counter() - t0
                    continue
                if e is not None:
                    stood = False
                    t0 = time.perf_counter()
                    undo(e, threads=eng.cpu_threads)
                    t_fix += time.perf_counter() - t0
                a, p = run([item], copier=eng.copier, threads=eng.cpu_threads,
                           publish=eng.exchange.publish, sr_seed=eng.sr_seed)
                t_adam, t_publish = t_adam + a, t_publish + p
        commit(done, eng.param_steps)
        eng.timings["cpu_adam"] = t_adam
        eng.timings["upload_host"] = t_publish + eng.finish_publish()
        eng.params_written()
        self._account(early, stood=stood, t_fix=t_fix, eng=eng)

    def _account(self, early: dict, *, stood: bool, t_fix: float, eng: Steps) -> None:
        if early or self._over:
            self.speculated += 1
            self.hits += stood and not self._over
        host = sum(b.layout.shard for b in eng.buckets if b.tier is not Tier.DEVICE)
        self._last.update(correction=t_fix, early_share=sum(
            w.bucket.layout.shard for w in early.values()) / max(1, host),
            hidden_share=self._hidden / max(1, host))
        if self.speculated:  # none tried yet (every bucket on the device, say): no share
            self._last["hit_share"] = self.hits / self.speculated

    def stats(self) -> dict[str, float]:
        out, self._last = self._last, {}
        out.setdefault("cpu_adam_early", 0.0)
        return out

    # ------------------------------------------------------------- between
    def _undo_all(self, eng: Steps) -> None:
        early, self._early = self._early, {}
        with host_threads(eng.cpu_threads):
            for w in early.values():
                undo(w, threads=eng.cpu_threads)

    def discard(self, eng: Steps) -> None:
        self.settle(eng)

    def settle(self, eng: Steps) -> None:
        """Mid-window (a checkpoint between backward and step): the early updates are
        undone; the step redoes them."""
        self.end_window(eng)
        self._undo_all(eng)

    def reset_window(self) -> None:
        self._summed.clear()
        self._final = self._signalled = self._stop = self._over = self._ended = False
        self._partial, self._hidden, self._t_backward_end = 0.0, 0, None

    @property
    def in_flight(self) -> bool:
        return bool(self._early) or self._thread is not None

    def close(self) -> None:
        if self._thread is not None:
            self._stop = True
            self._queue.put(_STOP)
            self._thread.join()
            self._queue = None
            self._thread = None
        self._early = {}


def _same(a: Work, b: Work) -> bool:
    """Two plans of one bucket do the same update."""
    return a.runs == b.runs and a.present == b.present and a.counted == b.counted \
        and a.grad is b.grad
