"""How the host stores Adam's moments (``state_dtype``), and the 8-bit code's torch reference.

- ``fp32``: as torch does; 8 B/param for both moments.
- ``bf16``: both moments rounded to bf16 (nearest even) after each update; 4 B/param.
- ``int8``: block-wise 8-bit codes, one fp32 scale per block of ``QBLOCK`` elements (the
  block's largest magnitude); ~2 B/param. ``exp_avg``: sign, 4 exponent and 3 mantissa bits
  of the element over the scale; ``exp_avg_sq`` is stored as its square root (half the range
  in binades), 4 exponent and 4 mantissa bits. Code 0 is zero, the top code is 1.0 (so the
  largest element is exact), and encode(decode(codes)) returns the same codes and scales:
  checkpoints hold the decoded fp32 moments and a resume continues bit for bit. The update
  caps ``|m| / sqrt(v)`` at exact Adam's own bound (`ratio_cap`), so a sqrt(v) that rounds to
  zero next to a large element cannot blow an update up. The compiled codec is in
  cython_ext/adam_kernel.h; `encode_reference` / `decode_reference` are the same code in torch
  ops (the tests' ground truth).
- ``int4``: the int8 scheme in 4 bits, two codes per byte (element 2j in the low nibble of
  byte j), one fp32 scale per block of ``Q4BLOCK`` elements; ~1 B/param. ``exp_avg``: sign and
  3 exponent bits (2^-6 .. 1 of the scale, powers of two); ``exp_avg_sq`` as its square root,
  3 exponent bits and 1 mantissa bit (1.5 * 2^-7 .. 1). The same round trip, the same ratio
  cap; `encode_reference4` / `decode_reference4` are its torch reference.
"""

from __future__ import annotations

import math

import torch

from ._native import ext

# Elements per block of the 8-bit code: one fp32 scale per 256 elements is 1/64 B per param
# and moment; 256 also keeps a block's three fp32 tiles (3 KiB) in L1
# (docs/protocols/state_formats.md).
QBLOCK = 256
# Code layout (adam_kernel.h): mantissa bits, the code of 1.0, exponent bias of the code.
_M_BITS, _U_BITS = 3, 4
_M_TOP = ((1 << (7 - _M_BITS)) - 1) << _M_BITS  # 120
_U_TOP = ((1 << (8 - _U_BITS)) - 1) << _U_BITS  # 240
_M_BIAS = (127 - (_M_TOP >> _M_BITS)) << _M_BITS
_U_BIAS = (127 - (_U_TOP >> _U_BITS)) << _U_BITS
# Elements per block of the 4-bit code, and its layout (adam_kernel.h, HZ_Q4*); why these:
# docs/measurements.md, "The 4-bit code and block, swept". 128 costs 1/32 B per param and
# moment in scales.
Q4BLOCK = 128
_Q4M_BITS, _Q4U_BITS = 0, 1
_Q4M_TOP = ((1 << (3 - _Q4M_BITS)) - 1) << _Q4M_BITS  # 7
_Q4U_TOP = ((1 << (4 - _Q4U_BITS)) - 1) << _Q4U_BITS  # 14
_Q4M_BIAS = (127 - (_Q4M_TOP >> _Q4M_BITS)) << _Q4M_BITS
_Q4U_BIAS = (127 - (_Q4U_TOP >> _Q4U_BITS)) << _Q4U_BITS


def ratio_cap(beta1: float, beta2: float, state_dtype: str = "int8") -> float:
    """R with ``|m_t| <= R * sqrt(v_t)`` for every gradient sequence and step of exact Adam
    (before bias correction): by Cauchy-Schwarz on ``m_t = (1-b1) sum_k b1^k g_{t-k}``
    against ``v_t = (1-b2) sum_k b2^k g_{t-k}^2``,
    ``R = (1-b1) / sqrt((1-b2) (1 - b1^2/b2))``; it exists when ``b1^2 < b2``."""
    if not beta1 * beta1 < beta2:
        raise ValueError(f"state_dtype={state_dtype!r} needs beta1**2 < beta2 (the bound that "
                         f"keeps a quantized update finite); got betas ({beta1}, {beta2})")
    return (1.0 - beta1) / math.sqrt((1.0 - beta2) * (1.0 - beta1 * beta1 / beta2))


