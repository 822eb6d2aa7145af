"""The ``figures`` fixture of the gpu checks: each check appends its figures (markdown lines)
to it, and they are printed once the run ends, after pytest's own report, each on a line of
its own starting ``summary: ``. scripts/gpu_check.sh copies those lines (without the prefix)
into summary.md under the stage's name. Printed at the end, not as the test runs, so that
pytest's capture and its progress characters never split a line."""

from __future__ import annotations

import pytest

SUMMARY_PREFIX = "summary: "
_FIGURES = pytest.StashKey[list]()


@pytest.fixture
def figures(request) -> list[str]:
    """The run's list of figure lines, in the order the checks add them."""
    return request.config.stash.setdefault(_FIGURES, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in config.stash.get(_FIGURES, []):
        terminalreporter.write_line(SUMMARY_PREFIX + line)
