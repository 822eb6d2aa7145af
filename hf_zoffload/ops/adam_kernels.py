"""One-pass CPU-Adam over flat host buffers: the compiled kernel's Python face, and the plain
torch reference beside it (the ground truth of the tests).

The kernel reads the 16-bit (or fp32) gradient, scales it by ``grad_scale`` (the engine folds
``inv_loss_scale * clip_coef`` in here), updates master/exp_avg/exp_avg_sq in place and
optionally writes the new parameters rounded to fp16/bf16, all in one pass: 28 B/param with
16-bit grads and output, against 40 B for the composed torch path (docs/design.md, "Data flow").

Numerics follow torch's single-tensor Adam/AdamW on CPU op for op (same fp32 roundings, FMA at
the same places), so results agree with torch.optim.AdamW to within a few fp32 ulps; see
tests/ops/test_adam_kernels.py for the stated tolerance.  The 16-bit output is round to nearest
even, bit-equal to ``master.to(dtype)`` for every non-NaN value (inf, ties and subnormals included).
A NaN becomes a quiet NaN with the same sign and top payload bits, which is what F16C and
AVX512-BF16 hardware write; torch's own bf16 conversion writes 0xFFFF from its AVX2 body and
0x7FC0 from its scalar path, so NaN is matched as NaN, not bit for bit, for bf16.
"""

from __future__ import annotations

import bisect
import functools
import math
import numbers
import struct
import warnings
from typing import NamedTuple

import torch

from ._native import ext as _ext
from .masters import MASK32, round_sr_reference
from .moments import FORMATS, MomentFormat, moment_format, ratio_cap

__all__ = [
    "adam_update",
    "adam_update_many",
    "check_hyper",
    "adam_update_reference",
    "compiled_features",
    "cpu_features",
    "openmp_available",
]

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float16, torch.bfloat16)
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)  # moments: fp32, bf16, codes
_BY_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "int8"}
_ISA_FLAGS = ("avx2", "avx512f", "f16c", "avx512_bf16")


def openmp_available() -> bool:
    """True when the kernel was compiled with OpenMP (else it runs on one thread)."""
    return _ext().openmp_compiled()


@functools.cache
def cpu_features() -> dict[str, bool]:
    """SIMD features of this CPU that the kernel can use, from /proc/cpuinfo."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:  # not Linux: only what torch's dispatcher reports
        cap = torch.backends.cpu.get_cpu_capability()
        flags = {"avx2", "f16c"} if cap.startswith("AVX") else set()
        flags |= {"avx512f"} if cap.startswith("AVX512") else set()
    return {name: name in flags for name in _ISA_FLAGS}


def compiled_features() -> dict[str, bool]:
    """Instruction sets used by the kernel variant that runs here, plus how it was built.

    Keys: avx2, avx512f, f16c (hardware fp16 conversion), avx512_bf16 (hardware bf16
    conversion), openmp, portable_build.
    """
    ext = _ext()
    feats = dict(ext.variant_features(ext.VARIANTS["auto"]))
    feats["openmp"] = ext.openmp_compiled()
    feats["portable_build"] = ext.portable_build()
    return feats


@functools.cache
def _checked_variant() -> str:
    """The auto variant, after checking a -march=native build still fits this CPU."""
    ext = _ext()
    if not ext.portable_build():
        have = cpu_features()
        missing = [k for k, v in ext.variant_features(ext.VARIANTS["native"]).items()
                   if v and not have[k]]
        if missing:
            raise RuntimeError(
                f"hf_zoffload's CPU-Adam was built with -march=native for a CPU with "
                f"{', '.join(missing)}, which this CPU lacks. Rebuild here, or build portable "
                f"wheels with HF_ZOFFLOAD_PORTABLE_BUILD=1."
            )
    if not ext.openmp_compiled():
        warnings.warn(
            "hf_zoffload's CPU-Adam was built without OpenMP and runs on one thread; rebuild "
            "with a compiler that accepts -fopenmp for a parallel update.",
            RuntimeWarning,
            stacklevel=4,  # the caller of adam_update
        )
    return ext.auto_variant()


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _check_real(name, x, *, low=None, high=None, high_open=False, where=""):
    if isinstance(x, torch.Tensor) and x.numel() == 1:  # e.g. a scheduler's tensor lr
        x = x.item()
    name = f"{name} of {where}" if where else name
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if low is not None and x < low:
        raise ValueError(f"{name} must be >= {low}, got {x}")
    if high is not None and (x >= high if high_open else x > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {x}")
    return x


def check_hyper(lr, betas, eps, weight_decay, *, where: str = "",
                beta_names=("betas[0]", "betas[1]")) -> tuple[float, ...]:
    """The one validator of Adam's hyperparameters (the kernel, CPUAdam and the offload
    engine all call it): ``(lr, beta1, beta2, eps, weight_decay)`` as floats, or one
    TypeError / ValueError naming the value (the betas as ``beta_names``: the kernel takes
    them as two arguments) and ``where`` it came from."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas{' of ' + where if where else ''} must be a pair "
                         f"(beta1, beta2), got {betas!r}")
    return (
        _check_real("lr", lr, low=0.0, where=where),
        _check_real(beta_names[0], betas[0], low=0.0, high=1.0, high_open=True, where=where),
        _check_real(beta_names[1], betas[1], low=0.0, high=1.0, high_open=True, where=where),
        _check_real("eps", eps, low=0.0, where=where),
        _check_real("weight_decay", weight_decay, low=0.0, where=where),
    )