def n_blocks(n: int, block: int = QBLOCK) -> int:
    return -(-n // block)


def n_codes4(n: int) -> int:
    """Bytes of one moment's 4-bit codes for n elements (two per byte)."""
    return -(-n // 2)


def encode_moments(m32: torch.Tensor, v32: torch.Tensor, m_codes: torch.Tensor,
                   v_codes: torch.Tensor, m_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
    """fp32 ``exp_avg`` / ``exp_avg_sq`` -> 8-bit codes and block scales, compiled (the one
    the update uses; `encode_reference` in torch ops). The first element starts a
    block; the scale buffers may be longer than needed."""
    n = m32.numel()
    m32, v32 = m32.float().contiguous(), v32.float().contiguous()
    _check_codes(n, m_codes, v_codes, m_scales, v_scales)
    ext().q8_encode(m32.data_ptr(), v32.data_ptr(), m_codes.data_ptr(), v_codes.data_ptr(),
                     m_scales.data_ptr(), v_scales.data_ptr(), n, QBLOCK)


def decode_moments(m_codes: torch.Tensor, v_codes: torch.Tensor, m_scales: torch.Tensor,
                   v_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes and block scales -> new fp32 (exp_avg, exp_avg_sq), compiled."""
    n = m_codes.numel()
    _check_codes(n, m_codes, v_codes, m_scales, v_scales)
    m32, v32 = torch.empty(n), torch.empty(n)
    ext().q8_decode(m32.data_ptr(), v32.data_ptr(), m_codes.data_ptr(), v_codes.data_ptr(),
                     m_scales.data_ptr(), v_scales.data_ptr(), n, QBLOCK)
    return m32, v32


def encode_moments4(m32: torch.Tensor, v32: torch.Tensor, m_codes: torch.Tensor,
                    v_codes: torch.Tensor, m_scales: torch.Tensor,
                    v_scales: torch.Tensor) -> None:
    """fp32 ``exp_avg`` / ``exp_avg_sq`` -> 4-bit codes (two per byte) and block scales,
    compiled (`encode_reference4` in torch ops); the first element starts a block."""
    n = m32.numel()
    m32, v32 = m32.float().contiguous(), v32.float().contiguous()
    _check_codes(n, m_codes, v_codes, m_scales, v_scales, block=Q4BLOCK, codes=n_codes4(n))
    ext().q4_encode(m32.data_ptr(), v32.data_ptr(), m_codes.data_ptr(), v_codes.data_ptr(),
                    m_scales.data_ptr(), v_scales.data_ptr(), n, Q4BLOCK)


def decode_moments4(m_codes: torch.Tensor, v_codes: torch.Tensor, m_scales: torch.Tensor,
                    v_scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit codes of ``n`` elements and block scales -> new fp32 moments, compiled."""
    _check_codes(n, m_codes, v_codes, m_scales, v_scales, block=Q4BLOCK, codes=n_codes4(n))
    m32, v32 = torch.empty(n), torch.empty(n)
    ext().q4_decode(m32.data_ptr(), v32.data_ptr(), m_codes.data_ptr(), v_codes.data_ptr(),
                    m_scales.data_ptr(), v_scales.data_ptr(), n, Q4BLOCK)
    return m32, v32


def _check_codes(n, m_codes, v_codes, m_scales, v_scales, *, block=QBLOCK, codes=None) -> None:
    codes = n if codes is None else codes
    for name, t, dtype, numel in (("m_codes", m_codes, torch.uint8, codes),
                                  ("v_codes", v_codes, torch.uint8, codes),
                                  ("m_scales", m_scales, torch.float32, n_blocks(n, block)),
                                  ("v_scales", v_scales, torch.float32, n_blocks(n, block))):
        if t.dtype != dtype or t.device.type != "cpu" or t.dim() != 1 or \
                not t.is_contiguous() or t.numel() < numel:
            raise ValueError(f"{name} must be a contiguous 1-D {dtype} CPU tensor of at least "
                             f"{numel} elements, got {t.dtype} {tuple(t.shape)} on {t.device}")


class MomentFormat:
    """How the host stores both Adam moments: one object per ``state_dtype``, read by the
    layout (alignment, the betas it allows), the host state (buffers, encode / decode), the
    update and the memory arithmetic, instead of each comparing the name."""

    name: str
    dtype: torch.dtype  # of the exp_avg / exp_avg_sq buffers
    align = 1  # elements: every param of a bucket starts on a multiple of this
    block = 1  # elements per block scale (scaled formats)
    scaled = False  # block scales beside the codes (n_scales(n) fp32 per moment)

    def bytes_per_element(self) -> float:
        """Host bytes per element of both moments together, block scales included."""
        return 2 * self.dtype.itemsize

    def n_scales(self, n: int) -> int:
        return 0

    def storage(self, n: int) -> int:
        """Length of each moment's buffer for ``n`` elements."""
        return n

    def part(self, buf: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The view of a moment buffer that stores elements [lo, hi) (``lo`` a block
        start in a scaled format)."""
        return buf[lo:hi]

    def zero(self, buf: torch.Tensor, lo: int, hi: int) -> None:
        """Zero the stored elements [lo, hi) of a moment buffer: ``lo`` follows a param's
        last element, ``hi`` is a block start (a gap between params)."""
        buf[lo:hi].zero_()

    def check_betas(self, beta1: float, beta2: float) -> None:
        """Raise for betas this format cannot train with; every format takes Adam's own."""

    def decode(self, m, v, scales, lo: int = 0, hi: int | None = None):
        """(exp_avg, exp_avg_sq) of elements [lo, hi) of moment buffers ``m``, ``v`` (hi:
        None for all of them) as fp32 tensors (views where they are fp32 already); ``lo``
        starts a block."""
        hi = self._end(m, hi)
        return self.part(m, lo, hi).float(), self.part(v, lo, hi).float()

    def encode(self, m32, v32, m, v, scales, lo: int = 0) -> None:
        """Store fp32 moments as elements [lo, lo + len) of moment buffers ``m``, ``v``
        (rounded as the format rounds; ``lo`` starts a block)."""
        hi = lo + m32.numel()
        self.part(m, lo, hi).copy_(m32)
        self.part(v, lo, hi).copy_(v32)

    def _end(self, buf, hi):
        return buf.numel() if hi is None else hi

    def __repr__(self) -> str:
        return f"MomentFormat({self.name!r})"


class _Fp32(MomentFormat):
    name, dtype = "fp32", torch.float32


class _Bf16(MomentFormat):
    name, dtype = "bf16", torch.bfloat16  # copy_ rounds to nearest even, as the kernel


class _Int8(MomentFormat):
    """Block-wise 8-bit codes, the module docstring's code; every param starts a block, so
    no block holds two params and thread chunks split on blocks (bitwise any thread count)."""

    name, dtype = "int8", torch.uint8
    align, block, scaled = QBLOCK, QBLOCK, True

    def bytes_per_element(self) -> float:
        return 2.0 + 8.0 / QBLOCK

    def n_scales(self, n: int) -> int:
        return n_blocks(n)

    def check_betas(self, beta1: float, beta2: float) -> None:
        ratio_cap(beta1, beta2, self.name)

    def decode(self, m, v, scales, lo: int = 0, hi: int | None = None):
        hi, b = self._end(m, hi), lo // QBLOCK
        return decode_moments(m[lo:hi], v[lo:hi], scales[0][b:], scales[1][b:])

    def encode(self, m32, v32, m, v, scales, lo: int = 0) -> None:
        hi, b = lo + m32.numel(), lo // QBLOCK
        encode_moments(m32, v32, m[lo:hi], v[lo:hi], scales[0][b:], scales[1][b:])

    def encode_reference(self, m32, v32):
        """(m codes, v codes, m scales, v scales) in torch ops."""
        return encode_reference(m32, v32)

    def decode_reference(self, mc, uc, sm, su, n: int):
        return decode_reference(mc, uc, sm, su)


class _Int4(MomentFormat):
    """Block-wise 4-bit codes, two per byte (the module docstring's code); every param
    starts a block, and so a byte: no byte holds two params' codes, thread chunks split on
    blocks, and a param's codes are a slice of the buffer."""

    name, dtype = "int4", torch.uint8
    align, block, scaled = Q4BLOCK, Q4BLOCK, True

    def bytes_per_element(self) -> float:
        return 1.0 + 8.0 / Q4BLOCK

    def n_scales(self, n: int) -> int:
        return n_blocks(n, Q4BLOCK)

    def storage(self, n: int) -> int:
        return n_codes4(n)

    def part(self, buf, lo: int, hi: int):
        if lo % 2:
            raise ValueError(f"4-bit moments: element {lo} does not start a byte")
        return buf[lo // 2:n_codes4(hi)]

    def zero(self, buf, lo: int, hi: int) -> None:
        # a byte shared with the element before lo is written by that param's encode
        buf[n_codes4(lo):n_codes4(hi)].zero_()

    def check_betas(self, beta1: float, beta2: float) -> None:
        ratio_cap(beta1, beta2, self.name)

    def _end(self, buf, hi):
        return 2 * buf.numel() if hi is None else hi

    def decode(self, m, v, scales, lo: int = 0, hi: int | None = None):
        hi, b = self._end(m, hi), lo // Q4BLOCK
        return decode_moments4(self.part(m, lo, hi), self.part(v, lo, hi), scales[0][b:],
                               scales[1][b:], hi - lo)

    def encode(self, m32, v32, m, v, scales, lo: int = 0) -> None:
        hi, b = lo + m32.numel(), lo // Q4BLOCK
        encode_moments4(m32, v32, self.part(m, lo, hi), self.part(v, lo, hi), scales[0][b:],
                        scales[1][b:])

    def encode_reference(self, m32, v32):
        return encode_reference4(m32, v32)

    def decode_reference(self, mc, uc, sm, su, n: int):
        return decode_reference4(mc, uc, sm, su, n)


FORMATS: dict[str, MomentFormat] = {f.name: f for f in (_Fp32(), _Bf16(), _Int8(), _Int4())}


def moment_format(state_dtype) -> MomentFormat:
    """The format named ``state_dtype``; one clear error for any other value."""
    if isinstance(state_dtype, MomentFormat):
        return state_dtype
    if state_dtype not in FORMATS:
        raise ValueError(f"state_dtype must be one of {', '.join(FORMATS)}, "
                         f"got {state_dtype!r}")
    return FORMATS[state_dtype]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64)


def _float(bits: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit patterns (held in int64) as floats."""
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def _per_element(scales: torch.Tensor, n: int, block: int = QBLOCK) -> torch.Tensor:
    return scales.repeat_interleave(block)[:n]


def _code(y: torch.Tensor, mbits: int, bias: int, top: int) -> torch.Tensor:
    u, sh = _bits(y), 23 - mbits
    k = ((u + (1 << (sh - 1))) >> sh) - bias  # to nearest, ties away from zero
    return k.clamp(0, top)


def _value(k: torch.Tensor, mbits: int, bias: int) -> torch.Tensor:
    return torch.where(k > 0, _float((k + bias) << (23 - mbits)), 0.0)


def _scales(x: torch.Tensor, block: int = QBLOCK) -> torch.Tensor:
    n = x.numel()
    padded = torch.zeros(n_blocks(n, block) * block, dtype=torch.int64)
    padded[:n] = _bits(x) & 0x7FFFFFFF
    top = padded.view(-1, block).amax(dim=1)  # integer max: NaN wins, as in the kernel
    return torch.where(top < 0x00800000, 0.0, _float(top))


def encode_reference(m: torch.Tensor, v: torch.Tensor):
    """fp32 ``exp_avg``, ``exp_avg_sq`` -> (m codes, u codes, m scales, u scales)."""
    n = m.numel()
    # correctly rounded, as the kernel's sqrtf (torch's fp32 sqrt on the CPU can be an ulp
    # off); a double's 53 bits make rounding it to fp32 afterwards exact for sqrt
    u = v.double().sqrt().float()
    sm, su = _scales(m), _scales(u)
    im = torch.where(sm == 0, 0.0, 1.0 / sm)
    iu = torch.where(su == 0, 0.0, 1.0 / su)
    km = _code(m.abs() * _per_element(im, n), _M_BITS, _M_BIAS, _M_TOP)
    km = km | torch.where((km > 0) & (_bits(m) < 0), 0x80, 0)  # zero has one code
    ku = _code(u * _per_element(iu, n), _U_BITS, _U_BIAS, _U_TOP)
    return km.to(torch.uint8), ku.to(torch.uint8), sm, su


def decode_reference(mc: torch.Tensor, uc: torch.Tensor, sm: torch.Tensor, su: torch.Tensor):
    """(m codes, u codes, m scales, u scales) -> fp32 ``exp_avg``, ``exp_avg_sq``."""
    n = mc.numel()
    c = mc.to(torch.int64)
    mag = _value(c & 0x7F, _M_BITS, _M_BIAS) * _per_element(sm, n)
    m = _float(_bits(mag) | ((c & 0x80) << 24))
    u = _value(uc.to(torch.int64), _U_BITS, _U_BIAS) * _per_element(su, n)
    return m, u * u


def _pack(k: torch.Tensor) -> torch.Tensor:
    """4-bit codes (int64) -> bytes, element 2j in the low nibble of byte j (an odd count's
    last high nibble 0)."""
    padded = torch.zeros(n_codes4(k.numel()) * 2, dtype=torch.int64)
    padded[:k.numel()] = k
    pairs = padded.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def _unpack(b: torch.Tensor, n: int) -> torch.Tensor:
    b = b.to(torch.int64)
    return torch.stack([b & 15, b >> 4], dim=1).reshape(-1)[:n]


def encode_reference4(m: torch.Tensor, v: torch.Tensor):
    """fp32 ``exp_avg``, ``exp_avg_sq`` -> (m codes, u codes, m scales, u scales), 4 bits."""
    n = m.numel()
    u = v.double().sqrt().float()  # correctly rounded, as sqrtf (see encode_reference)
    sm, su = _scales(m, Q4BLOCK), _scales(u, Q4BLOCK)
    im = torch.where(sm == 0, 0.0, 1.0 / sm)
    iu = torch.where(su == 0, 0.0, 1.0 / su)
    km = _code(m.abs() * _per_element(im, n, Q4BLOCK), _Q4M_BITS, _Q4M_BIAS, _Q4M_TOP)
    km = km | torch.where((km > 0) & (_bits(m) < 0), 8, 0)  # zero has one code
    ku = _code(u * _per_element(iu, n, Q4BLOCK), _Q4U_BITS, _Q4U_BIAS, _Q4U_TOP)
    return _pack(km), _pack(ku), sm, su


def decode_reference4(mc: torch.Tensor, uc: torch.Tensor, sm: torch.Tensor, su: torch.Tensor,
                      n: int):
    """4-bit (m codes, u codes, m scales, u scales) of ``n`` elements -> fp32 ``exp_avg``,
    ``exp_avg_sq``."""
    c = _unpack(mc, n)
    mag = _value(c & 7, _Q4M_BITS, _Q4M_BIAS) * _per_element(sm, n, Q4BLOCK)
    m = _float(_bits(mag) | ((c & 8) << 28))
    u = _value(_unpack(uc, n), _Q4U_BITS, _Q4U_BIAS) * _per_element(su, n, Q4BLOCK)
    return m, u * u
