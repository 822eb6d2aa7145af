#!/usr/bin/env python
"""Soak run: the quickstart model trained for thousands of steps through the ZeRO-Offload
engine with fp16 loss scaling, gradient accumulation, injected overflows and periodic
checkpoints; exits non-zero when one of its checks fails.

The model, tokenizer and corpus are the quickstart's (`hf_zoffload.integrations.defaults`:
the small GPT-2, a byte-level BPE trained here, the standard library's sources), trained in
a plain loop on the CPU (or the GPU when there is one) so that every step can be inspected.

Checks, each reported as one ``check <name>: ok|FAILED (...)`` line:

- ``rss``: the process's resident memory, read every ``--rss_every`` steps, never grows by
  more than ``--max_rss_growth`` (2%) over its value at ``--baseline_step`` (by default the
  first checkpoint, which allocates its buffers once);
- ``skipped_steps``: every step with an injected overflow (the loss of its last micro-batch
  multiplied by inf) is skipped; on every skipped step, injected or not, the master weights,
  both Adam moments and the params are bitwise unchanged; every step not skipped changed
  the master weights (so the comparison can fail);
- ``overflow_logging``: the engine logs at most one line per burst of consecutive skipped
  steps, not one per step;
- ``checkpoint``: the optimizer state is saved every ``--checkpoint_every`` steps (written
  to a temporary file, then renamed), and the last one loads into a fresh engine with the
  same master weights, bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
import warnings

# Runnable from a checkout without installing: scripts/bench/../.. is the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin  # noqa: E402
from hf_zoffload.integrations import defaults  # noqa: E402

MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step (default 2)")
    p.add_argument("--batch_size", type=int, default=4,
                   help="sequences per micro-batch; 4 x accum 2 is the quickstart's 8 per step")
    p.add_argument("--block_size", type=int, default=64, help="tokens per sequence (64)")
    p.add_argument("--checkpoint_every", type=int, default=200)
    p.add_argument("--rss_every", type=int, default=100)
    p.add_argument("--baseline_step", type=int, default=None,
                   help="RSS growth is measured from this step (default: --checkpoint_every)")
    p.add_argument("--max_rss_growth", type=float, default=0.02)
    p.add_argument("--overflow_rate", type=float, default=0.01,
                   help="chance per step that a burst of injected overflows starts (0.01)")
    p.add_argument("--max_burst", type=int, default=3,
                   help="injected bursts are 1 to this many consecutive steps (3)")
    p.add_argument("--growth_interval", type=int, default=50,
                   help="clean steps before the loss scale doubles (50). The default 2000 "
                        "never grows between bursts, and 100 still drifted down: 65536 to 8 "
                        "by step 1200 at --overflow_rate 0.01, as 37%% of 100-step stretches "
                        "are burst-free (0.99**100) while every second overflow halves the scale "
                        "(hysteresis 2)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--n_layer", type=int, default=None, help="override the quickstart's 4")
    p.add_argument("--n_embd", type=int, default=None, help="override the quickstart's 128")
    p.add_argument("--corpus_mb", type=float, default=1.0)
    p.add_argument("--vocab_size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads and CPU-Adam threads; 0 keeps both defaults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default=None,
                   help="where checkpoints go (default: a temporary directory, removed)")
    args = p.parse_args(argv)
    if args.baseline_step is None:
        args.baseline_step = args.checkpoint_every
    if not 0 < args.baseline_step <= args.steps:
        p.error(f"--baseline_step {args.baseline_step} must be in 1..--steps {args.steps}")
    return args


def rss_bytes() -> int:
    """Resident set size now (Linux: /proc/self/statm counts resident pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def token_blocks(texts, tokenizer, block_size: int) -> torch.Tensor:
    """All texts end to end, each followed by EOS, cut into rows of ``block_size`` tokens."""
    ids = [t for doc in tokenizer(texts, verbose=False)["input_ids"]
           for t in (*doc, tokenizer.eos_token_id)]
    n = len(ids) // block_size * block_size
    return torch.tensor(ids[:n]).view(-1, block_size)


def injected_steps(args) -> set[int]:
    rng = random.Random(args.seed)
    out, step = set(), 1
    while step <= args.steps:
        if rng.random() < args.overflow_rate:
            burst = rng.randint(1, args.max_burst)
            out.update(range(step, min(step + burst, args.steps + 1)))
            step += burst
        step += 1
    return out


def snapshot(opt, params) -> dict[str, torch.Tensor]:
    """Copies of the host state and the params, one flat tensor per kind."""
    views = [opt.host_views(p) for p in params]
    out = {k: torch.cat([v[k].reshape(-1) for v in views]) for k in views[0]}
    out["params"] = torch.cat([p.detach().reshape(-1) for p in params]).cpu()
    return out


def bursts(steps: list[int]) -> int:
    return sum(1 for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s - 1)


class Counter(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(f"{record.name}: {record.getMessage()}")


def save_checkpoint(opt, path: str) -> int:
    # Temporary name, then rename: a soak killed mid-save keeps the previous checkpoint.
    torch.save(opt.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)
    return os.path.getsize(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s", level=logging.WARNING,
                        stream=sys.stdout)
    logging.getLogger("hf_zoffload").setLevel(logging.INFO)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    texts = defaults.stdlib_corpus(max_mb=args.corpus_mb)
    tokenizer = defaults.train_tokenizer(texts, vocab_size=args.vocab_size)
    data = token_blocks(texts, tokenizer, args.block_size)
    config = defaults.default_config(vocab_size=len(tokenizer), block_size=args.block_size,
                                     eos_token_id=tokenizer.eos_token_id)
    for key in ("n_layer", "n_embd"):
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(config).to(device)
    fresh = copy.deepcopy(model)  # for the reload check: same structure, untrained
    plugin = ZeroOffloadPlugin(compute_dtype="fp16", growth_interval=args.growth_interval,
                               cpu_threads=args.threads)
    opt = ZeroOffloadOptimizer(model.parameters(), lr=args.lr, weight_decay=0.01,
                               plugin=plugin, param_order=model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"soak: {model.num_parameters() / 1e6:.2f} M params ({config.n_layer} layers, width "
          f"{config.n_embd}), {len(data)} blocks of {args.block_size} tokens, {args.steps} "
          f"steps of {args.accum} x {args.batch_size} sequences, fp16 on {device}, "
          f"{torch.get_num_threads()} torch threads; setup {time.perf_counter() - t0:.1f} s")

    out_dir = args.output_dir or tempfile.mkdtemp(prefix="soak_")
    os.makedirs(out_dir, exist_ok=True)
    ckpt_path = os.path.join(out_dir, "optimizer.pt")
    inject = injected_steps(args)
    gen = torch.Generator().manual_seed(args.seed)
    order, pos = torch.randperm(len(data), generator=gen), 0
    failures, skipped, rss, unchanged_applied = [], [], {}, []
    losses, ckpt_masters, ckpt_sizes = [], None, []
    counter = Counter()
    logging.getLogger("hf_zoffload").addHandler(counter)  # from here on: the loop's lines

    before = snapshot(opt, params)
    t_loop = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, args.steps + 1):
            for micro in range(args.accum):
                if pos + args.batch_size > len(order):
                    order, pos = torch.randperm(len(data), generator=gen), 0
                ids = data[order[pos:pos + args.batch_size]].to(device)
                pos += args.batch_size
                loss = model(input_ids=ids, labels=ids).loss
                if step in inject and micro == args.accum - 1:
                    loss = loss * math.inf  # every gradient of this window becomes inf/nan
                else:
                    losses.append(float(loss))
                opt.backward(loss)
            opt.step()
            opt.zero_grad()
            after = snapshot(opt, params)
            if opt.last_step_skipped:
                skipped.append(step)
                changed = [k for k in after if not torch.equal(before[k], after[k])]
                if changed:
                    failures.append(f"step {step} was skipped but changed {changed}")
            elif torch.equal(before["master"], after["master"]):
                unchanged_applied.append(step)
            if step in inject and not opt.last_step_skipped:
                failures.append(f"step {step}: injected overflow was not skipped")
            before = after
            if step % args.checkpoint_every == 0:
                ckpt_sizes.append(save_checkpoint(opt, ckpt_path))
                ckpt_masters = after["master"]
            if step % args.rss_every == 0 or step == args.baseline_step:
                rss[step] = rss_bytes()
                recent = losses[-args.rss_every * args.accum:] or [math.nan]
                print(f"step {step}/{args.steps}  loss {sum(recent) / len(recent):.3f}  "
                      f"scale {opt.loss_scaler.loss_scale:g}  skipped {len(skipped)}  "
                      f"rss {rss[step] / MIB:.1f} MiB  {time.perf_counter() - t_loop:.0f} s",
                      flush=True)
    wall = time.perf_counter() - t_loop
    logging.getLogger("hf_zoffload").removeHandler(counter)
    ours = [f"warning: {w.message}" for w in caught if "hf_zoffload" in w.filename]

    # ---- report and checks
    print("rss MiB by step: " + ", ".join(f"{s}: {v / MIB:.1f}" for s, v in rss.items()))
    base = rss[args.baseline_step]
    later = {s: v for s, v in rss.items() if s > args.baseline_step}
    growth = max((v - base) / base for v in later.values()) if later else 0.0
    checks = {"rss": (growth < args.max_rss_growth and bool(later),
                      f"max {growth:+.2%} over step {args.baseline_step} in {len(later)} "
                      f"reports, limit {args.max_rss_growth:.0%}")}
    n_bursts = bursts(skipped)
    natural = sorted(set(skipped) - inject)
    print(f"skipped steps: {len(skipped)} in {n_bursts} bursts ({len(inject)} injected, "
          f"{len(natural)} from real overflows{': ' + str(natural) if natural else ''}): "
          f"{skipped}")
    if unchanged_applied:
        failures.append(f"applied steps left the master weights unchanged: {unchanged_applied}")
    checks["skipped_steps"] = (not failures, "; ".join(failures) or
                               f"{len(skipped)} skipped steps bitwise unchanged, "
                               f"{args.steps - len(skipped)} applied steps changed the masters")
    lines = counter.records + ours
    print(f"engine log lines during the loop: {len(lines)}")
    for line in lines:
        print(f"  {line}")
    checks["overflow_logging"] = (len(lines) <= n_bursts,
                                  f"{len(lines)} lines for {n_bursts} bursts")
    if ckpt_masters is not None:
        reloaded = ZeroOffloadOptimizer(fresh.parameters(), lr=args.lr, plugin=plugin,
                                        param_order=fresh.parameters())
        reloaded.load_state_dict(torch.load(ckpt_path, map_location="cpu", weights_only=True))
        same = torch.equal(snapshot(reloaded, list(fresh.parameters()))["master"], ckpt_masters)
        checks["checkpoint"] = (same, f"{len(ckpt_sizes)} saves of {ckpt_sizes[-1] / MIB:.1f} "
                                      f"MiB; the last reloads {'bitwise' if same else 'DIFFERENT'}")
    else:
        checks["checkpoint"] = (False, f"no checkpoint in {args.steps} steps")
    for name, (ok, detail) in checks.items():
        print(f"check {name}: {'ok' if ok else 'FAILED'} ({detail})")
    print(f"wall time: {wall:.0f} s for {args.steps} steps ({1e3 * wall / args.steps:.0f} ms a "
          f"step); final loss scale {opt.loss_scaler.loss_scale:g}")
    if args.output_dir is None:
        shutil.rmtree(out_dir)
    passed = all(ok for ok, _ in checks.values())
    print(f"soak: {'passed' if passed else 'FAILED'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
