"""What the gpu checks of tests/gpu/ share: their figures, and an exact synthetic training.

- `finish`: a check's figures (markdown lines) go to the ``figures`` fixture
  (tests/gpu/conftest.py: printed as ``summary: `` lines, which scripts/gpu_check.sh copies
  into summary.md under the stage's name), its failures too, in bold; then the test fails if
  there were any.
- A synthetic training whose gradients are exact: params of odd sizes over several buckets,
  ``loss = sum((p.float() * c).sum())`` with constants ``c`` that are exact in the compute
  dtype, so every gradient is ``loss_scale * c`` exactly (the scale is a power of two) on any
  device and through any kernel. Two engines fed the same constants must then end every step
  with bitwise the same params, fp32 master weights and moments: the CPU-Adam runs on the host
  for both (docs/design.md, Data flow). Only the gradient norm may differ (Triton's sum of
  squares on CUDA, torch's on the CPU), so clipping is off.
- `delayed_side`: ``CudaCopier.side`` patched to queue ``torch.cuda._sleep`` on the side stream
  before every copy (and the caller queues one on the compute stream before each backward), so
  a missing wait reads or overwrites a buffer too early and the runs part.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import pytest
import torch

from hf_zoffload.config import ZeroOffloadPlugin
from hf_zoffload.offload.copier import CudaCopier
from hf_zoffload.offload.engine import ZeroOffloadOptimizer
from hf_zoffload.offload.tiers import Tier
from tests.offload._async_copier import synchronize

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# ~1 ms at an H200's 1.98 GHz boost clock (up to ~6 ms at its 345 MHz idle clock): far
# longer than any copy here (the largest bucket is 40 KiB, ~2 us), so a copy that is not
# waited for is still queued when the host or the other stream touches its buffer. About
# 1,600 delays in test_race.py's stress at 8 steps a configuration: 2 s at the boost clock.
SLEEP_CYCLES = 2_000_000


def finish(figures: list[str], lines: list[str], failures: list[str], *,
           label: str = "") -> None:
    """``lines`` and then the failures (bold) into ``figures``; fails the test if any."""
    figures.extend(lines)
    figures.extend(f"**{label}** {f}" if label else f"**{f}**" for f in failures)
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


def md_table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines: header, separator, rows (cells formatted with str)."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


# ---------------------------------------------------------------- synthetic training
# Odd sizes, some 2-D; 35,908 elements in all. With BUCKET_MB the engine makes 5 buckets, the
# (101, 199) and (8191,) params each larger than a bucket (a bucket of their own).
SHAPES = [(31, 33), (4099,), (7,), (101, 199), (333,), (2051,), (8191,), (3, 5, 7)]
SCALES = [1.0, 0.1, 3.0, 0.01, 1.0, 0.5, 0.2, 2.0]  # gradient magnitudes differ per param
BUCKET_MB = 0.0125  # 6,553 16-bit elements per bucket
WARMUP = 2  # delayed update: steps 0 and 1 are not delayed, the rest are


@dataclass(frozen=True)
class Config:
    dtype: str
    delayed: bool
    accum: int
    steps: int
    overflow_at: int | None = None  # fp16: an inf in the last micro-step of this step
    module_waits: bool = False  # the engine gets model= (ParamModel): per-module waits

    @property
    def name(self) -> str:
        return (f"{self.dtype}, delayed {'on' if self.delayed else 'off'}, "
                f"accum {self.accum}{', module waits' if self.module_waits else ''}")


def skips(step: int, micro: int, i: int) -> bool:
    """Param i gets no gradient in this micro-step: (7,) on even steps, (2051,) in the first
    micro-step of odd steps (the engine flushes such buckets at the end of backward, and with
    accumulation the param still gets a gradient later in the window)."""
    return (i == 2 and step % 2 == 0) or (i == 5 and micro == 0 and step % 2 == 1)


def make_params(device, *, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device)) for s in SHAPES]


def constants(cfg: Config, *, seed: int = 1, steps: int | None = None) -> list:
    """c[step][micro][i]: fp32 CPU tensors holding values exact in ``cfg.dtype``."""
    dt = DTYPES[cfg.dtype]
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(cfg.steps if steps is None else steps):
        per = []
        for micro in range(cfg.accum):
            cs = [(torch.randn(s, generator=g) * (0.1 * k)).to(dt).float()
                  for s, k in zip(SHAPES, SCALES)]
            if cfg.overflow_at == step and micro == cfg.accum - 1:
                cs[1].view(-1)[17] = float("inf")
            per.append(cs)
        out.append(per)
    return out


def plugin(cfg: Config) -> ZeroOffloadPlugin:
    # Scale 2^10, doubled after 2 clean steps, halved at once on an overflow: the scale moves
    # during a run, and 0.1 * 3 * 4.5 sigma * 2^13 stays far below fp16's 65504.
    return ZeroOffloadPlugin(compute_dtype=cfg.dtype, delayed_update=cfg.delayed,
                             delayed_update_warmup_steps=WARMUP, max_grad_norm=0.0,
                             bucket_size_mb=BUCKET_MB, init_scale=2.0**10, growth_interval=2,
                             hysteresis=1)


def make_engine(params, cfg: Config, **kwargs) -> ZeroOffloadOptimizer:
    """The engine over ``params``; with ``cfg.module_waits`` built with ``model=`` a
    `ParamModel` of them, which `train` then runs the loss through."""
    # two groups with different weight decay: one CPU-Adam call per group within a bucket
    groups = [{"params": params[:4], "weight_decay": 0.01},
              {"params": params[4:], "weight_decay": 0.0}]
    model = ParamModel(params) if cfg.module_waits else None
    opt = ZeroOffloadOptimizer(groups, lr=1e-2, plugin=plugin(cfg), model=model, **kwargs)
    _models[opt] = model
    return opt


_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its ParamModel


def loss_of(params, cs, step: int, micro: int) -> torch.Tensor:
    terms = [(p.float() * c).sum() for i, (p, c) in enumerate(zip(params, cs))
             if not skips(step, micro, i)]
    return torch.stack(terms).sum()


class _Term(torch.nn.Module):
    def __init__(self, p: torch.nn.Parameter, reads: list):
        super().__init__()
        self.p = p
        self._reads = reads  # the model's: what each forward read, in order

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        # A copy of the param as this forward reads it, on the compute stream: a missing
        # per-module wait shows here, since the gradient (c) does not depend on the param.
        self._reads.append(self.p.detach().clone())
        return (self.p.float() * c).sum()


class ParamModel(torch.nn.Module):
    """`loss_of` as a model, one module per param, for an engine built with ``model=``:
    each term's module then waits only for its own param's bucket before it reads it.
    ``reads`` collects each term's param as its forward read it (`snapshot` takes them)."""

    def __init__(self, params):
        super().__init__()
        self.reads: list[torch.Tensor] = []
        self.terms = torch.nn.ModuleList(_Term(p, self.reads) for p in params)

    def forward(self, cs, step: int, micro: int) -> torch.Tensor:
        return torch.stack([t(c) for i, (t, c) in enumerate(zip(self.terms, cs))
                            if not skips(step, micro, i)]).sum()


