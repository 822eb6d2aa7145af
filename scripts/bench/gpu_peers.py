#!/usr/bin/env python
"""Other CPU-offload optimizers on gpu_practicality.py's model and batch, on CUDA.

- torchao's ``CPUOffloadOptimizer`` (``torchao.optim``): a pinned host copy of every param of
  4096 elements or more, torch's AdamW (fused) run per param on the CPU after the backward,
  the new values copied back before the next forward. Here on fp32 params under bf16 autocast
  with ``offload_gradients=True``: the arithmetic of AMP AdamW and of ours (fp32 master and
  moments), so only the offload machinery differs.
- DeepSpeed ZeRO-2 with ``offload_optimizer``: not measured. PyPI has DeepSpeed's releases as
  source only (its newest wheel is 0.3.1.dev5) and its CPU Adam is compiled (JIT) at first
  use: a build longer than this stage.

The GPU machine has no package registry, so the peers' wheels travel with the check:
``scripts/gpu_wheels.sh`` fetches them into ``wheels/`` beforehand; each wheel found in
``--wheels`` is unpacked into a scratch folder put first on ``sys.path`` (nothing is
installed). A peer with no wheel and none installed is reported "not available", a figure,
not a failure; a peer that was there but failed fails the stage.

Tokens/s and peak device memory as gpu_practicality.py measures them; ``--against`` its
``--json`` output: the same model, batch and steps, and the ratios against its rows.
Needs CUDA (``--device cpu`` for the test suite).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile
import time
import traceback
import zipfile

import _gpu_llama as llama
import _gpu_script as common
import gpu_practicality as practicality
import torch

SCRIPT = "gpu_peers.py"
TORCHAO = "torchao CPUOffloadOptimizer (fp32 params, bf16 autocast, offload_gradients)"
DEEPSPEED = "DeepSpeed ZeRO-2, offload_optimizer cpu"
DEEPSPEED_WHY = ("not measured: PyPI has DeepSpeed as source only (newest wheel 0.3.1.dev5) "
                 "and its CPU Adam is JIT-compiled at first use, longer than this stage")
HEADER = ["way", "tokens/s", "ms/step", "peak device GiB", "vs AMP AdamW", "vs ZeRO-Offload"]
# A peer's run: its model built on the device (1.1B params), the optimizer's pinned copies,
# one warm-up and one timed step: ~6 s estimated on the H200 (not measured), so one is not
# started with less left.
MIN_START_S = 6.0


def unpack_wheels(folder: str, dest: str) -> list[str]:
    """Every ``*.whl`` of ``folder`` unpacked into ``dest`` (a wheel is a zip of its import
    roots and its .dist-info), ``dest`` first on sys.path; the wheels' names."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".whl")) \
        if os.path.isdir(folder) else []
    for name in names:
        with zipfile.ZipFile(os.path.join(folder, name)) as z:
            z.extractall(dest)  # zipfile drops absolute and ".." parts of member names
    if names:
        sys.path.insert(0, dest)
        importlib.invalidate_caches()
    return names


def load_torchao(unpacked: str = ""):
    """(CPUOffloadOptimizer or None, where it came from or why it is missing, whether that
    is a failure: torchao there but not importable). ``unpacked``: the wheels' folder."""
    # Its CUDA kernels (.so files) are not what CPUOffloadOptimizer runs (pure Python over
    # torch ops): not loading them keeps one more binary out of the figure.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    try:
        import torchao
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as exc:
        if exc.name == "torchao":
            return None, ("not available: no torchao wheel carried (bash scripts/gpu_wheels.sh "
                          "before the run) and none installed"), False
        traceback.print_exc()
        return None, f"import failed: {type(exc).__name__}: {exc}", True
    except Exception as exc:  # noqa: BLE001 -- a broken carried wheel fails the stage
        traceback.print_exc()
        return None, f"import failed: {type(exc).__name__}: {exc}", True
    where = os.path.dirname(os.path.dirname(os.path.abspath(torchao.__file__)))
    if unpacked and where == os.path.abspath(unpacked):
        where = "its carried wheel"
    return CPUOffloadOptimizer, f"torchao {importlib.metadata.version('torchao')} from {where}", \
        False


def torchao_step(cls):
    """``make(model)`` for gpu_practicality.measure: ``cls`` is CPUOffloadOptimizer."""
    def make(model):
        device = next(model.parameters()).device
        opt = cls(model.parameters(), torch.optim.AdamW, offload_gradients=True, lr=1e-5,
                  fused=True)

        def step(ids):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step, lambda: None
    return make


