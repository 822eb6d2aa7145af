import os

import pytest
import torch

# Triton picks the interpreter when a kernel is *decorated*, so the switch must be set
# before hf_zoffload.ops.scaling is imported anywhere (tests/README.md, Running; Triton 3.9).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# scripts/gpu_check.sh sets this: there a `gpu` test that does not run is a failure, whether it
# lacks CUDA or skips itself (pytest.skip, importorskip, a skip mark); xfail stays xfail.
REQUIRE_GPU = os.environ.get("HF_ZOFFLOAD_REQUIRE_GPU", "").strip().lower() in {
    "1", "true", "yes", "on"}
NO_CUDA = "needs a CUDA device (run scripts/gpu_check.sh)"


def _is_gpu(item):
    return item.get_closest_marker("gpu") is not None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or REQUIRE_GPU:
        return
    skip_gpu = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if _is_gpu(item):
            item.add_marker(skip_gpu)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if REQUIRE_GPU and _is_gpu(item) and not torch.cuda.is_available():
        pytest.fail(f"HF_ZOFFLOAD_REQUIRE_GPU=1 and no CUDA device is available: this gpu "
                    f"test {NO_CUDA}", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if REQUIRE_GPU and report.skipped and not hasattr(report, "wasxfail") and _is_gpu(item):
        reason = report.longrepr
        if isinstance(reason, tuple):  # (path, line, "Skipped: why")
            reason = f"{reason[2]} ({reason[0]}:{reason[1]})"
        report.outcome = "failed"
        report.longrepr = (f"HF_ZOFFLOAD_REQUIRE_GPU=1: this gpu test skipped ({reason}), "
                           f"which counts as a failure")
    return report


@pytest.fixture
def torch_one_thread():
    """torch's MKL sqrt with 2 threads measured ~16 ms per call at any size >= 4097 on a
    loaded 2-core box (4 us on one thread); the CPU-Adam references run on torch ops. The
    kernel takes its thread count as an argument, so this changes nothing it computes."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
