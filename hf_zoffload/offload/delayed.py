"""The delayed parameter update's background thread: start, relay its error, drain.

After a warm-up, ``step()`` starts step i's CPU-Adam here and returns, so the device computes
step i+1 on one-step-stale params while the host updates (the paper's DPU). The thread only
runs the CPU-Adam: no collective and no upload happens on it (those stay on the caller's
thread, in the same order on every rank), so it needs no process group of its own.
"""

from __future__ import annotations

import threading
import time

import torch


class DelayedUpdate:
    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.waited = 0.0  # seconds the last `wait()` blocked

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, fn, *, device: torch.device) -> None:
        """Run ``fn`` on a new thread. With params on CUDA the thread first makes their
        device current: its waits on CUDA events would otherwise create a context on GPU 0
        in every process of a multi-GPU launch (each new thread starts on device 0)."""
        if self._thread is not None:
            raise RuntimeError("internal: a delayed update started before the last one ended")

        def run():
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                fn()
            except BaseException as exc:  # re-raised on the caller's thread in wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name="zoffload-cpu-adam", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the running update is done; raise its error here if it failed."""
        if self._thread is None:
            return
        t0 = time.perf_counter()
        self._thread.join()
        self._thread = None
        self.waited = time.perf_counter() - t0
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the delayed CPU-Adam update failed") from err
