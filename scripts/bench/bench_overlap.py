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
- ``fidelity``: 300 steps of the quickstart model on the local corpus (``--batch`` x
  ``--seq`` tokens), clipping at 1.0, both schedules, in bf16 and in fp16 with an inf
  injected into one gradient every ``--inf_every`` (50) steps. Free-running (each schedule
  on its own): the speculation hit rate, the skips, the largest loss and masters
  differences. Lockstep (the overlapped run takes the synchronous run's state after every
  step, so each step's difference is its own): the masters' largest difference after a
  step whose speculation held (0: bitwise) and after a corrected one, and the corrected
  steps' largest error as a share of the derived bound (``inverse.bound`` /
  ``undo_bound``: at most 1).

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
from hf_zoffload.offload.schedules import inverse  # noqa: E402


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


class _Run:
    """The quickstart model and an engine (synchronous or overlapped) on 2 threads, with an
    inf put into one first-layer gradient on the steps asked for (its gradient lands last
    in backward: every other bucket has been updated early by then)."""

    def __init__(self, *, overlap, **plugin):
        torch.manual_seed(0)
        self.model = quickstart()
        self.opt = _engine(self.model, threads=2, overlap=overlap, bucket_size_mb=0.25,
                           **plugin)
        self.inf = False
        # its own random stream (the model's dropout), so two runs stepped in turn draw the
        # same masks as each would alone
        self.rng = torch.get_rng_state()
        self.model.transformer.h[0].mlp.c_fc.weight.register_hook(
            lambda g: g.index_fill(0, torch.tensor([1]), float("inf")) if self.inf else g)

    def backward(self, ids, *, poison: bool) -> float:
        self.inf = poison
        saved = torch.get_rng_state()
        torch.set_rng_state(self.rng)
        try:
            loss = self.model(input_ids=ids, labels=ids).loss
            self.opt.backward(loss)
        finally:
            self.rng = torch.get_rng_state()
            torch.set_rng_state(saved)
        return loss.item()

    def step(self, ids, *, poison: bool) -> tuple[float, bool]:
        loss = self.backward(ids, poison=poison)
        self.opt.step()
        self.opt.zero_grad()
        return loss, self.opt.last_step_skipped

    def state64(self, i: int) -> dict[str, torch.Tensor]:
        s = self.opt.buckets[i].state
        return {"p": s.master.double(), "m": s.exp_avg.double(), "v": s.exp_avg_sq.double()}

    def masters(self) -> torch.Tensor:
        return torch.cat([b.state.master for b in self.opt.buckets])

    def take_state_of(self, other: _Run) -> None:
        """This run's masters, moments and params set to ``other``'s (the same bucket
        layout: the same model, settings and first backward). Through ``.data``, which the
        engine's watch for outside writes does not see: the masters are set with them."""
        for a, b in zip(self.opt.buckets, other.opt.buckets, strict=True):
            for name in ("master", "exp_avg", "exp_avg_sq"):
                getattr(a.state, name).copy_(getattr(b.state, name))
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), other.model.parameters(), strict=True):
                p.data.copy_(q.data)


def _poisoned(i: int, every: int) -> bool:
    return bool(every) and i % every == every - 1


def _ulps(a, b, prev):
    """The largest difference of ``a`` from ``b`` in ulp of the larger of ``b`` and its
    step's update ``b - prev``: a master near 0 (a bias) moves by the update's roundings,
    not by its own (tests/offload/test_overlapped.py measures the same)."""
    size = torch.maximum(b.abs(), (b - prev).abs())
    ulp = torch.nextafter(size, torch.tensor(float("inf"))) - size
    return float(((a - b).abs() / ulp).max())


def _free_running(data, poison, plugin) -> dict:
    """Both schedules on their own for every step: what a run sees, differences compounding."""
    sync, ov = _Run(overlap=False, **plugin), _Run(overlap=True, **plugin)
    ls, ss, lo, so = [], [], [], []
    for i, ids in enumerate(data):
        loss, skip = sync.step(ids, poison=_poisoned(i, poison))
        ls.append(loss)
        ss.append(skip)
        loss, skip = ov.step(ids, poison=_poisoned(i, poison))
        lo.append(loss)
        so.append(skip)
    sched = ov.opt.schedule
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(lo, ls)),
            "masters_abs": float((ov.masters() - sync.masters()).abs().max()),
            "skips_equal": ss == so,
            "skips": sum(ss), "skips_ov": sum(so), "final": (lo[-1], ls[-1]),
            "hit": (sched.hits, sched.speculated)}


def _control(data, poison, plugin) -> float:
    """Two synchronous runs, the second's fp32 masters moved 1 ulp up after its first step:
    the largest relative loss difference between them, what a 1-ulp difference alone grows
    into over the same steps (the yardstick of the free-running columns)."""
    a, b = _Run(overlap=False, **plugin), _Run(overlap=False, **plugin)
    worst = 0.0
    for i, ids in enumerate(data):
        la, _ = a.step(ids, poison=_poisoned(i, poison))
        lb, _ = b.step(ids, poison=_poisoned(i, poison))
        worst = max(worst, abs(lb - la) / abs(la))
        if i == 0:
            for bucket in b.opt.buckets:
                m = bucket.state.master
                m.copy_(torch.nextafter(m, torch.full_like(m, float("inf"))))
    return worst