def row(r: dict, against: dict) -> list:
    def vs(way):
        other = against.get(way)
        return f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}" if other else "n/a"
    peak = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") is not None else "n/a"
    return [r["way"], f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step']:.0f}", peak,
            vs(llama.AMP), vs(llama.ZOFFLOAD)]


def read_against(path: str | None) -> dict:
    """gpu_practicality.py's figures, or {} when that stage did not run."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheels", default=os.path.join(common.ROOT, "wheels"),
                   help="folder of wheels to unpack (scripts/gpu_wheels.sh fills wheels/)")
    p.add_argument("--against", default=None,
                   help="gpu_practicality.py --json output: its model, batch, steps, rows")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--overrides", default=None,
                   help="model config changes, k=v,... (default: those of --against)")
    p.add_argument("--time_limit", type=float, default=None,
                   help="seconds for the peers (default: GPU_CHECK_STAGE_S - 3 under "
                        "gpu_check.sh, else none): a peer's timed steps stop before it "
                        "(gpu_practicality.measure), and one is not started with less than "
                        f"{MIN_START_S:.0f} s left")
    args = p.parse_args(argv)
    if args.time_limit is None and os.environ.get("GPU_CHECK_STAGE_S", "").isdigit():
        args.time_limit = max(1.0, int(os.environ["GPU_CHECK_STAGE_S"]) - 3.0)
    if args.time_limit is not None and args.time_limit <= 0:
        p.error(f"--time_limit {args.time_limit} must be > 0")
    return args


def peer_rows(base: dict, run, against: dict, unpacked: str,
              deadline: float | None = None) -> tuple[list, list[str], str]:
    """(table rows, failures, where torchao came from) for the peers, then practicality's
    own rows for reading beside them; ``deadline``: a ``time.perf_counter()`` value the
    peers' runs end before (a peer not started is a missing figure, not a failure)."""
    rows, failures = [], []
    cls, where, broken = load_torchao(unpacked)
    if broken:
        failures.append(f"{TORCHAO}: {where}"[:400])
    if cls is None:
        rows.append([TORCHAO, where, "", "", "", ""])
    elif deadline is not None and deadline - time.perf_counter() < MIN_START_S:
        rows.append([TORCHAO, f"not run: under {MIN_START_S:.0f} s of the time limit left",
                     "", "", "", ""])
    else:
        try:
            rows.append(row(practicality.measure(TORCHAO, torchao_step(cls), base=base,
                                                 dtype=torch.float32, args=run,
                                                 deadline=deadline), against))
        except Exception as exc:  # noqa: BLE001 -- a figure that failed; the stage fails
            traceback.print_exc()
            rows.append([TORCHAO, f"failed: {type(exc).__name__}", "", "", "", ""])
            failures.append(f"{TORCHAO} ({where}): {type(exc).__name__}: {exc}"[:400])
    rows.append([DEEPSPEED, DEEPSPEED_WHY, "", "", "", ""])
    for way in (llama.AMP, llama.ZOFFLOAD):
        if way in against:
            rows.append(row({**against[way], "way": f"{way} (practicality stage)"}, against))
    return rows, failures, where


def main(argv=None) -> int:
    t0 = time.perf_counter()
    args = parse_args(argv)
    if args.device == "cuda":
        common.require_cuda(SCRIPT)
    ref = read_against(args.against)
    overrides = args.overrides if args.overrides is not None else ref.get("overrides", "")
    base = llama.with_overrides(llama.LLAMA_1B, overrides, what=f"{SCRIPT}: --overrides")
    defaults = practicality.parse_args([])
    run = argparse.Namespace(**{k: ref.get(k, getattr(defaults, k))
                                for k in ("batch", "seq", "warmup", "steps")},
                             device=args.device)
    against = {r["way"]: r for r in ref.get("results", [])}
    lines = [f"Llama {base['num_hidden_layers']} layers x {base['hidden_size']} "
             f"({llama.count(llama.n_params(base))} params), batch {run.batch} x {run.seq} "
             f"tokens, {run.warmup} warm-up + {run.steps} timed steps (gpu_practicality.py's "
             f"{'figures from this run' if against else 'defaults; that stage did not run'})",
             ""]
    with tempfile.TemporaryDirectory(prefix="gpu_peers_",
                                     dir=os.environ.get("SCRATCH") or None) as scratch:
        wheels = unpack_wheels(args.wheels, scratch)
        print(f"wheels unpacked from {args.wheels}: {', '.join(wheels) or 'none'}")
        deadline = t0 + args.time_limit if args.time_limit else None
        rows, failures, where = peer_rows(base, run, against, scratch, deadline)
    lines += common.md_table(HEADER, rows) + ["", f"torchao: {where}"]
    return common.finish(SCRIPT, lines, failures)


if __name__ == "__main__":
    sys.exit(main())
