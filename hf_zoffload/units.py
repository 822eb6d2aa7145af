"""Quantities with units (memory sizes, counts): one parser, one kind of error."""

from __future__ import annotations

import math
import re

# Decimal units are SI (24GB = 24e9 B); binary ones and bare letters are powers of 1024
# (24G = 24GiB), as nvidia-smi's MiB. A card sold as "24GB" has 24 GiB: pass 24GiB.
SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_NUMBER = re.compile(r"^\s*([0-9][0-9_]*\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.I)


def parse_quantity(text, units: dict, what: str, example: str) -> int:
    """``text`` as a number with one of ``units`` (a dict unit -> multiplier; "" allows a
    bare number), or one ValueError naming ``what`` and the units."""
    m = _NUMBER.match(str(text))
    unit = m.group(2).lower() if m else None
    # 1e400 parses as inf, which no unit makes a size
    if not m or unit not in units or not math.isfinite(float(m.group(1).replace("_", ""))):
        need = "an optional unit" if "" in units else "a unit"
        raise ValueError(f"{what} {text!r}: expected a number with {need}, one of "
                         f"{', '.join(u for u in units if u)} (e.g. {example})")
    return int(round(float(m.group(1).replace("_", "")) * units[unit]))


def parse_size(text, what: str = "memory size", *, zero_ok: bool = False) -> int:
    """'24GB' -> 24e9 bytes, '80GiB' / '80G' -> 80 * 2**30. A unit is required (a bare '24'
    read as bytes made a 24 GiB card look like 24 bytes; guessing GiB would hide that), but
    with ``zero_ok`` a bare 0 means "not set"."""
    if zero_ok and str(text).strip() in ("0", "0.0"):
        return 0
    return parse_quantity(text, SIZE_UNITS, what, "24GiB, 80GB, 512MiB; B for bytes")
