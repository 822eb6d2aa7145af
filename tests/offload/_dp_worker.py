"""Training runs for the data-parallel tests, as importable module-level functions (spawned
processes re-import them by name), plus `spawn` to run one on N gloo ranks."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.offload.memory import accumulation_needed

# Plain torch, no transformers: a spawned rank imports in ~5 s instead of ~13 s (2 cores).
LR, ACCUM, MAX_NORM, STEPS, ROWS, VOCAB, SEQ = 3e-3, 2, 0.5, 10, 4, 97, 16


class Model(torch.nn.Module):
    """A tiny causal-LM-shaped net (odd sizes, so buckets need padding), one frozen layer,
    and a head that only rank 0 (rows [0, ROWS/2) of the full batch) uses on some steps:
    a param with a grad on one rank only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 31)
        self.norm = torch.nn.LayerNorm(31)
        self.up = torch.nn.Linear(31, 67)
        self.frozen = torch.nn.Linear(67, 67)
        self.down = torch.nn.Linear(67, 31)
        self.head = torch.nn.Linear(31, VOCAB)
        self.extra = torch.nn.Linear(31, 1)
        self.frozen.requires_grad_(False)

    def forward(self, ids, *, extra_rows: int, extra_weight: float):
        h = self.emb(ids)
        h = h + self.down(torch.tanh(self.frozen(torch.nn.functional.gelu(self.up(self.norm(h))))))
        logits = self.head(h[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        if extra_rows:
            loss = loss + 0.1 * extra_weight * self.extra(h[:extra_rows]).pow(2).mean()
        return loss


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(n)]


def decay_groups(model):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def build(*, process_group=None, bucket_size_mb=0.01, model=None, device="cpu", **plugin):
    model = (Model() if model is None else model).to(device)
    opt = ZeroOffloadOptimizer(decay_groups(model), lr=LR, process_group=process_group,
                               plugin=ZeroOffloadPlugin(bucket_size_mb=bucket_size_mb, **plugin),
                               model=model)
    model.frozen.to(opt.dtype)  # the engine casts only the params it trains
    return model, opt


def make(**plugin):
    model, opt = build(**plugin)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up over 2 steps, then decay
        opt, lambda s: min((s + 1) / 2, (STEPS - s) / (STEPS - 2)))
    return model, opt, sched