def async_problems(opt, *, pinned: bool = True) -> list[str]:
    """Why the engine's copier stack would not copy asynchronously, asked through its
    interface (`copier.Streams`, whatever classes build it): uploads never in flight at a
    forward, no bucket whose state is on the host (nothing copied), and, with ``pinned``
    (CUDA), host buffers not page-locked. Where copies cannot be in flight nothing races,
    and an equality with the CPU engine proves little."""
    streams, bad = opt.copier.streams, []
    if not streams.forwards_wait():
        bad.append(f"the engine's copies are synchronous ({type(streams).__name__}: no "
                   "upload is ever in flight at a forward)")
    host = [b for b in opt.buckets if b.tier is Tier.HOST]
    if not host:
        bad.append("no bucket's state is on the host: nothing is copied")
    if pinned and (not streams.pinned or not all(b.state.grads.grad16.is_pinned()
                                                 for b in host)):
        bad.append("host buffers are not pinned (pinning failed?): copies are synchronous "
                   "and the race check proves nothing")
    return bad


class LateReads:
    """Reads of the params after a step that do not make the compute stream wait for the
    uploads: with per-module waits (``model=``) a read after ``finish_uploads()`` would
    leave the next forward's ``wait_ready`` nothing to wait for, and the stress (and the
    CUDA sanitizer) blind to a missing one. The copies are queued through the engine's own
    copier stack (`Streams.queue_on_side`): on CUDA on its side stream behind the uploads
    queued so far, the later uploads behind them; on the test suite's `AsyncCopier` a job
    behind the uploads on its worker; on the CPU at once. `settle()` before the copies are
    read."""

    def __init__(self, opt):
        self.opt, self.streams = opt, opt.copier.streams

    def read(self, tensors) -> list[torch.Tensor]:
        tensors, pin = [t.detach() for t in tensors], self.streams.pinned
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
        self.streams.queue_on_side(
            lambda: [o.copy_(t, non_blocking=pin) for o, t in zip(out, tensors)])
        return out

    def settle(self) -> None:
        if self.opt.device.type == "cuda":
            torch.cuda.synchronize(self.opt.device)
        else:
            synchronize(self.opt)  # the stand-in's worker; nothing for the CPU's copier


