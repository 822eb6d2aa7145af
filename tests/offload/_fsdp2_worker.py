"""Training runs for the FSDP2 tests (tests/offload/test_fsdp2.py): a small net sharded by
``fully_shard`` with ``CPUOffloadPolicy`` on a CPU mesh, trained by the engine, as
importable functions that `tests.offload._dp_worker.spawn` runs on N gloo ranks (or the test
process, with one rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin

# Odd sizes: 97 and 31 rows shard unevenly over 2 ranks (49 + 48, 16 + 15: FSDP2 pads).
LR, ACCUM, MAX_NORM, STEPS, ROWS, VOCAB, DIM, HID, SEQ = 3e-3, 2, 0.5, 20, 4, 97, 31, 67, 12


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, HID)
        self.down = torch.nn.Linear(HID, DIM)
        self.reentrant: bool | None = None  # activation checkpointing: None off

    def _inner(self, h):
        return self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

    def forward(self, h):
        if self.reentrant is None:
            return h + self._inner(h)
        return h + torch.utils.checkpoint.checkpoint(self._inner, h,
                                                     use_reentrant=self.reentrant)


class Net(torch.nn.Module):
    """Embedding at the root (the root's own FSDP2 group), two blocks and a head each their
    own group; ``tied``: the head's weight is the embedding's, and the head stays in the
    root's group (FSDP2 refuses a param shared by two groups)."""

    def __init__(self, tied: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.tied = tied
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        logits = self.head(h[:, :-1]).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                 ids[:, 1:].reshape(-1))


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(n * ACCUM)]


def decay_groups(model):
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]


def shard(model, world: int, *, offload: bool = True, mp: MixedPrecisionPolicy | None = None,
          hsdp: bool = False):
    """``fully_shard`` each block, the head (unless tied) and the root over ``world`` ranks
    (``hsdp``: a 1 x world mesh, replicated over its first dim)."""
    kw = {"mesh": init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
          if hsdp else init_device_mesh("cpu", (world,))}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if mp is not None:
        kw["mp_policy"] = mp
    for m in [*model.blocks, *([] if model.tied else [model.head])]:
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def build(world: int, *, plugin: dict | None = None, lr: float = LR, tied: bool = False,
          **shard_kw):
    model = shard(Net(tied), world, **shard_kw)
    opt = ZeroOffloadOptimizer(decay_groups(model), lr=lr, model=model,
                               plugin=ZeroOffloadPlugin(bucket_size_mb=0.01, **(plugin or {})))
    return model, opt


def full_params(model) -> list[torch.Tensor]:
    """Every param whole, fp32 (an all-gather per param: every rank calls it)."""
    return [p.full_tensor().detach().float().clone() for p in model.parameters()]


class Moved:
    """The bytes FSDP2's own collectives move on this rank while active: all-gather inputs
    (params up) and reduce-scatter outputs (this rank's gradient shard down), by dtype."""

    # What FSDP2 calls: torch 2.13 dist.all_gather_single / reduce_scatter_single, torch 2.11
    # dist.all_gather_into_tensor / reduce_scatter_tensor (output, then input, in both).
    NAMES = (("all_gather_single", "reduce_scatter_single") if hasattr(dist, "all_gather_single")
             else ("all_gather_into_tensor", "reduce_scatter_tensor"))

    def __init__(self):
        self.up, self.down, self.on = {}, {}, False
        ag_name, rs_name = self.NAMES
        ag, rs = getattr(dist, ag_name), getattr(dist, rs_name)

        def all_gather(output, input, **kw):
            self._count(self.up, input)
            return ag(output, input, **kw)

        def reduce_scatter(output, input, **kw):
            self._count(self.down, output)
            return rs(output=output, input=input, **kw)

        setattr(dist, ag_name, all_gather)
        setattr(dist, rs_name, reduce_scatter)
        self._restore = lambda: setattr(dist, ag_name, ag) or setattr(dist, rs_name, rs)

    def _count(self, into, t):
        if self.on:
            key = str(t.dtype).removeprefix("torch.")
            into[key] = into.get(key, 0) + t.numel() * t.element_size()

    def close(self):
        self._restore()