def train(rank: int, world: int, *, start=0, stop=STEPS, load=None, save_at=None, save=None,
          kill_at=None, hang=False, kill_dir=None, plugin=None, full_batch=False,
          max_norm=MAX_NORM):
    """Steps [start, stop) of one run. Rank r of `world` gets rows [r*k, (r+1)*k) of every
    micro-batch, so that N ranks on ROWS/N rows each see the gradient of 1 rank on ROWS.
    ``full_batch``: every rank gets all ROWS rows and the one-process objective, so the
    average of the ranks' gradients is the one-process gradient, bit for bit.

    Accumulation over ACCUM micro-steps with all three boundary styles: even steps mark the
    first micro-step with no_sync(); odd steps synchronize every micro-step; steps 4 and 9
    run every micro-step without sync, so step() reduces."""
    data = batches(STEPS * ACCUM)
    model, opt, sched = make(**(plugin or {"compute_dtype": "fp32"}))
    if load is not None:
        ckpt = torch.load(load, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
    k, part = (ROWS, 0) if full_batch else (ROWS // world, rank)
    losses, norms, no_sync_bytes = [], [], 0
    for step in range(start, stop):
        total = 0.0
        for micro in range(ACCUM):
            ids = data[step * ACCUM + micro][part * k:(part + 1) * k]
            use_extra = step % 3 == 0 and part == 0
            # the objective of the full batch: lm loss + 0.05 * extra term of rows [0, 2)
            loss = model(ids, extra_rows=ROWS // 2 if use_extra else 0,
                         extra_weight=0.5 * (ROWS // k))
            unsynced = step in (4, 9) or (step % 2 == 0 and micro < ACCUM - 1)
            sent = opt.collective_bytes if opt.exchange.world > 1 else None
            with opt.no_sync() if unsynced else _null():
                if kill_at == (step, micro) and rank == 1:
                    with open(os.path.join(kill_dir, "stopped_at"), "w") as fh:
                        fh.write(repr(time.time()))
                    if hang:  # alive, but never joins the collectives again
                        time.sleep(3600)
                    os._exit(17)  # dies mid-step, while rank 0 runs its backward
                (loss / ACCUM).backward()
            if unsynced and opt.exchange.world > 1:
                no_sync_bytes += sum(opt.exchange.sent.values()) - sum(sent.values())
            total += loss.item() / ACCUM
        norms.append(float(opt.clip_grad_norm_(max_norm)))
        opt.step()
        sched.step()
        model.zero_grad(set_to_none=True)
        losses.append(total)
        if save_at == step + 1:
            sd = {"model": model.state_dict(), "opt": opt.state_dict(),
                  "sched": sched.state_dict()}  # opt.state_dict(): every rank calls it
            if rank == 0:
                torch.save(sd, save)
    masters = opt.master_state_dict(model)  # a collective: rank 0 gets it, the others None
    _synchronize(opt)
    return {"losses": losses, "norms": norms, "masters": masters,
            "params": [p.detach().clone() for p in model.parameters()],
            "memory": opt.memory_report(), "no_sync_bytes": no_sync_bytes,
            # what memory_report(accumulates=True) counts ahead, and what the pool then held
            "acc_need": accumulation_needed(
                [b.layout.padded for b in opt.buckets], world=opt.exchange.world,
                param_bytes=opt.dtype.itemsize, delayed_update=opt.plugin.delayed_update,
                pinned=opt.host_pool.pin), "held": opt.host_pool.held(),
            "bucket_order": opt.bucket_order,
            "sent": dict(opt.exchange.sent) if opt.exchange.world > 1 else {}}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def overflow(rank: int, world: int) -> dict:
    """fp16: an inf in one rank's grads at step 2 makes every rank skip that step. Rank 1
    starts from other params: the engine starts every rank from rank 0's."""
    model = Model()
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0 if p.requires_grad else 0.0)  # frozen ones are the caller's
    model, opt = build(model=model, compute_dtype="fp16", init_scale=2.0**10, hysteresis=1)
    start = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    poison = {"on": False}
    model.up.weight.register_hook(
        lambda g: g.index_fill(0, torch.tensor([3]), float("inf")) if poison["on"] else g)
    data, k, skipped = batches(4), ROWS // world, []
    for step in range(4):
        poison["on"] = step == 2 and rank == 1
        opt.backward(model(data[step][rank * k:(rank + 1) * k], extra_rows=0, extra_weight=0))
        opt.step()
        skipped.append(opt.last_step_skipped)
    _synchronize(opt)
    return {"skipped": skipped, "scale": opt.loss_scaler.loss_scale, "start": start,
            "params": [p.detach().clone() for p in model.parameters()]}


def _synchronize(opt) -> None:
    """Before params are read: the copies of an emulated device are done (a no-op with the
    engine's own copiers; tests/offload/_async_copier.py)."""
    sync = getattr(opt.copier.streams, "synchronize", None)
    if sync is not None:
        sync()


def with_copier(rank: int, world: int, *, job: tuple[str, dict], copier: dict | None = None):
    """Run ``job`` (name, kwargs) with the engine's own copier, or with ``copier`` given
    (`_async_copier.installed` options: seed, cuda_path, ...) through `AsyncCopier`: copies
    on a worker thread with random delays, so a missing wait changes the result. Adds the
    host state of the engine the job built, once a pending delayed update has landed."""
    global build
    built, plain_build = [], build

    def recording_build(**kwargs):
        built.append(plain_build(**kwargs))
        return built[-1]

    with contextlib.ExitStack() as stack:
        if copier is not None:
            from tests.offload._async_copier import installed
            made = stack.enter_context(installed(**copier))
        build = recording_build
        try:
            result = globals()[job[0]](rank, world, **job[1])
        finally:
            build = plain_build
        (_, opt), = built
        opt.flush()  # a collective: every rank runs the same jobs
        _synchronize(opt)
        result["host"] = [t.clone() for b in opt.buckets
                          for t in (b.state.master, b.state.exp_avg, b.state.exp_avg_sq)]
        result["copier"] = type(opt.copier.streams).__name__
        if copier is not None:
            result["copier_jobs"] = sum(c.counts["jobs"] for c in made)
    return result


def checkpointed(rank: int, world: int, *, reentrant: bool, steps: int = 3) -> dict:
    """Every trainable param inside activation-checkpointed blocks (two per forward), as in
    LoRA fine-tuning with frozen embeddings and head: with ``reentrant`` each block's grads
    come from a nested backward. Returns the params, the bytes handed to collectives and the
    end-of-backward calls per backward."""
    from torch.utils.checkpoint import checkpoint

    model, opt = build(bucket_size_mb=0.002, compute_dtype="fp32")
    for m in (model.emb, model.norm, model.head, model.extra):
        m.requires_grad_(False)
    calls, end, in_backward = [], opt._end_backward, []
    opt._end_backward = lambda: (calls.append(bool(in_backward)), end())[1]
    data, k = batches(steps), ROWS // world
    for ids in data:
        in_backward.append(1)
        ids = ids[rank * k:(rank + 1) * k]
        # frozen layers below: the input must require grad for the reentrant form to build a
        # graph (what transformers' enable_input_require_grads does)
        h = model.norm(model.emb(ids)).requires_grad_(True)
        up = checkpoint(lambda x: torch.nn.functional.gelu(model.up(x)), h,
                        use_reentrant=reentrant)
        h = h + checkpoint(lambda x: model.down(torch.tanh(model.frozen(x))), up,
                           use_reentrant=reentrant)
        logits = model.head(h[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                          ids[:, 1:].reshape(-1)).backward()
        in_backward.clear()  # step() ends the window with a call of its own
        landed = [b.window.landed for b in opt.buckets]
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "sent": dict(opt.exchange.sent) if opt.exchange.world > 1 else {},
            "calls_per_backward": sum(calls) / steps, "max_landed": max(landed)}


def runs(rank: int, world: int, *, jobs: list[tuple[str, dict]]) -> list[dict]:
    """Several runs in one spawn: starting processes costs more than a tiny run."""
    return [globals()[name](rank, world, **kwargs) for name, kwargs in jobs]


def _entry(rank, world, port, fn_name, kwargs, out_dir, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = _resolve(fn_name)(rank, world, **kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _resolve(fn_name: str):
    """A function of this module by name, or ``"module:function"`` of another (the
    tensor-parallel runs live in tests/offload/_tp_worker.py)."""
    if ":" not in fn_name:
        return globals()[fn_name]
    module, name = fn_name.split(":")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def one_rank():
    """A one-process gloo group in this process, for tests that build a mode's exchange
    without spawning ranks."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports, imported once by the forkserver that forks each rank: a rank
# started by "spawn" imported torch and hf_zoffload itself (~5 s on 2 cores, 18 ranks in
# the suite). The server is one per test process and only imports; each rank is a fresh fork
# of it with its environment as it was when the first spawn started it.
PRELOAD = (__name__, "tests.offload._tp_worker")


def spawn(fn_name: str, out_dir: str, *, world: int = 2, timeout_s: float = 60.0,
          wait_s: float = 240.0, grace_s: float | None = None, **kwargs):
    """Run ``fn_name(rank, world, **kwargs)`` on ``world`` gloo ranks whose collectives time
    out after ``timeout_s``. Once a rank fails, the others get ``grace_s`` seconds to end on
    their own, then are killed (as is everything still running after ``wait_s``).

    Returns (exit codes, time.time() at which each was seen to end, results by rank (None
    where a rank failed), error texts by rank)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read once, when the server starts
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn_name, kwargs, out_dir,
                                              timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    deadline, ended = time.monotonic() + wait_s, [None] * world
    while None in ended and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if ended[r] is None and not p.is_alive():
                ended[r] = time.time()
                if p.exitcode != 0 and grace_s is not None:
                    deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.05)
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
        p.join()
        ended[r] = ended[r] or time.time()
    results, errors = [], []
    for r in range(world):
        res, err = os.path.join(out_dir, f"rank{r}.pt"), os.path.join(out_dir, f"rank{r}.err")
        results.append(torch.load(res, weights_only=False) if os.path.exists(res) else None)
        errors.append(open(err).read() if os.path.exists(err) else "")
    return [p.exitcode for p in procs], ended, results, errors
