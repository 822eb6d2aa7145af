#!/usr/bin/env python
"""The largest Llama-shaped model that trains two steps within a GPU memory cap, both ways.

The ways (scripts/bench/_gpu_llama.py): ``amp``, fp32 params, fused AdamW and bf16 autocast,
all on the device (16 B/param of model states, 18 through a forward); ``zoffload``,
`ZeroOffloadOptimizer` with bf16 compute (2 B/param on the device; on the host 14 B/param
with fp32 state, about 8 with int8); with ``--fsdp2``, ``fsdp2``: FSDP2 parameter offload
(``fully_shard`` per layer, ``CPUOffloadPolicy``, one rank) with `ZeroOffloadOptimizer`, whose
device holds the root's params and two layers' with their grads whatever the layer count.

The model is Llama-2-7B's layer and vocabulary (hidden 4096, MLP 11008, 32 heads of 128, vocab
32000, head untied: 202.4M params a layer, 262.1M in the embeddings and head); the ladder is
its layer count. Gradient checkpointing (non-reentrant), one sequence of 512 tokens: the
activations stay under ~0.5 GiB, so model states decide what fits.

Each probe (one way, one layer count) is a fresh process (an OOM can leave the allocator
fragmented) capped at ``--cap_gib`` (``torch.cuda.set_per_process_memory_fraction``): the
model built on the device in its dtype, two steps (the second with the Adam state), "fits" or
which memory ran out. Per way the search starts at the rung a bytes-per-param model predicts,
two rungs a round in parallel processes (as many at once as the host's memory allows): the
prediction and the next, then neighbours or points splitting the bracket. For zoffload the
lower rung runs with fp32 state, the upper with int8: the state changes host bytes only, so
a round proves both (an fp32 fit implies int8 fits).

FSDP2's device need does not grow with the layers, so within the cap only the host bounds it
and its search would climb to the ladder's top, a probe of many GiB of host state: it probes
one rung instead, the first whose bf16 weights alone exceed the cap (what optimizer offload
alone cannot train), with a bf16 master and int4 moments (the smallest host state: the state
dtype changes host bytes only), in the same rounds as the others. The largest model it
trains is then the host's (``hf-zoffload estimate --fsdp2_offload``, printed for this host).

Needs CUDA (``--device cpu``: the same on a tiny config, no cap, for the tests). Exits 1 when a
probe fails for another reason than memory, when a fitting probe reserved more than the cap
(the cap was not enforced), when zoffload fits no more than amp, or when fsdp2 did not train
its rung.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import _gpu_llama as llama
import _gpu_script as common
import torch

SCRIPT = "gpu_size.py"
GiB = 2**30
# Device bytes per param that the prediction assumes (the search measures; this only picks
# where it starts): amp 16 of model states + 2 of autocast's weight copies; zoffload 2.
# (fsdp2 probes one rung, `wall_rung`: no prediction.)
BYTES_PER_PARAM = {"amp": 18, "zoffload": 2}
# Beside the params: the fp32 logits of 512 x 32000 and their grad (0.13 GiB), the layer
# being recomputed (~0.1 GiB), the checkpoints (4 MiB a layer), the largest param's bf16
# grad before the engine moves it (0.24 GiB, the embedding) and two 32 MiB grad buckets,
# cuBLAS's workspace and the allocator's rounding.
OVERHEAD_BYTES = 0.75 * GiB
PROCESS_HOST_BYTES = 3 * GiB  # a CUDA process's own host memory beside the engine's state
HOST_SHARE = 0.85  # of what host_available() reports: the probes of a round together
WAYS = ("amp", "zoffload")
FSDP2 = "fsdp2"
NAMES = {"amp": llama.AMP, "zoffload": "ZeroOffloadOptimizer, bf16 params",
         FSDP2: "ZeroOffloadOptimizer over FSDP2 parameter offload, bf16 master"}
# The fsdp2 probe's host state: the smallest (the device side is the question there)
FSDP2_STATE, FSDP2_MASTER = "int4", "bf16"
# A probe's two host passes over its engine state, GiB/s by state dtype: the placement and
# the re-layout after step 1 (docs/measurements.md, issue 22: 134M-param Llama, bf16 compute,
# the 2-vCPU EPYC under load: placement 0.93 / 0.46, re-layout 1.6 / 0.22 with fp32 / int8
# moments; int4 not measured, taken as int8). A host with more cores and memory bandwidth
# passes faster: --host_speed scales them. With a time limit no probe starts whose predicted
# seconds pass it (`probe_seconds`), and the ladder starts where a probe can finish.
PLACE_GIBPS = {"fp32": 0.93, "int8": 0.46, "int4": 0.46}
RELAYOUT_GIBPS = {"fp32": 1.6, "int8": 0.22, "int4": 0.22}
PROBE_START_S = 10.0  # a probe's own start: torch, transformers, CUDA, the model (estimated)


def predicted_rung(way: str, ladder: list[int], base: dict, cap: float) -> int:
    """Index of the largest rung the bytes model fits under ``cap`` (0 if none)."""
    fit = [k for k, n in enumerate(ladder)
           if BYTES_PER_PARAM[way] * llama.n_params(base, n) + OVERHEAD_BYTES <= cap]
    return fit[-1] if fit else 0


def wall_rung(ladder: list[int], base: dict, cap: float) -> int | None:
    """Index of the first rung whose bf16 weights alone exceed ``cap`` (None: none does)."""
    return next((k for k, n in enumerate(ladder) if 2 * llama.n_params(base, n) > cap), None)


def host_need(way: str, layers: int, base: dict, state_dtype: str | None) -> int:
    """Host bytes of one probe: the engine's state (memory.estimate, pinned) and the process;
    fsdp2: `memory.estimate_fsdp2` with a bf16 master, plus two more bf16 copies of the
    params (its model is built on the host, and torch's pinned allocator keeps the blocks of
    FSDP2's first pinned shards cached after the engine gives each param its new one)."""
    if way == "amp":
        return PROCESS_HOST_BYTES
    from hf_zoffload.offload.memory import estimate, estimate_fsdp2

    n = llama.n_params(base, layers)
    if way == FSDP2:
        layer = llama.n_params(base, 1) - llama.n_params(base, 0)
        need = estimate_fsdp2(n, root_params=n - layers * layer, largest_group=layer,
                              state_dtype=state_dtype, master_dtype=FSDP2_MASTER)
        return PROCESS_HOST_BYTES + need["host_total"] + 2 * 2 * n
    return PROCESS_HOST_BYTES + estimate(n, compute_dtype="bf16", state_dtype=state_dtype,
                                         pinned=True)["host_total"]


def probe_seconds(way: str, layers: int, base: dict, state_dtype: str | None,
                  speed: float = 1.0) -> float:
    """Predicted seconds of one probe: its start and, with an engine, the two host passes
    over its state at ``speed`` times the 2-vCPU rates (PLACE_GIBPS, RELAYOUT_GIBPS)."""
    if way == "amp":
        return PROBE_START_S
    state = (host_need(way, layers, base, state_dtype) - PROCESS_HOST_BYTES) / GiB
    per_gib = 1 / PLACE_GIBPS[state_dtype] + 1 / RELAYOUT_GIBPS[state_dtype]
    return PROBE_START_S + state * per_gib / speed


def time_top(base: dict, limit: float, ladder: list[int], speed: float = 1.0) -> int:
    """Index of the largest rung whose zoffload probe with fp32 state is predicted to end
    within ``limit`` seconds (-1: none)."""
    ok = [k for k, n in enumerate(ladder)
          if probe_seconds("zoffload", n, base, "fp32", speed) <= limit]
    return ok[-1] if ok else -1


@dataclass
class Search:
    """The bracket of one way over a ladder: ``lo`` the largest index known to fit (-1: none),
    ``hi`` the smallest known not to (len(ladder): none)."""

    way: str
    size: int
    pred: int
    lo: int = -1
    hi: int = -1
    probes: list = field(default_factory=list)  # every probe's result dict, in order
    conflicts: list = field(default_factory=list)
    broken: bool = False  # a probe failed for another reason than memory: nothing to infer
    stopped: str = ""  # why the search ended early: its next probe would not end in time

    def __post_init__(self):
        self.hi = self.size if self.hi < 0 else self.hi

    @property
    def done(self) -> bool:
        return self.broken or bool(self.stopped) or self.hi - self.lo <= 1

    def next(self, k: int = 2) -> list[int]:
        """Up to ``k`` ladder indices for the next round."""
        if self.done:
            return []
        if not self.probes:
            cands = [self.pred, self.pred + 1]
        elif self.hi == self.size:  # nothing failed yet: climb
            cands = [self.lo + j for j in range(1, k + 1)]
        elif self.lo < 0:  # nothing fitted yet: descend
            cands = [self.hi - j for j in range(1, k + 1)]
        elif self.hi - self.lo - 1 <= k:
            cands = list(range(self.lo + 1, self.hi))
        else:  # split the open bracket into k + 1 parts
            cands = [self.lo + (self.hi - self.lo) * j // (k + 1) for j in range(1, k + 1)]
        return sorted({c for c in cands if self.lo < c < self.hi and 0 <= c < self.size})

    def record(self, index: int, result: dict) -> None:
        self.probes.append(result)
        if result["result"] == "fits":
            if index >= self.hi:
                self.conflicts.append(f"rung {index} fits above the failed rung {self.hi}")
            self.lo = max(self.lo, index)
        elif result["result"] in ("oom", "host"):
            if index <= self.lo:
                self.conflicts.append(f"rung {index} failed below the fitting rung {self.lo}")
            self.hi = min(self.hi, index)
        else:  # error, timeout
            self.broken = True


@dataclass
class OneRung(Search):
    """A search of one probe at ``pred`` (fsdp2: the first rung past the bf16 weights' wall);
    ``lo`` / ``hi`` as `Search` records them."""

    def next(self, k: int = 2) -> list[int]:
        return [] if self.done else [self.pred]

    @property
    def done(self) -> bool:
        return bool(self.probes) or self.broken or bool(self.stopped)


def plan_round(specs: list[dict], budget: float) -> list[list[dict]]:
    """The round's probes in batches run one after the other, each within ``budget`` host
    bytes in all (the largest first; a probe over the budget alone still runs, alone)."""
    batches: list[list[dict]] = []
    for spec in sorted(specs, key=lambda s: -s["host_need"]):
        for batch in batches:
            if sum(s["host_need"] for s in batch) + spec["host_need"] <= budget:
                batch.append(spec)
                break
        else:
            batches.append([spec])
    return batches


# ------------------------------------------------------------------------------ one probe
def _two_steps(spec: dict, base: dict, layers: int, device) -> tuple[list[float], object]:
    """Build the probe's model, train two steps (the second with the Adam state): (losses,
    the engine or None). fsdp2's model is built on the host, where FSDP2 keeps its params
    (sharding moves each layer through the device once): built on the device it would not
    fit the cap it is there to pass."""
    torch.manual_seed(0)
    way = spec["way"]
    model = llama.build_model(base, torch.float32 if way == "amp" else torch.bfloat16,
                              "cpu" if way == FSDP2 else device, layers=layers,
                              checkpointing=True)
    limit = f"{int(spec['host_limit'])}B" if spec["host_limit"] else "0"
    engine_kw = dict(state_dtype=spec["state_dtype"], cpu_threads=spec["threads"],
                     host_memory_limit=limit)
    if way == "amp":
        step, engine = llama.amp_step(model)[0], None
    elif way == FSDP2:
        step, _, engine = llama.fsdp2_step(model, device, master_dtype=FSDP2_MASTER,
                                           **engine_kw)
    else:
        step, _, engine = llama.zoffload_step(model, **engine_kw)
    ids = llama.token_ids(base, 1, spec["seq"], device)
    return [float(step(ids)) for _ in range(2)], engine


def run_probe(spec: dict) -> dict:
    """In this process: build, two steps, the result (lack of memory is a result, not an
    exception)."""
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if cuda:  # CUDA only: the cap, before anything is allocated
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap"] / total), device)
    base, layers = spec["base"], spec["layers"]
    out = {"way": spec["way"], "layers": layers, "state_dtype": spec["state_dtype"],
           "n_params": llama.n_params(base, layers), "result": "error", "message": "",
           "host_total": None}
    t0 = time.perf_counter()
    fsdp2 = spec["way"] == FSDP2
    try:
        with llama.one_rank_group(device) if fsdp2 else contextlib.nullcontext():
            losses, engine = _two_steps(spec, base, layers, device)
        if cuda:
            torch.cuda.synchronize()
        if engine is not None:
            out["host_total"] = engine.memory_report()["host_total"]
        finite = all(math.isfinite(x) for x in losses)
        out.update(result="fits" if finite else "error", losses=losses,
                   message="" if finite else f"losses {losses}")
    except MemoryError as exc:  # the engine's host check: refused before allocating
        out.update(result="host", message=str(exc)[:300])
    except Exception as exc:  # noqa: BLE001 -- anything but the cap fails the stage
        # the cap: torch.OutOfMemoryError, or cuBLAS failing to get its workspace under it
        text = f"{type(exc).__name__}: {exc}"
        oom = isinstance(exc, torch.OutOfMemoryError) or "CUBLAS_STATUS_ALLOC_FAILED" in text
        out.update(result="oom" if oom else "error", message=text.split("\n")[0][:400])
    out["seconds"] = time.perf_counter() - t0
    if cuda:
        out["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        out["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        # what torch's pinned allocator holds (FSDP2 pins each shard, and keeps the blocks
        # it frees cached): the host bytes memory_report() does not see
        stats = getattr(torch.cuda, "host_memory_stats", dict)()
        held = [stats[k] for k in ("allocated_bytes.current", "reserved_bytes.current")
                if k in stats]
        out["host_pinned"] = max(held) if held else None
    return out


def run_batch(batch: list[dict], work: str, timeout: float) -> list[dict]:
    """Each spec of ``batch`` in its own process, all at once; their results, in order."""
    procs = []
    for i, spec in enumerate(batch):
        path = os.path.join(work, f"probe-{time.monotonic_ns()}-{i}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--probe", json.dumps(spec),
               "--result", path]
        print(f"== probe {spec['way']} {spec['layers']} layers {spec['state_dtype']}", flush=True)
        procs.append((subprocess.Popen(cmd), path, spec))
    t_end, results = time.monotonic() + timeout, []
    for proc, path, spec in procs:
        try:
            rc = proc.wait(timeout=max(1.0, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "killed at the time limit"
        if rc == 0 and os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append({"way": spec["way"], "layers": spec["layers"],
                            "state_dtype": spec["state_dtype"], "n_params": None,
                            "result": "timeout" if isinstance(rc, str) else "error",
                            "message": f"probe process: exit {rc}", "seconds": None})
    return results


# ------------------------------------------------------------------------------ the search
def ladder_top(base: dict, budget: float, most: int) -> int:
    """The most layers (<= ``most``) whose zoffload probe with fp32 state fits ``budget``."""
    top = 1
    while top < most and host_need("zoffload", top + 1, base, "fp32") <= budget:
        top += 1
    return top


def search(args, base: dict, cap: float, budget: float, run=run_batch, clock=time.monotonic):
    """Both ways' searches over one ladder, round by round; (ladder, searches, notes)."""
    ladder = list(range(1, ladder_top(base, budget, args.max_layers) + 1))
    speed = getattr(args, "host_speed", 1.0)
    searches = {w: Search(w, len(ladder), predicted_rung(w, ladder, base, cap)) for w in WAYS}
    notes = []
    if args.time_limit:  # the ladder starts where a probe can finish
        top = time_top(base, args.time_limit, ladder, speed)
        zo = searches["zoffload"]
        if zo.pred > top:
            notes.append(f"zoffload: the search starts at {ladder[max(top, 0)]} layers, not "
                         f"the predicted {ladder[zo.pred]}: a larger probe's host passes "
                         f"would not end in the {args.time_limit:.0f} s limit (PLACE_GIBPS, "
                         f"RELAYOUT_GIBPS x {speed:g}); its figure is a lower bound")
            zo.pred = max(top, 0)
    wall = wall_rung(ladder, base, cap) if args.fsdp2 else None
    if wall is not None:
        searches[FSDP2] = OneRung(FSDP2, len(ladder), wall)
    t0, longest, stop = clock(), 0.0, []
    with tempfile.TemporaryDirectory(prefix="gpu_size_",
                                     dir=os.environ.get("SCRATCH") or None) as work:
        batches = []
        while not stop:
            left = args.time_limit - (clock() - t0) if args.time_limit else 1e9
            if not batches:  # the next round: every unfinished way's probes
                specs = []
                for s in searches.values():
                    mine = round_specs(s, ladder, base, args, cap)
                    slow = [x for x in mine if x["predicted_s"] > left]
                    if slow:  # the way's search ends with this round: what it measured
                        x = slow[0]  # so far stands
                        s.stopped = (f"{x['layers']} layers ({x['state_dtype']}) not probed: "
                                     f"predicted {x['predicted_s']:.0f} s, {left:.0f} s left")
                    specs += [x for x in mine if x["predicted_s"] <= left]
                batches = plan_round(specs, budget)
                if not batches:
                    break
            if longest and left < 1.1 * longest:  # it would not end in time
                stop.append(f"stopped at the {args.time_limit:.0f} s time limit with the "
                            f"search unfinished (a batch of probes took {longest:.0f} s)")
                break
            batch = batches.pop(0)
            share(batch, budget)
            t1 = clock()
            for s, r in zip(batch, run(batch, work, max(1.0, left))):
                searches[s["way"]].record(s["index"], r)
                print(f"{s['way']} {s['layers']} layers ({s['state_dtype'] or '-'}): "
                      f"{r['result']} {r.get('message', '')}", flush=True)
            longest = max(longest, clock() - t1)
    return ladder, searches, notes + stop


def round_specs(s: Search, ladder: list[int], base: dict, args, cap: float) -> list[dict]:
    """The probes of ``s``'s next round; for zoffload the lowest with fp32 state, the rest
    int8 (the state dtype changes host bytes only)."""
    out = []
    for j, i in enumerate(s.next()):
        state = None if s.way == "amp" else FSDP2_STATE if s.way == FSDP2 else (
            "fp32" if j == 0 else "int8")
        out.append({"way": s.way, "index": i, "layers": ladder[i], "state_dtype": state,
                    "host_need": host_need(s.way, ladder[i], base, state), "base": base,
                    "predicted_s": probe_seconds(s.way, ladder[i], base, state,
                                                 getattr(args, "host_speed", 1.0)),
                    "seq": args.seq, "cap": cap, "device": args.device, "threads": 0,
                    "host_limit": 0})
    return out


def share(batch: list[dict], budget: float) -> None:
    """The cores and the host memory among a batch's engines: each its share of the budget
    as ``host_memory_limit`` (at least its need when the batch fits), the cores split."""
    zo = [s for s in batch if s["way"] != "amp"]
    total = sum(s["host_need"] for s in batch)
    for s in zo:
        s["threads"] = max(1, (os.cpu_count() or 1) // len(zo))
        s["host_limit"] = int(budget * s["host_need"] / total)


# ------------------------------------------------------------------------------ the report
def _gib(x) -> str:
    return f"{x / GiB:.2f}" if x is not None else "n/a"


def largest_fit(s: Search, state: str | None) -> dict | None:
    """The largest fitting probe of ``s`` for ``state`` (an fp32 fit counts for int8: the
    same device bytes, less host memory)."""
    ok = [r for r in s.probes if r["result"] == "fits"
          and (state in (None, "int8") or r["state_dtype"] == state)]
    return max(ok, key=lambda r: r["layers"], default=None)


def row(s: Search, state: str | None, ladder: list[int]) -> list:
    top = largest_fit(s, state) or {}
    above = [r for r in s.probes if r["result"] != "fits" and r["layers"] > top.get("layers", 0)]
    first = min(above, key=lambda r: r["layers"], default=None)
    if first:
        failed = f"{first['layers']} layers ({first['state_dtype'] or s.way}): {first['result']}"
    else:
        failed = "the ladder's top" if top.get("layers") == ladder[-1] else "not probed"
    how = ("probed" if top["state_dtype"] == state else "implied by the fp32 fit") if top \
        else "-"
    return [NAMES[s.way] + (f", state {state}" if state else ""),
            f"{top['layers']} layers" if top else "none", llama.count(top.get("n_params")), how,
            f"{_gib(top.get('peak_allocated'))} / {_gib(top.get('peak_reserved'))}",
            _gib(top.get("host_total")), failed]


def report(ladder, searches, *, cap: float, device: str, notes=(), base=None,
           host_budget=None):
    """(summary lines, failures) from the searches; with an fsdp2 search, ``base`` and
    ``host_budget`` say how large a model the host would hold that way."""
    failures, notes = [], list(notes)
    rows = [row(searches["amp"], None, ladder), row(searches["zoffload"], "fp32", ladder),
            row(searches["zoffload"], "int8", ladder)]
    if FSDP2 in searches:
        rows.append(row(searches[FSDP2], FSDP2_STATE, ladder))
    lines = common.md_table(["way", "largest that trained 2 steps", "params", "evidence",
                             "peak device GiB (allocated / reserved)", "host state GiB",
                             "first rung that did not"], rows)
    probes = []
    for way, s in searches.items():
        for r in s.probes:
            probes.append([way, r["layers"], r["state_dtype"] or "-", llama.count(r["n_params"]),
                           r["result"], _gib(r.get("peak_allocated")),
                           _gib(r.get("peak_reserved")),
                           "n/a" if r.get("seconds") is None else f"{r['seconds']:.0f}"])
            if r["result"] in ("error", "timeout"):
                failures.append(f"{way} {r['layers']} layers: {r['result']}: {r['message']}")
            if r["result"] == "fits" and r.get("peak_reserved", 0) > cap + 2**21:
                failures.append(f"{way} {r['layers']} layers reserved "
                                f"{_gib(r['peak_reserved'])} GiB, past the {_gib(cap)} GiB "
                                f"cap: the cap was not enforced")
        failures += [f"{way}: {c}" for c in s.conflicts]
        if not s.done:
            notes.append(f"{way}: the search is unfinished; its figure is a lower bound")
        elif s.stopped:
            notes.append(f"{way}: the search ended before its time ran out: {s.stopped}; its "
                         "figure is a lower bound")
    lines += ["", *common.md_table(["probe", "layers", "state", "params", "result",
                                    "peak allocated GiB", "peak reserved GiB", "s"], probes)]
    amp, zo = largest_fit(searches["amp"], None), largest_fit(searches["zoffload"], "int8")
    where = f"{cap / GiB:g} GiB of the {device}" if device != "cpu" else "no cap (CPU)"
    if amp and zo:
        ratio = zo["n_params"] / amp["n_params"]
        lines += ["", f"within {where}: ZeRO-Offload trains {ratio:.1f}x the params of AMP "
                      f"AdamW ({llama.count(zo['n_params'])} vs {llama.count(amp['n_params'])}"
                      f"; the ZeRO-Offload paper: 10x, 13B params on one V100 against "
                      f"PyTorch)"]
        if ratio <= 1 and device != "cpu" and not searches["zoffload"].stopped:
            failures.append(f"ZeRO-Offload fits no larger model than AMP AdamW ({ratio:.2f}x)")
    else:
        lines += ["", f"within {where}: no ratio (a way had no fitting rung)"]
    if FSDP2 in searches:
        line, failed = fsdp2_lines(searches[FSDP2], where=where, cuda=device != "cpu",
                                   base=base, host_budget=host_budget)
        lines += line
        failures += failed
    return lines + [f"**{n}**" for n in notes], failures


def fsdp2_lines(s: Search, *, where: str, cuda: bool, base, host_budget) -> tuple[list, list]:
    """The fsdp2 probe's line, and a failure (on CUDA) when it did not train its rung."""
    if not s.probes:
        return [], []
    r = s.probes[-1]
    weights = 2 * r["n_params"] if r.get("n_params") else None
    if r["result"] != "fits":  # error and timeout fail the stage already (`report`)
        return [], ([f"FSDP2 parameter offload did not train {r['layers']} layers within the "
                     f"cap: {r['result']}: {r['message']}"]
                    if cuda and r["result"] in ("oom", "host") else [])
    most = ""
    if base is not None and host_budget:
        from hf_zoffload.offload.memory import estimate_fsdp2

        def need(n):  # the layers' split as this ladder's (root and a layer of base)
            layer = llama.n_params(base, 1) - llama.n_params(base, 0)
            return PROCESS_HOST_BYTES + estimate_fsdp2(
                n, root_params=min(n, llama.n_params(base, 0)), largest_group=min(n, layer),
                state_dtype=FSDP2_STATE, master_dtype=FSDP2_MASTER)["host_total"]
        lo, hi = 0, int(host_budget)  # every way needs > 1 B a param
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= host_budget else (lo, mid)
        most = (f"; the device need does not grow with the layers, so the host bounds it: "
                f"{host_budget / GiB:.0f} GiB hold about {llama.count(lo)} params this way "
                "(memory.estimate_fsdp2)")
    pinned = f", host {_gib(r.get('host_total'))} GiB by memory_report() and " \
        f"{_gib(r.get('host_pinned'))} GiB pinned by torch" if cuda else ""
    return ["", f"within {where}: FSDP2 parameter offload trained {r['layers']} layers "
                f"({llama.count(r['n_params'])} params, whose bf16 weights alone are "
                f"{_gib(weights)} GiB), device peak {_gib(r.get('peak_allocated'))} GiB "
                f"allocated{pinned}" + most], []


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap_gib", type=float, default=9.0,
                   help="GPU memory each probe may use (set_per_process_memory_fraction)")
    p.add_argument("--max_layers", type=int, default=48, help="the ladder's top at most")
    p.add_argument("--seq", type=int, default=512, help="tokens of the one training sequence")
    p.add_argument("--time_limit", type=float, default=None,
                   help="seconds for the whole search (default: GPU_CHECK_STAGE_S - 6 under "
                        "gpu_check.sh, else none); no round starts that would not end in it")
    p.add_argument("--host_speed", type=float, default=1.0,
                   help="the host's passes over the engine state as a multiple of the 2-vCPU "
                        "rates the time limit plans with (PLACE_GIBPS, RELAYOUT_GIBPS)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--overrides", default="",
                   help="model config changes, k=v,... (a tiny model for --device cpu)")
    p.add_argument("--fsdp2", action="store_true",
                   help="FSDP2 parameter offload too: one probe, at the first rung whose bf16 "
                        "weights alone exceed the cap")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # internal: one probe
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.time_limit is None and os.environ.get("GPU_CHECK_STAGE_S", "").isdigit():
        args.time_limit = max(1.0, int(os.environ["GPU_CHECK_STAGE_S"]) - 6.0)
    if args.cap_gib <= 0 or args.max_layers < 2 or args.seq < 2 or args.host_speed <= 0:
        p.error(f"--cap_gib {args.cap_gib} must be > 0, --max_layers {args.max_layers} >= 2, "
                f"--seq {args.seq} >= 2 and --host_speed {args.host_speed} > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    base = llama.with_overrides(llama.LLAMA_4096, args.overrides,
                                what=f"{SCRIPT}: --overrides")
    if args.probe:  # a child: one probe, its result as JSON
        with open(args.result, "w") as f:
            json.dump(run_probe(json.loads(args.probe)), f)
        return 0
    if args.device == "cuda":
        common.require_cuda(SCRIPT)
        props = torch.cuda.get_device_properties(0)  # CUDA only
        if args.cap_gib * GiB >= props.total_memory:
            print(f"{SCRIPT}: --cap_gib {args.cap_gib:g} is not below the device's "
                  f"{props.total_memory / GiB:.1f} GiB", file=sys.stderr)
            return 2
        device = props.name
    else:
        device = "cpu"
    from hf_zoffload.offload.memory import host_available

    have, why = host_available()
    budget = HOST_SHARE * (have or 64 * GiB)
    print(f"host: {why}; the probes of a round share {budget / GiB:.0f} GiB of it")
    ladder, searches, notes = search(args, base, args.cap_gib * GiB, budget)
    if args.fsdp2 and FSDP2 not in searches:
        notes.append("fsdp2: no rung of the ladder has bf16 weights past the cap: not probed")
    lines, failures = report(ladder, searches, cap=args.cap_gib * GiB, device=device,
                             notes=notes, base=base, host_budget=budget)
    per_layer = llama.n_params(base, 1) - llama.n_params(base, 0)
    lines += [f"hidden {base['hidden_size']}, {llama.count(per_layer)} params a layer; "
              f"ladder 1..{ladder[-1]} layers (the top: the most whose fp32 "
              f"host state fits {budget / GiB:.0f} GiB); one sequence of {args.seq} tokens, "
              f"gradient checkpointing"]
    return common.finish(SCRIPT, lines, failures)


if __name__ == "__main__":
    sys.exit(main())