def train(rank: int, world: int, *, plugin: dict | None = None, start: int = 0,
          stop: int = STEPS, load: str | None = None, save_at: int | None = None,
          save: str | None = None, no_sync: bool = False, fsdp: bool = True,
          flush: bool = False, reentrant: bool | None = None, tied: bool = False) -> dict:
    """Steps [start, stop): ACCUM micro-steps each, this rank's rows of every batch, the
    norm clipped to MAX_NORM. ``no_sync``: FSDP2 reduces only the last micro-step's
    backward (``set_requires_gradient_sync``); ``fsdp=False``: the engine on the plain net
    (one rank); ``flush``: land a delayed update before the params are read; ``reentrant``:
    each block's activations checkpointed (reentrant or not; None: off); ``tied``: the
    net with its head tied to the embedding. Returns each
    step's whole params (as the next forward sees them) and norm, the memory report, and the bytes
    FSDP2 moved in step ``start + 1``."""
    if fsdp:
        model, opt = build(world, plugin=plugin, tied=tied)
    else:
        model = Net(tied)
        opt = ZeroOffloadOptimizer(decay_groups(model), lr=LR, model=model,
                                   plugin=ZeroOffloadPlugin(bucket_size_mb=0.01,
                                                            **(plugin or {})))
    for b in model.blocks:
        b.reentrant = reentrant
    if load is not None:
        opt.load_state_dict(torch.load(load, weights_only=True))
    data, k = batches(stop), ROWS // world
    params, norms, moved = [], [], Moved()
    try:
        for step in range(start, stop):
            moved.on = step == start + 1
            for micro in range(ACCUM):
                if no_sync:
                    model.set_requires_gradient_sync(micro == ACCUM - 1)
                ids = data[step * ACCUM + micro][rank * k:(rank + 1) * k]
                opt.backward(model(ids) / ACCUM)
            norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
            opt.step()
            opt.zero_grad()
            moved.on = False
            if flush:
                opt.flush()
            params.append(full_params(model) if fsdp else
                          [p.detach().float().clone() for p in model.parameters()])
            if save_at is not None and step + 1 == save_at:
                sd = opt.state_dict()  # a collective: the whole state on rank 0
                if rank == 0:
                    torch.save(sd, save)
    finally:
        moved.close()
    local = sum(p.to_local().numel() if fsdp else p.numel() for p in model.parameters())
    return {"params": params, "norms": norms, "report": opt.memory_report(), "local": local,
            "up": moved.up, "down": moved.down,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def overflow(rank: int, world: int) -> dict:
    """fp16: an inf in the loss of the last rank at step 2 makes every rank skip it; the
    whole optimizer state before and after that step, and the params."""
    model, opt = build(world, plugin={"compute_dtype": "fp16", "init_scale": 2.0**10,
                                      "hysteresis": 1})
    data, k, out = batches(4), ROWS // world, {"skipped": [], "scale": []}
    for step in range(4):
        if step == 2:
            out["before"], out["params_before"] = opt.state_dict(), full_params(model)
        loss = model(data[step * ACCUM][rank * k:(rank + 1) * k])
        if step == 2 and rank == world - 1:
            loss = loss * float("inf")
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        out["skipped"].append(opt.last_step_skipped)
        out["scale"].append(opt.loss_scaler.loss_scale)
        if step == 2:
            out["after"], out["params_after"] = opt.state_dict(), full_params(model)
    return out


def still(rank: int, world: int) -> dict:
    """bf16 compute on the fp32 model, lr 0 and no decay: after a step the fp32 masters are
    still the fp32 initial values (FSDP2's re-read of the params at placement, padded where
    the shard is short, is not taken for an edit from outside: that would make the masters
    the bf16-rounded values)."""
    model, opt = build(world, plugin={"compute_dtype": "bf16"}, lr=0.0)
    for g in opt.param_groups:
        g["weight_decay"] = 0.0
    opt.backward(model(batches(1)[0][:ROWS // world]))
    opt.step()
    masters = opt.master_state_dict(model)
    return {"masters": None if masters is None else
            [masters[n].clone() for n, _ in model.named_parameters()]}


def runs(rank: int, world: int, *, jobs: list[tuple[str, dict]]) -> list:
    """Several runs in one spawn: starting processes costs more than a tiny run."""
    return [globals()[name](rank, world, **kwargs) for name, kwargs in jobs]
