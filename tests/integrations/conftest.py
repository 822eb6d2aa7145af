import pytest

from tests._env import fresh_accelerate_state


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    with fresh_accelerate_state(monkeypatch):
        yield
