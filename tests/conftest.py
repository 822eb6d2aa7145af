import os

import pytest
import torch

# Triton picks the interpreter when a kernel is *decorated*, so the switch must be set
# before hf_zoffload.ops.scaling is imported anywhere (DESIGN.md, Triton 3.9).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
