"""The overlapped step schedule (``overlap_step``) on the CPU: the mechanism, its cost, its
fidelity. Backs docs/benchmarks.md, "Overlapped step".

- ``timing``: a training step (forward, backward, ``step()``) of the quickstart model
  (GPT-2, 1.06 M params) and a Llama of ~100 M params, synchronous against overlapped, in
  interleaved rounds (scripts/bench/_interleave.py; median per row, median per-round ratio).
  torch runs forward and backward on one thread; the engine has ``--threads`` (2: the
  overlapped update runs on 1 while backward runs, on 2 after). Reported: step seconds, the
  share of the host pass done before backward ended, and the worst case: every other step
  clipped far below its norm after one that clipped nothing (the update speculates on all
  buckets and every one is undone and redone), its ``step()`` against the synchronous one.
- ``fidelity``: 300 steps of the quickstart model on the local corpus, clipping at 1.0, both
  schedules: the speculation hit rate, the largest loss difference, the masters' largest
  difference in ulp; then fp16 with an inf injected into one gradient every 50 steps: the
  same skips, the losses.

Prints markdown tables headed by the machine. The numbers move with the machine's load:
say it next to them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported by the tests rather than run as a script
    sys.path.insert(0, HERE)

import _interleave as il  # noqa: E402
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin  # noqa: E402
from hf_zoffload.commands.env import cpu_name  # noqa: E402
from hf_zoffload.integrations.defaults import default_config  # noqa: E402


def quickstart():
    torch.manual_seed(0)
    return GPT2LMHeadModel(default_config(vocab_size=2048))


def llama100m(layers: int = 8):
    """hidden 768, 8 layers, vocab 32000 untied: 106 M params."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=128,
        tie_word_embeddings=False))


MODELS = {"quickstart": quickstart, "llama100m": llama100m}


def _engine(model, *, threads, overlap, **plugin):
    return ZeroOffloadOptimizer(model.parameters(), lr=1e-3, model=model,
                                plugin=ZeroOffloadPlugin(cpu_threads=threads,
                                                         overlap_step=overlap, **plugin))


class Trainer:
    """One model and engine; ``step()`` runs one training step and returns its seconds,
    with ``last`` holding the engine's timings of it."""

    def __init__(self, make, *, overlap, threads, batch, seq, vocab, clips=(None,), **plugin):
        self.model = make()
        self.opt = _engine(self.model, threads=threads, overlap=overlap, **plugin)
        g = torch.Generator().manual_seed(1)
        self.ids = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(8)]
        self.clips, self.i, self.last, self.step_s = clips, 0, {}, 0.0

    def step(self) -> float:
        ids = self.ids[self.i % len(self.ids)]
        clip = self.clips[self.i % len(self.clips)]
        self.i += 1
        t0 = time.perf_counter()
        self.opt.backward(self.model(input_ids=ids, labels=ids).loss)
        if clip is not None:
            self.opt.clip_grad_norm_(clip)
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        t2 = time.perf_counter()
        self.last, self.step_s = dict(self.opt.timings), t2 - t1
        return t2 - t0


