import os

import pytest
from accelerate.state import AcceleratorState, GradientState


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No HF_ZOFFLOAD_* from the caller, and a new accelerate state per test (it is a
    process-wide singleton that refuses a second mixed_precision)."""
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
