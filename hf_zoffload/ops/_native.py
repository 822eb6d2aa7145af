"""The compiled extension (hf_zoffload.ops._cpu_adam), loaded on first use so that a missing
build is one clear error at the first kernel call, not at ``import hf_zoffload``."""

from __future__ import annotations

import functools


@functools.cache
def ext():
    try:
        from hf_zoffload.ops import _cpu_adam
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "hf_zoffload.ops._cpu_adam (the compiled CPU-Adam) is missing: the package was not "
            "built. Reinstall from the source tree with `pip install -e .` (needs gcc and the "
            "Python headers)."
        ) from exc
    return _cpu_adam
