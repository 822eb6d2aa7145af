"""The environment for subprocesses that must see no GPU and none of the caller's GPU-check
settings (so tests of scripts/gpu_check.sh and the GPU scripts hold on a GPU machine too)."""

import os

_DROP = ("HF_ZOFFLOAD_REQUIRE_GPU", "TRITON_INTERPRET", "OUT", "PYTHON", "TORCH_CUDA_SANITIZER")


def cpu_only_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env
