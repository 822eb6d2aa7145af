from tests._fixtures import make_engine, train_fixture  # noqa: F401  (the shared fixtures)