def _check_buffer(name, t, dtypes, numel=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {names}, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (a flat buffer), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, master has {numel}")


def _format_of(exp_avg, state_dtype) -> MomentFormat:
    """The moment format of a call: ``state_dtype`` if given (it must store in exp_avg's
    dtype), else the one of exp_avg's dtype (uint8: int8)."""
    if state_dtype is None:
        if isinstance(exp_avg, torch.Tensor) and exp_avg.dtype in _BY_DTYPE:
            return FORMATS[_BY_DTYPE[exp_avg.dtype]]
        _check_buffer("exp_avg", exp_avg, _STATE_DTYPES)  # raises, naming the dtype
    fmt = moment_format(state_dtype)
    _check_buffer("exp_avg", exp_avg, (fmt.dtype,))
    return fmt


def _check_args(master, grad, exp_avg, exp_avg_sq, out16, *, step, lr, beta1, beta2, eps,
                weight_decay, grad_scale, adamw_mode, bias_correction, num_threads,
                scales=None, state_dtype=None, sr=None):
    """Validate everything before any work; returns the scalars as floats."""
    _check_buffer("master", master, (torch.float32, torch.bfloat16))
    n = master.numel()
    if master.dtype == torch.bfloat16:
        if not (isinstance(sr, (tuple, list)) and len(sr) == 2 and
                all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MASK32
                    for k in sr)):
            raise ValueError("a bf16 master is rounded stochastically and needs sr=(key, "
                             "index of element 0), two ints in [0, 2**32), got " + repr(sr))
        if out16 is not None and out16.dtype != torch.bfloat16:
            raise TypeError(f"out16 of a bf16 master must be bf16 (the master is what goes "
                            f"up), got {out16.dtype}")
    elif sr is not None:
        raise ValueError("sr is for a bf16 master (stochastic rounding); master is float32")
    _check_buffer("grad", grad, _GRAD_DTYPES, n)
    fmt = _format_of(exp_avg, state_dtype)
    if fmt.storage(n) != n:  # 4-bit codes: two per byte
        for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            _check_buffer(name, t, (fmt.dtype,))
            if t.numel() != fmt.storage(n):
                raise ValueError(f"{name} has {t.numel()} bytes; {n} elements of "
                                 f"state_dtype={fmt.name!r} need {fmt.storage(n)}")
    else:
        _check_buffer("exp_avg", exp_avg, (fmt.dtype,), n)
        _check_buffer("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,), n)
    named = [("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if fmt.scaled:
        if not isinstance(scales, (tuple, list)) or len(scales) != 2:
            raise ValueError(f"{fmt.name} moments need scales=(exp_avg scales, "
                             f"exp_avg_sq scales), got {scales!r}")
        for name, t in zip(("scales[0]", "scales[1]"), scales):
            _check_buffer(name, t, (torch.float32,))
            if t.numel() != fmt.n_scales(n):
                raise ValueError(f"{name} has {t.numel()} elements; {n} elements in blocks "
                                 f"of {fmt.block} need {fmt.n_scales(n)}")
        named += [("scales[0]", scales[0]), ("scales[1]", scales[1])]
    elif scales is not None:
        raise ValueError(f"scales are for 8- and 4-bit moments; exp_avg is {exp_avg.dtype}")
    if out16 is not None:
        _check_buffer("out16", out16, _OUT_DTYPES, n)
        # the output may be the 16-bit grad buffer itself: each grad is read before its
        # param is written there
        if not (out16.data_ptr() == grad.data_ptr() and out16.dtype == grad.dtype):
            named.append(("out16", out16))
    if n:
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), nm)
                       for nm, t in named)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise ValueError(f"{a} and {b} overlap in memory; every buffer must be distinct")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an int >= 1 (Adam counts from 1), got {step!r}")
    for name, flag in (("adamw_mode", adamw_mode), ("bias_correction", bias_correction)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ValueError(f"num_threads must be None or an int >= 1, got {num_threads!r}")
    hyper = check_hyper(lr, (beta1, beta2), eps, weight_decay, beta_names=("beta1", "beta2"))
    fmt.check_betas(hyper[1], hyper[2])
    return (*hyper, _check_real("grad_scale", grad_scale))


def adam_update(master, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0,
                adamw_mode: bool = True, bias_correction: bool = True,
                out16: torch.Tensor | None = None, num_threads: int | None = None,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                state_dtype: str | None = None, sr: tuple[int, int] | None = None) -> None:
    """One Adam/AdamW step over flat CPU buffers, in one compiled pass (GIL released).

    master: 1-D contiguous fp32, updated in place; or bf16 (`hf_zoffload.ops.masters`),
    updated in fp32 and rounded back stochastically with ``sr=(key, first)``: element i's
    random bits from ``key`` and ``first + i`` (``masters.step_key``), out16 then bf16.
    exp_avg, exp_avg_sq: 1-D contiguous, both fp32, both bf16 (rounded to nearest even after
    the update) or both uint8: the 8-bit block codes of `hf_zoffload.ops.moments`, with
    ``scales`` their two fp32 block-scale buffers, or with ``state_dtype="int4"`` its 4-bit
    codes, two per byte (``ceil(n / 2)`` bytes each).
    state_dtype: None takes the format from exp_avg's dtype (uint8: int8).
    grad: 1-D contiguous fp32/fp16/bf16, multiplied by ``grad_scale`` inside the pass.
    adamw_mode: decoupled decay (p *= 1 - lr*wd); else L2 (g += wd*p).  out16: optional
    fp16/bf16 buffer that receives the new master rounded to nearest even; it may be ``grad``
    itself.  num_threads: None means torch.get_num_threads().  Results are bitwise identical
    for any num_threads and any split of the buffers (8- and 4-bit moments: any split on a
    block).
    """
    _update(master, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, adamw_mode=adamw_mode,
            bias_correction=bias_correction, out16=out16, num_threads=num_threads,
            scales=scales, state_dtype=state_dtype, sr=sr)


def _update(master, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
            grad_scale=1.0, adamw_mode=True, bias_correction=True, out16=None, num_threads=None,
            variant="auto", scales=None, state_dtype=None, sr=None):
    """adam_update with a choice of compiled variant (tests compare them bit for bit)."""
    lr, beta1, beta2, eps, wd, gs = _check_args(
        master, grad, exp_avg, exp_avg_sq, out16, step=step, lr=lr, beta1=beta1, beta2=beta2,
        eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, adamw_mode=adamw_mode,
        bias_correction=bias_correction, num_threads=num_threads, scales=scales,
        state_dtype=state_dtype, sr=sr)
    ext = _ext()
    _checked_variant()
    if variant not in ext.VARIANTS or not ext.variant_available(ext.VARIANTS[variant]):
        raise ValueError(f"kernel variant {variant!r} is not available here")
    adam_update_unchecked(master, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                          beta2=beta2, eps=eps, weight_decay=wd, grad_scale=gs,
                          adamw_mode=adamw_mode, bias_correction=bias_correction, out16=out16,
                          num_threads=num_threads, variant=variant, scales=scales,
                          state_dtype=_format_of(exp_avg, state_dtype).name, sr=sr)


_STATE_KIND = {"fp32": 0, "bf16": 2, "int8": 4, "int4": 5}  # adam_kernel.h's kinds


def adam_update_unchecked(master, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
                          weight_decay, grad_scale=1.0, adamw_mode=True, bias_correction=True,
                          out16=None, num_threads=None, variant="auto", scales=None,
                          qblock=None, state_dtype=None, sr=None):
    """`adam_update` without the argument checks, for a caller that validated its buffers
    once and calls many times (the engine: one call per param on the CPU, where the checks
    cost ~100 us a call, ~15 ms a step for GPT-2's 148 params). Bad arguments here are
    undefined behaviour: use `adam_update` anywhere else."""
    ext = _ext()
    wd = weight_decay
    n = master.numel()
    if n == 0:
        return
    fmt = FORMATS[state_dtype or _BY_DTYPE[exp_avg.dtype]]
    qblock = fmt.block if qblock is None else qblock
    ext.adam_step(
        master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
        0 if out16 is None else out16.data_ptr(), n,
        {torch.float32: ext.FLOAT32, torch.float16: ext.FLOAT16,
         torch.bfloat16: ext.BFLOAT16}[grad.dtype],
        ext.NO_OUTPUT if out16 is None else
        {torch.float16: ext.FLOAT16, torch.bfloat16: ext.BFLOAT16}[out16.dtype],
        *_kernel_scalars(step, lr, beta1, beta2, eps, wd, grad_scale, adamw_mode,
                         bias_correction),
        torch.get_num_threads() if num_threads is None else num_threads,
        ext.VARIANTS[variant], _STATE_KIND[fmt.name],
        0 if scales is None else scales[0].data_ptr(),
        0 if scales is None else scales[1].data_ptr(), qblock,
        1.0 / ratio_cap(beta1, beta2) if scales is not None else 0.0, beta1, beta2**0.5,
        master.data_ptr() if sr is not None else 0, *(sr or (0, 0)),
    )


def _kernel_scalars(step, lr, beta1, beta2, eps, wd, gs, adamw_mode, bias_correction):
    """adam_step's scalars, exactly as torch derives them in double before its kernels round
    them to fp32: (l2_on, lerp_small, grad_scale, decay, l2, lerp_coef, beta2, 1 - beta2,
    1 / sqrt(bc2), eps, -lr / bc1)."""
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    weight = _f32(1.0 - beta1)  # torch.lerp picks its formula on the fp32 weight
    small = abs(weight) < 0.5
    return (bool(not adamw_mode and wd != 0.0), small, gs, 1.0 - lr * wd if adamw_mode else 1.0,
            wd, weight if small else weight - 1.0, beta2, 1.0 - beta2, 1.0 / bc2**0.5, eps,
            -(lr / bc1))


_HYPER_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay", "adamw_mode", "bias_correction")
_GRAD_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # adam_kernel.h's kinds
_WRITTEN = ("param", "exp_avg", "exp_avg_sq")


class ManyBuffers(NamedTuple):
    """The buffers of one `adam_update_many` call, their addresses read once: ``ptrs`` holds
    param, exp_avg, exp_avg_sq and grad of tensor i at 4 i .. 4 i + 3; ``ns`` the element
    counts, ``grad_kinds`` the kernel's grad kinds, ``grad_sizes`` bytes per grad element."""

    ptrs: list
    ns: list
    grad_kinds: list
    grad_sizes: list


def many_buffers(params, grads, exp_avgs, exp_avg_sqs) -> ManyBuffers:
    ptrs, ns, kinds, sizes = [], [], [], []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        ptrs += (p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr())
        ns.append(p.numel())
        kinds.append(_GRAD_KIND[g.dtype])
        sizes.append(g.element_size())
    return ManyBuffers(ptrs, ns, kinds, sizes)


def check_disjoint(bufs: ManyBuffers, where) -> None:
    """ValueError unless no param, exp_avg or exp_avg_sq of ``bufs`` shares a byte with
    another one or with a grad (grads may share memory with each other: one flat grad
    buffer's views).  where(i) names tensor i in the message."""
    ptrs, ns = bufs.ptrs, bufs.ns
    spans = sorted((ptrs[j], ptrs[j] + 4 * ns[j // 4], j) for j in range(len(ptrs))
                   if j % 4 != 3 and ns[j // 4])

    def name(j):
        return f"{_WRITTEN[j % 4]} of {where(j // 4)}"

    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{name(a)} and {name(b)} overlap in memory; every written "
                             "buffer must be distinct")
    starts = [sp[0] for sp in spans]
    for i, n in enumerate(ns):
        if not n:
            continue
        lo = ptrs[4 * i + 3]
        # the written spans are disjoint and sorted: of those starting before the grad's end,
        # only the last can reach past its start
        j = bisect.bisect_left(starts, lo + n * bufs.grad_sizes[i]) - 1
        if j >= 0 and spans[j][1] > lo:
            raise ValueError(f"grad of {where(i)} and {name(spans[j][2])} overlap in memory; "
                             "a grad must not share memory with a written buffer")


def _check_many_tensor(name, t, dtypes, numel=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a dense contiguous CPU tensor, got layout {t.layout}, "
                         f"device {t.device}, stride {t.stride()}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {names}, got {t.dtype}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, its param {numel}")


def check_many_hyper(h: dict, where: str) -> None:
    """One `adam_update_many` hypers dict: exactly its keys, each value as adam_update
    takes it; else TypeError / ValueError naming the value and ``where``."""
    if not isinstance(h, dict) or set(h) != set(_HYPER_KEYS):
        raise ValueError(f"hypers of {where} must be a dict of exactly "
                         f"{', '.join(_HYPER_KEYS)}, got {h!r}")
    check_hyper(h["lr"], (h["beta1"], h["beta2"]), h["eps"], h["weight_decay"], where=where,
                beta_names=("beta1", "beta2"))
    for flag in ("adamw_mode", "bias_correction"):
        if not isinstance(h[flag], bool):
            raise TypeError(f"{flag} of {where} must be a bool, got {h[flag]!r}")


def adam_update_many(params, grads, exp_avgs, exp_avg_sqs, *, steps, hypers, names=None,
                     num_threads: int | None = None) -> None:
    """Many fp32 `adam_update` calls (fp32 moments, no 16-bit output) in one compiled pass.

    Tensor i (any shape, contiguous, on the CPU): params[i] fp32, grads[i] fp32/fp16/bf16,
    exp_avgs[i] and exp_avg_sqs[i] fp32, all of params[i]'s numel, updated in place at Adam
    step steps[i] with hypers[i], a dict of adam_update's lr, beta1, beta2, eps, weight_decay,
    adamw_mode and bias_correction (one dict object may serve many tensors: it is checked
    once).  All the tensors run in one parallel region, the threads splitting their elements
    laid end to end; the result is bitwise that of one adam_update per tensor, for any
    num_threads.  No param or moment may share memory with another buffer (grads may share
    memory with each other).  names[i], if given, names tensor i in errors."""
    k = len(params)
    seqs = (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
            ("steps", steps), ("hypers", hypers)) + ((("names", names),) if names else ())
    for what, seq in seqs:
        if len(seq) != k:
            raise ValueError(f"{what} has {len(seq)} entries, params {k}")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ValueError(f"num_threads must be None or an int >= 1, got {num_threads!r}")

    def where(i):
        return names[i] if names else f"tensor {i}"

    checked = set()
    for i in range(k):
        if id(hypers[i]) not in checked:
            check_many_hyper(hypers[i], where(i))
            checked.add(id(hypers[i]))
        s = steps[i]
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise ValueError(f"step of {where(i)} must be an int >= 1 (Adam counts from 1), "
                             f"got {s!r}")
        _check_many_tensor(f"param of {where(i)}", params[i], (torch.float32,))
        n = params[i].numel()
        _check_many_tensor(f"grad of {where(i)}", grads[i], _GRAD_DTYPES, n)
        _check_many_tensor(f"exp_avg of {where(i)}", exp_avgs[i], (torch.float32,), n)
        _check_many_tensor(f"exp_avg_sq of {where(i)}", exp_avg_sqs[i], (torch.float32,), n)
    bufs = many_buffers(params, grads, exp_avgs, exp_avg_sqs)
    check_disjoint(bufs, where)
    _checked_variant()
    adam_update_many_unchecked(bufs, steps=steps, hypers=hypers, num_threads=num_threads)


def bump_steps(steps) -> list[int]:
    """torch._foreach_add_(steps, 1.0), then each step as an int (CPUAdam's step counts).
    Over 0-dim float32 CPU tensors, torch.optim's own steps, one compiled loop through their
    addresses: torch's _foreach_add_ over 201 scalars (a Llama's param list) took ~420 us and
    the stack to a list ~95 us, a third of a step's 1.5 ms of bookkeeping on 2 Zen 3 cores;
    any other step (float64 from a float64 default dtype) takes torch's ops."""
    if all(type(t) is torch.Tensor and t.dtype is torch.float32 and t.is_cpu
           and t.dim() == 0 for t in steps):
        counts = _ext().bump_steps([t.data_ptr() for t in steps])
        torch.autograd.graph.increment_version(steps)  # as the in-place add would
        return counts
    torch._foreach_add_(steps, 1.0)
    return [int(c) for c in torch.stack(steps).tolist()]


def adam_update_many_unchecked(bufs: ManyBuffers, *, steps, hypers, num_threads=None,
                               variant="auto") -> None:
    """`adam_update_many` over `many_buffers`, without its checks (CPUAdam checks its params
    itself). Bad arguments here are undefined behaviour."""
    ext = _ext()
    which, scalars, index = [], [], {}
    for s, h in zip(steps, hypers):
        key = (id(h), s)
        w = index.get(key)
        if w is None:
            w = index[key] = len(scalars)
            scalars.append(_kernel_scalars(s, h["lr"], h["beta1"], h["beta2"], h["eps"],
                                           h["weight_decay"], 1.0, h["adamw_mode"],
                                           h["bias_correction"]))
        which.append(w)
    ext.adam_step_many(bufs.ptrs, bufs.ns, bufs.grad_kinds, which, scalars,
                       torch.get_num_threads() if num_threads is None else num_threads,
                       ext.VARIANTS[variant])


def adam_update_reference(master, grad, exp_avg, exp_avg_sq, *, step: int, lr: float,
                          beta1: float, beta2: float, eps: float, weight_decay: float,
                          grad_scale: float = 1.0, adamw_mode: bool = True,
                          bias_correction: bool = True, out16: torch.Tensor | None = None,
                          num_threads: int | None = None,
                          scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                          state_dtype: str | None = None,
                          sr: tuple[int, int] | None = None) -> None:
    """adam_update in plain torch ops, as torch.optim.Adam(W)'s single-tensor path writes them.

    Same validation and signature; num_threads is checked but has no effect on the result
    (every op is elementwise), so it does not change torch's global thread setting. bf16
    moments are widened, updated as fp32 ones and rounded back. 8- and 4-bit moments follow
    the kernel op for op (the format's ``decode_reference``, the capped update, its
    ``encode_reference``), so kernel and reference agree bit for bit there. A bf16 master is
    widened, updated as an fp32 one and rounded back with `masters.round_sr_reference`.
    """
    lr, beta1, beta2, eps, wd, gs = _check_args(
        master, grad, exp_avg, exp_avg_sq, out16, step=step, lr=lr, beta1=beta1, beta2=beta2,
        eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, adamw_mode=adamw_mode,
        bias_correction=bias_correction, num_threads=num_threads, scales=scales,
        state_dtype=state_dtype, sr=sr)
    if master.dtype == torch.bfloat16:
        p32 = master.float()
        adam_update_reference(p32, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                              beta2=beta2, eps=eps, weight_decay=wd, grad_scale=gs,
                              adamw_mode=adamw_mode, bias_correction=bias_correction,
                              scales=scales, state_dtype=state_dtype)
        master.copy_(round_sr_reference(p32, *sr))
        if out16 is not None:
            out16.copy_(master)
        return
    fmt = _format_of(exp_avg, state_dtype)
    if fmt.name != "fp32":
        _reference_compact(fmt, master, grad, exp_avg, exp_avg_sq, scales, out16, step=step, lr=lr,
                           beta1=beta1, beta2=beta2, eps=eps, wd=wd, gs=gs,
                           adamw_mode=adamw_mode, bias_correction=bias_correction)
        return
    with torch.no_grad():
        g = grad.float().mul(gs)  # a new tensor even for fp32 grads: grad is never written
        if wd != 0.0:
            if adamw_mode:
                master.mul_(1.0 - lr * wd)
            else:
                g = g.add(master, alpha=wd)
        exp_avg.lerp_(g, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bc1 = 1.0 - beta1**step if bias_correction else 1.0
        bc2 = 1.0 - beta2**step if bias_correction else 1.0
        denom = (exp_avg_sq.sqrt() / bc2**0.5).add_(eps)
        master.addcdiv_(exp_avg, denom, value=-(lr / bc1))
        if out16 is not None:
            out16.copy_(master)


@torch.no_grad()
def _reference_compact(fmt, master, grad, exp_avg, exp_avg_sq, scales, out16, *, step, lr,
                       beta1, beta2, eps, wd, gs, adamw_mode, bias_correction):
    """The reference over bf16, 8- or 4-bit moments (validated by the caller)."""
    if not fmt.scaled:
        m, v = exp_avg.float(), exp_avg_sq.float()
        adam_update_reference(master, grad, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2,
                              eps=eps, weight_decay=wd, grad_scale=gs, adamw_mode=adamw_mode,
                              bias_correction=bias_correction, out16=out16)
        exp_avg.copy_(m)  # round to nearest even
        exp_avg_sq.copy_(v)
        return
    g = grad.float().mul(gs)
    master.mul_(1.0 - lr * wd if adamw_mode else 1.0)
    if not adamw_mode and wd != 0.0:
        g = g.add(master, alpha=wd)
    # the kernel's m' = fma(1 - b1, g, b1 m), v' = fma((1 - b2) g, g, b2 v), its decayed moments
    # decoded with b1 and sqrt(b2) folded into the block scales (all four rounded to fp32)
    m, v = fmt.decode_reference(exp_avg, exp_avg_sq, scales[0] * _f32(beta1),
                                scales[1] * _f32(beta2**0.5), master.numel())
    m.addcmul_(g, torch.full_like(g, _f32(1.0 - beta1)))  # 1 * g exact: fma(g, 1 - b1, m)
    v.addcmul_(g, g, value=1.0 - beta2)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    s = v.double().sqrt().float()  # correctly rounded, as sqrtf
    cap = m.abs().mul(1.0 / ratio_cap(beta1, beta2))
    d = torch.where(cap > s, cap, s).mul(1.0 / bc2**0.5).add(eps)
    master.addcdiv_(m, d, value=-(lr / bc1))
    if out16 is not None:
        out16.copy_(master)
    codes = fmt.encode_reference(m, v)
    for dst, src in zip((exp_avg, exp_avg_sq, *scales), codes):
        dst.copy_(src)
