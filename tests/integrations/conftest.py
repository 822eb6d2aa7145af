import pytest

from tests._env import fresh_accelerate_state
from tests._fixtures import make_engine, train_fixture  # noqa: F401  (the shared fixtures)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    with fresh_accelerate_state(monkeypatch):
        yield