def _within_bound(sync, ov, prev, early, norm) -> float:
    """The largest error of the overlapped run's corrected state against the synchronous
    one, as a share of the derived bound (`inverse.bound` for a step redone, `undo_bound`
    for one undone and skipped): at most 1 where the bound holds. ``prev``: each bucket's
    state before the step; ``early``: bucket -> (its early update, the state it left)."""
    skipped = sync.opt.last_step_skipped
    coef = min(1.0, sync.opt.plugin.max_grad_norm / (norm + 1e-6)) if not skipped else 1.0
    worst = 0.0
    for i, (work, spec) in early.items():
        got, want = ov.state64(i), (prev[i] if skipped else sync.state64(i))
        for r in work.runs:
            cut = {k: {n: t[r.lo:r.hi] for n, t in d.items()}
                   for k, d in (("prev", prev[i]), ("spec", spec), ("new", want), ("got", got))}
            k = inverse.coefficients(r, r.grad_scale)
            g = (work.grad[r.lo:r.hi].float() * k["gs"]).double()  # the kernel's g
            if skipped:
                lim = inverse.undo_bound(cut["prev"], cut["spec"], g, k)
            else:
                k_new = inverse.coefficients(r, r.grad_scale * coef)
                lim = inverse.bound(cut["prev"], cut["spec"], cut["new"], g, k, k_new)
            for n in "pmv":
                err = (cut["got"][n] - cut["new"][n]).abs()
                share = torch.where(err > 0, err / lim[n], torch.zeros_like(err))
                worst = max(worst, float(share.max()))
    return worst


def _lockstep(data, poison, plugin) -> dict:
    """Each step from the same state: after every step the overlapped run takes the
    synchronous run's state, so each step's difference is that step's own (the bound of
    docs/protocols/step.md is per step). Reported: the largest masters difference (`_ulps`)
    after a step whose speculation held (0: bitwise) and after one corrected (undone and
    redone, or undone for a skip), and the corrected steps' largest error as a share of
    the derived bound (`_within_bound`)."""
    sync, ov = _Run(overlap=False, **plugin), _Run(overlap=True, **plugin)
    stood, fixed, n_fixed, share = 0.0, 0.0, 0, 0.0
    for i, ids in enumerate(data):
        poisoned = _poisoned(i, poison)
        prev = {j: {n: t.clone() for n, t in sync.state64(j).items()}
                for j in range(len(sync.opt.buckets))}
        before = sync.masters().clone()
        sync.step(ids, poison=poisoned)
        hits = ov.opt.schedule.hits
        ov.backward(ids, poison=poisoned)
        ov.opt.schedule.end_window(ov.opt)  # the worker done: the speculative state is here
        early = {j: (w, {n: t.clone() for n, t in ov.state64(j).items()})
                 for j, w in ov.opt.schedule._early.items()}
        ov.opt.step()
        ov.opt.zero_grad()
        d = _ulps(ov.masters(), sync.masters(), before)
        if ov.opt.schedule.hits > hits:
            stood = max(stood, d)
        elif early:
            fixed, n_fixed = max(fixed, d), n_fixed + 1
            share = max(share, _within_bound(sync, ov, prev, early, sync.opt.grad_norm))
        ov.take_state_of(sync)
    return {"stood_ulp": stood, "fixed_ulp": fixed, "n_fixed": n_fixed, "share": share}


def fidelity(args) -> list[str]:
    torch.set_num_threads(1)
    data = _corpus_batches(args.steps, args.batch, args.seq)
    lines = ["| run | steps | hit rate | skips (equal) | free-running: max loss diff (rel), "
             "masters max diff, final loss overlap / sync | control: two synchronous runs, one "
             "moved 1 ulp after step 1: max loss diff (rel) | lockstep: masters max diff "
             "after a held step / a corrected step (steps corrected) | lockstep: corrected "
             "steps' largest error / derived bound |",
             "|---|---|---|---|---|---|---|---|"]
    for label, plugin, poison in (
            ("bf16, max_grad_norm 1.0", dict(compute_dtype="bf16", max_grad_norm=1.0), 0),
            (f"fp16, max_grad_norm 1.0, inf every {args.inf_every} steps",
             dict(compute_dtype="fp16", max_grad_norm=1.0), args.inf_every)):
        f = _free_running(data, poison, plugin)
        k = _lockstep(data, poison, plugin)
        ctl = _control(data, poison, plugin)
        hits, tried = f["hit"]
        skips = f"{f['skips']} ({f['skips_equal']}"
        skips += ")" if f["skips_equal"] else f", overlap {f['skips_ov']})"
        lines.append(
            f"| {label} | {len(data)} | {hits / max(1, tried):.2f} ({hits} of {tried}) | "
            f"{skips} | {f['loss_rel']:.1e}, "
            f"{f['masters_abs']:.1e}, {f['final'][0]:.4f} / {f['final'][1]:.4f} | {ctl:.1e} | "
            f"{k['stood_ulp']:.0f} ulp / {k['fixed_ulp']:.0f} ulp ({k['n_fixed']}) | "
            f"{k['share']:.2f} |")
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
    p.add_argument("--steps", type=int, default=300, help="fidelity: steps of each run")
    p.add_argument("--inf_every", type=int, default=50,
                   help="fidelity: the fp16 runs' steps between injected infs")
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
