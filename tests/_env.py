"""The environment for subprocesses that must see no GPU and none of the caller's GPU-check
settings (so tests of scripts/gpu_check.sh and the GPU scripts hold on a GPU machine too), and
a fresh accelerate state for tests in this process."""

import contextlib
import os

from accelerate.state import AcceleratorState, GradientState

_DROP = ("HF_ZOFFLOAD_REQUIRE_GPU", "TRITON_INTERPRET", "OUT", "PYTHON", "TORCH_CUDA_SANITIZER")


def cpu_only_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


@contextlib.contextmanager
def fresh_accelerate_state(monkeypatch):
    """No HF_ZOFFLOAD_* from the caller, and a new accelerate state inside (it is a
    process-wide singleton that refuses a second mixed_precision)."""
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
