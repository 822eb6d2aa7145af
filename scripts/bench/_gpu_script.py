"""What the GPU measurement scripts (scripts/bench/gpu_size.py, gpu_practicality.py,
gpu_peers.py, run by scripts/gpu_check.sh) share besides their models (_gpu_llama.py):

- `require_cuda`: each script exits 1 at once, saying "CUDA is needed", where CUDA is absent.
- `summary`: lines printed as ``summary: <markdown>``; gpu_check.sh copies them (without the
  prefix) into summary.md under the stage's name, so each stage reports its figures there.
- `finish`: the figures, then the failures as bold summary lines, PASS / FAIL; the exit code.

Import-safe: nothing runs at import but the path set-up, so the tests import these helpers.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run from a checkout: the in-place build, no install
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

SUMMARY_PREFIX = "summary: "
CUDA_NEEDED = "CUDA is needed"


def require_cuda(script: str) -> None:
    """Exit 1 with a clear message unless a CUDA device is usable."""
    if not torch.cuda.is_available():
        sys.exit(f"{script}: {CUDA_NEEDED}: torch {torch.__version__} (built with CUDA "
                 f"{torch.version.cuda}) sees no CUDA device. This measurement runs on a GPU "
                 f"machine, through scripts/gpu_check.sh.")


def summary(line: str) -> None:
    print(SUMMARY_PREFIX + line, flush=True)


def finish(script: str, lines: list[str], failures: list[str]) -> int:
    """Print the figures and failures as summary lines, then PASS / FAIL; the exit code."""
    for line in lines:
        summary(line)
    for f in failures:
        summary(f"**{f}**")
    if failures:
        print(f"{script}: FAIL: " + "; ".join(failures), file=sys.stderr)
        return 1
    print(f"{script}: PASS")
    return 0


def md_table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines: header, separator, rows (cells formatted with str)."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
