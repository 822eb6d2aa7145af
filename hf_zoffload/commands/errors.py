"""How every entry point reports a configuration error: the `hf-zoffload` subcommands,
scripts/run_clm.py and scripts/train_accelerate.py.

What the package and those scripts raise on purpose for a bad setting, a bad path, an unknown
model type or a host state that does not fit (`USER_ERRORS`) is printed as one line on stderr,
``<prog>: error: <type>: <message>``, and the command exits with status 2, as argparse does
for a bad command line: the message names what is wrong and what is allowed, and the 9-29
lines of traceback above it only buried it. ``HF_ZOFFLOAD_TRACEBACK=1`` raises it instead,
with its traceback (status 1). Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from hf_zoffload.config import TRACEBACK_ENV

__all__ = ["USER_ERRORS", "TRACEBACK_ENV", "run_command"]

# FloatingPointError: the non-finite stop (integrations/nonfinite.py), whose message names
# the first bad step and what to do.
USER_ERRORS = (ValueError, MemoryError, FileNotFoundError, NotADirectoryError,
               IsADirectoryError, PermissionError, FloatingPointError)


def run_command(prog: str, main: Callable[[], object]) -> int:
    """``main()`` as a command's exit status: its own when it returns an int, else 0; a
    `USER_ERRORS` error is one line on stderr and 2 (module docstring)."""
    try:
        status = main()
    except USER_ERRORS as err:
        if os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0"):
            raise
        print(f"{prog}: error: {type(err).__name__}: {' '.join(str(err).split())}",
              file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0