def timing(args) -> list[str]:
    torch.set_num_threads(1)  # forward and backward on one thread
    lines = ["| model | params | sync step s | overlap step s | overlap / sync | "
             "host pass done before backward ended | worst case step() / sync step() |",
             "|---|---|---|---|---|---|---|"]
    for name in args.models:
        make = MODELS[name]
        vocab = 2048 if name == "quickstart" else 32000
        # buckets of ~1/8 of the quickstart model (0.25 MiB), 4 MiB (50 buckets) for 100 M
        mb = args.bucket_size_mb or (0.25 if name == "quickstart" else 4.0)
        kw = dict(threads=args.threads, batch=args.batch, seq=args.seq, vocab=vocab,
                  compute_dtype="bf16", bucket_size_mb=mb)
        sync = Trainer(make, overlap=False, **kw)
        ov = Trainer(make, overlap=True, **kw)
        hidden = []

        def ov_step(ov=ov, hidden=hidden):  # bound now: the loop's end deletes ov
            s = ov.step()
            hidden.append(ov.last.get("hidden_share", 0.0))
            return s

        r = il.interleave([("sync", sync.step), ("overlap", ov_step)], args.rounds)
        # worst case: the step after one that clipped nothing clips to 1e-6 (speculation on
        # every bucket, every one undone and redone); its step() against the synchronous one
        sync_w = Trainer(make, overlap=False, clips=(1e9, 1e-6), **kw)
        ov_w = Trainer(make, overlap=True, clips=(1e9, 1e-6), **kw)
        worst = []
        for _ in range(args.rounds):
            for t in (sync_w, ov_w, sync_w, ov_w):  # two steps each: the second is the miss
                t.step()
            worst.append(ov_w.step_s / sync_w.step_s)
        corr = ov_w.last.get("correction", 0.0)
        n = sum(p.numel() for p in sync.model.parameters())
        lines.append(f"| {name} | {n / 1e6:.1f} M | {r.median('sync'):.3f} | "
                     f"{r.median('overlap'):.3f} | {r.ratio('overlap', 'sync'):.3f} | "
                     f"{statistics.median(hidden):.2f} | {statistics.median(worst):.2f} "
                     f"(undo {corr * 1e3:.0f} ms) |")
        del sync, ov, sync_w, ov_w
    return lines


def _corpus_batches(steps, batch, seq):
    from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

    docs = stdlib_corpus(max_mb=1.0)
    tok = train_tokenizer(docs)
    ids = torch.tensor([t for d in docs for t in tok(d)["input_ids"] + [0]])
    n = steps * batch * seq
    ids = ids[:n].reshape(steps, batch, seq) if ids.numel() >= n else \
        ids.repeat(-(-n // ids.numel()))[:n].reshape(steps, batch, seq)
    return list(ids)


def _run(data, *, overlap, poison_every=0, **plugin):
    torch.manual_seed(0)
    model = quickstart()
    opt = _engine(model, threads=2, overlap=overlap, bucket_size_mb=0.25, **plugin)
    inf = {"on": False}
    model.transformer.h[0].mlp.c_fc.weight.register_hook(
        lambda g: g.index_fill(0, torch.tensor([1]), float("inf")) if inf["on"] else g)
    losses, skipped = [], []
    for i, ids in enumerate(data):
        inf["on"] = bool(poison_every) and i % poison_every == poison_every - 1
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        skipped.append(opt.last_step_skipped)
    masters = torch.cat([b.state.master for b in opt.buckets])
    return losses, skipped, masters, opt


def _ulps(a, b):
    size = torch.maximum(a.abs(), b.abs())
    ulp = torch.nextafter(size, torch.tensor(float("inf"))) - size
    return float(((a - b).abs() / ulp).max())


def fidelity(args) -> list[str]:
    torch.set_num_threads(1)
    data = _corpus_batches(args.steps, 8, 64)
    lines = ["| run | steps | hit rate | max loss diff (rel) | masters max diff | skips equal |",
             "|---|---|---|---|---|---|"]
    for label, plugin, poison in (
            ("bf16, max_grad_norm 1.0", dict(compute_dtype="bf16", max_grad_norm=1.0), 0),
            ("fp16, max_grad_norm 1.0, inf every 50 steps",
             dict(compute_dtype="fp16", max_grad_norm=1.0), 50)):
        ls, ss, ms, _ = _run(data, overlap=False, poison_every=poison, **plugin)
        lo, so, mo, opt = _run(data, overlap=True, poison_every=poison, **plugin)
        diff = max(abs(a - b) / abs(b) for a, b in zip(lo, ls))
        hit = opt.schedule.hits / max(1, opt.schedule.speculated)
        lines.append(f"| {label} | {len(data)} | {hit:.2f} ({opt.schedule.hits} of "
                     f"{opt.schedule.speculated}) | {diff:.1e} | {_ulps(mo, ms):.0f} ulp "
                     f"(final loss {lo[-1]:.4f} vs {ls[-1]:.4f}) | {so == ss} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["timing", "fidelity", "all"], nargs="?", default="all")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--bucket_size_mb", type=float, default=0.0,
                   help="default: 0.25 for the quickstart model, 4 for the 100 M Llama")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.what in ("timing", "all"):
        print("\n".join(timing(args)))
    if args.what in ("fidelity", "all"):
        print("\n".join(fidelity(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