def snapshot(opt, params, reader: LateReads) -> dict:
    model = _models.get(opt)
    if model is None:  # no forward waits: the reads below make the device wait for all
        opt.copier.streams.finish_uploads()
        snap = {"params": [p.detach().to("cpu", copy=True) for p in params]}
    else:
        snap = {"params": reader.read(params), "forward": list(model.reads)}
        model.reads.clear()
    snap.update(skipped=opt.last_step_skipped, scale=opt.loss_scaler.loss_scale,
                norm=opt.grad_norm)
    if not opt.update_in_flight:  # a delayed update's thread may be writing the host state
        snap["host"] = [{k: v.clone() for k, v in opt.host_views(p).items()} for p in params]
    return snap


def train(opt, params, consts, *, device, no_sync=None, compute_sleep: int = 0,
          first_step: int = 0) -> list[dict]:
    """Run ``consts`` (c[step][micro][i]) through ``opt``; a snapshot after every step and one
    after the final ``flush()`` (with ``model=``, also the params each forward read).
    ``no_sync(step, micro)``: that backward runs inside ``opt.no_sync()``.
    ``compute_sleep``: cycles queued on the compute stream before each backward (CUDA), so
    hooks' writes land late."""
    consts = [[[c.to(device) for c in cs] for cs in per] for per in consts]
    reader, model = LateReads(opt), _models.get(opt)
    trace = []
    for k, per in enumerate(consts):
        step = first_step + k
        for micro, cs in enumerate(per):
            quiet = no_sync is not None and no_sync(step, micro)
            with opt.no_sync() if quiet else contextlib.nullcontext():
                if compute_sleep:
                    torch.cuda._sleep(compute_sleep)
                opt.backward(loss_of(params, cs, step, micro) if model is None
                             else model(cs, step, micro))
        opt.step()
        opt.zero_grad()  # what loops do next; must not wait for a delayed update
        trace.append(snapshot(opt, params, reader))
    opt.flush()
    trace.append(snapshot(opt, params, reader))
    reader.settle()
    if device != "cpu":
        torch.cuda.synchronize()  # the forwards' copies ran on the compute stream
    for snap in trace:
        snap["params"] = [t.cpu() for t in snap["params"]]
        if "forward" in snap:
            snap["forward"] = [t.cpu() for t in snap["forward"]]
    return trace


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 != 0.0 and a nan equals the same nan."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _describe(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    n = int((bits(a) != bits(b)).sum())
    diff = float((a.double() - b.double()).abs().nan_to_num().max()) if a.numel() else 0.0
    return f"{n} of {a.numel()} elements differ, max |diff| {diff:.3g}"


