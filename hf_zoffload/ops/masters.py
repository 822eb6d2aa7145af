"""How the host stores the master weights (``master_dtype``), and the bf16 master's stochastic
rounding with its torch reference.

- ``fp32``: as a mixed-precision run keeps them; 4 B/param, and the 16-bit params the device
  gets are the master rounded to nearest.
- ``bf16``: the master is the bf16 param itself, 2 B/param: each step's update is computed in
  fp32 from its widened value and rounded back to bf16 stochastically, up in magnitude with
  probability (dropped bits) / 2^16, so an update below half a bf16 step moves the weight on
  average instead of being lost. The random bits are counter-based: element ``i`` of a param
  gets ``hash32(key + i)`` with ``key = step_key(seed, step, param index)``, so the result is
  bitwise the same for any thread count, bucket split or rank count, and a resume from a
  checkpoint (which holds the seed and each param's step) continues bit for bit. The compiled
  rounding is in cython_ext/adam_kernel.h; `round_sr_reference` is the same in torch ops.
"""

from __future__ import annotations

import torch

from ._native import ext

MASK32 = 0xFFFFFFFF
# The engine's default seed of the rounding stream: any fixed value keeps runs reproducible;
# checkpoints carry the one in use.
SR_SEED = 0x5EED


def hash32(x: int) -> int:
    """lowbias32 (adam_kernel.h's hz_hash32) on a Python int."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def step_key(seed: int, step: int, index: int) -> int:
    """The rounding key of param ``index`` at Adam step ``step`` (each mixed in whole, so
    nearby seeds, steps and params give unrelated streams)."""
    return hash32(hash32(hash32(seed) ^ (step & MASK32)) ^ (index & MASK32))


def _hash32_reference(x: torch.Tensor) -> torch.Tensor:
    """hash32 on int64 tensors holding uint32 values."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def round_sr(x: torch.Tensor, key: int, first: int = 0) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 stochastically, element i with the bits of ``first + i``
    under ``key``: compiled (the update's own loop)."""
    x = x.float().contiguous().reshape(-1)
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    ext().sr_round(out.data_ptr(), x.data_ptr(), x.numel(), key & MASK32, first & MASK32)
    return out


def round_sr_reference(x: torch.Tensor, key: int, first: int = 0) -> torch.Tensor:
    """`round_sr` in torch ops (the tests' ground truth)."""
    x = x.float().contiguous().reshape(-1)
    u = x.view(torch.int32).to(torch.int64) & MASK32
    idx = torch.arange(x.numel(), dtype=torch.int64) + first
    r = _hash32_reference(idx + key) & 0xFFFF
    s = (u + r) >> 16
    q = (u >> 16) | 0x40  # NaN: quiet, sign and top payload kept (round to nearest's)
    b = torch.where((u & 0x7FFFFFFF) > 0x7F800000, q, s) & 0xFFFF
    return torch.where(b >= 2**15, b - 2**16, b).to(torch.int16).view(torch.bfloat16)


class MasterFormat:
    """How the host stores the master weights: one object per ``master_dtype``, read by the
    host state (its buffer), the update (the rounding) and the memory arithmetic. Which
    compute dtype each serves is the plugin's check (`ZeroOffloadPlugin.check_master`)."""

    name: str
    dtype: torch.dtype
    stochastic = False  # rounded stochastically after each update (a key per param and step)

    def bytes_per_element(self) -> int:
        return self.dtype.itemsize

    def __repr__(self) -> str:
        return f"MasterFormat({self.name!r})"


class _Fp32(MasterFormat):
    name, dtype = "fp32", torch.float32


class _Bf16(MasterFormat):
    name, dtype, stochastic = "bf16", torch.bfloat16, True  # compute bf16: config.py


MASTERS: dict[str, MasterFormat] = {f.name: f for f in (_Fp32(), _Bf16())}


def master_format(master_dtype) -> MasterFormat:
    """The format named ``master_dtype``; one clear error for any other value."""
    if isinstance(master_dtype, MasterFormat):
        return master_dtype
    if master_dtype not in MASTERS:
        raise ValueError(f"master_dtype must be one of {', '.join(MASTERS)}, "
                         f"got {master_dtype!r}")
    return MASTERS[master_dtype]
