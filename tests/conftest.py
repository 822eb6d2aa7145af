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


@pytest.fixture
def torch_one_thread():
    """torch's MKL sqrt with 2 threads measured ~16 ms per call at any size >= 4097 on a
    loaded 2-core box (4 us on one thread); the CPU-Adam references run on torch ops. The
    kernel takes its thread count as an argument, so this changes nothing it computes."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