def compare(ref: list[dict], got: list[dict], *, limit: int = 20) -> list[str]:
    """Every difference between two traces of `train` but the norm, as readable lines (at
    most ``limit``); empty when they are bitwise equal."""
    bad = []
    if len(ref) != len(got):
        return [f"{len(ref)} snapshots vs {len(got)}"]
    for s, (x, y) in enumerate(zip(ref, got)):
        where = f"step {s}" if s < len(ref) - 1 else "after flush()"
        for key in ("skipped", "scale"):
            if x[key] != y[key]:
                bad.append(f"{where}: {key} {x[key]} vs {y[key]}")
        for i, (a, b) in enumerate(zip(x["params"], y["params"])):
            if not same_bits(a, b):
                bad.append(f"{where}: param {i} {SHAPES[i] if i < len(SHAPES) else ''}: "
                           f"{_describe(a, b)}")
        fx, fy = x.get("forward", []), y.get("forward", [])
        if len(fx) != len(fy):
            bad.append(f"{where}: {len(fx)} forward reads vs {len(fy)}")
        for i, (a, b) in enumerate(zip(fx, fy)):
            if not same_bits(a, b):
                bad.append(f"{where}: forward read {i} (a param as a module's forward saw "
                           f"it): {_describe(a, b)}")
        if ("host" in x) != ("host" in y):
            bad.append(f"{where}: a delayed update in flight on one side only")
        elif "host" in x:
            for i, (hx, hy) in enumerate(zip(x["host"], y["host"])):
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    if not same_bits(hx[key], hy[key]):
                        bad.append(f"{where}: {key} of param {i}: {_describe(hx[key], hy[key])}")
    return bad[:limit] + ([f"... and {len(bad) - limit} more"] if len(bad) > limit else [])


def norm_rel_diff(ref: list[dict], got: list[dict]) -> float:
    """Largest relative difference of the finite gradient norms (0.0 if none compared)."""
    worst = 0.0
    for x, y in zip(ref, got):
        a, b = x.get("norm"), y.get("norm")
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            continue
        worst = max(worst, abs(a - b) / max(abs(a), 1e-30))
    return worst


def same_state_dicts(a: dict, b: dict) -> list[str]:
    """Differences between two state_dicts' ``state`` tensors and ``param_groups``."""
    bad = []
    if a["param_groups"] != b["param_groups"]:
        bad.append("param_groups differ")
    if a["state"].keys() != b["state"].keys():
        return bad + [f"state keys {sorted(a['state'])} vs {sorted(b['state'])}"]
    for i, st in a["state"].items():
        for k, v in st.items():
            w = b["state"][i].get(k)
            if isinstance(v, torch.Tensor):
                if not isinstance(w, torch.Tensor) or not same_bits(v.cpu(), w.cpu()):
                    bad.append(f"state[{i}][{k!r}] differs")
            elif v != w:
                bad.append(f"state[{i}][{k!r}]: {v!r} vs {w!r}")
    return bad


@contextlib.contextmanager
def delayed_side(cycles: int = SLEEP_CYCLES):
    """``CudaCopier.side`` queues ``torch.cuda._sleep(cycles)`` on the side stream right after
    the original has ordered it behind the compute stream, i.e. before every side-stream copy.
    Yields a dict whose "entered" counts the copies delayed (0 would mean the engine no longer
    copies through ``side()``, and the delay proved nothing)."""
    original = CudaCopier.side
    count = {"entered": 0}

    @contextlib.contextmanager
    def side(self):
        with original(self):
            count["entered"] += 1
            if cycles:
                torch.cuda._sleep(cycles)  # on the side stream: the current one here
            yield

    CudaCopier.side = side
    try:
        yield count
    finally:
        CudaCopier.side = original
