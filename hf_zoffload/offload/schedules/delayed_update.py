"""The delayed schedule (``delayed_update``): after ``delayed_update_warmup_steps`` applied
steps and once the buckets follow the first backward's order, step i's CPU-Adam runs on a
background thread (`offload.delayed.DelayedUpdate`) while the device computes step i+1 on
params one step stale; its params are published at the next ``step()`` (or `settle`)."""

from __future__ import annotations

import time

from ..delayed import DelayedUpdate
from ..update import commit, run
from .base import Schedule, Steps, plan_all, update_now


class Delayed(Schedule):
    name = "delayed"

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps
        self._thread = DelayedUpdate()
        self._pending: list = []  # (bucket, out) of the update on the thread, to publish

    @property
    def in_flight(self) -> bool:
        return self._thread.running or bool(self._pending)

    def step(self, eng: Steps, *, overflow: bool, norm: float) -> None:
        # Not before the buckets follow the first backward's order (the engine re-lays them
        # out after the first step, which must not move state a background update reads).
        active = eng.order_settled and eng.applied_steps >= self.warmup_steps
        self.settle(eng)  # the previous step's update lands before anything else
        grad_scale = eng.settle_step(overflow, norm)
        if grad_scale is None:
            return
        if not active:
            update_now(eng, grad_scale)
            return
        work = plan_all(eng, grad_scale, in_place=eng.copier.streams.updates_in_place(True))
        commit(work, eng.param_steps)
        # The background update reads this step's grads while the next backward streams
        # new ones: the hooks get the other set of grad buffers.
        for item in work:
            item.bucket.state.swap_grads(eng.host_pool, item.bucket.layout.index)

        def background():
            eng.timings["cpu_adam"], _ = run(work, copier=eng.copier, threads=eng.cpu_threads,
                                             sr_seed=eng.sr_seed)

        self._thread.start(background, device=eng.device)
        self._pending = [(item.bucket, item.out) for item in work]

    def settle(self, eng: Steps) -> None:
        """Finish a pending delayed update and copy its params to the device."""
        if self._thread.running:
            self._thread.wait()
            eng.timings["cpu_adam_wait"] = self._thread.waited
        if self._pending:
            pending, self._pending = self._pending, []
            t0 = time.perf_counter()
            for b, out in pending:
                eng.exchange.publish(b, out)
            eng.timings["upload_host"] = time.perf_counter() - t0 + eng.finish_publish()
            eng.params_written()

    def close(self) -> None:
        self._thread.wait()
        self._pending = []
