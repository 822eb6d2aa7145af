"""Training runs for the tensor-parallel tests (spawned by `_dp_worker.spawn` as
``"tests.offload._tp_worker:<function>"``; one process calls them directly).

The model is torch tensor parallelism's textbook block: a column-parallel up projection into
a row-parallel down projection (even shards, whose Replicate bias every rank updates), a
column-parallel head gathered to Replicate with 97 outputs (uneven shards: 49 and 48 rows),
and plain params around them (embedding, norm, a frozen layer, a head used on some steps).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.offload.support import local, local_grad
from hf_zoffload.ops import adam_kernels as ca
from hf_zoffload.ops import masters as ms
from hf_zoffload.ops import moments as mo

LR, ACCUM, MAX_NORM, STEPS, ROWS, VOCAB, SEQ, D, H = 3e-3, 2, 0.5, 10, 4, 97, 16, 32, 64


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.norm = torch.nn.LayerNorm(D)
        self.frozen = torch.nn.Linear(D, D)
        self.up = torch.nn.Linear(D, H)
        self.down = torch.nn.Linear(H, D)
        self.head = torch.nn.Linear(D, VOCAB)
        self.extra = torch.nn.Linear(D, 1)
        self.frozen.requires_grad_(False)

    def forward(self, ids, *, extra: bool):
        h = self.emb(ids)
        h = h + self.down(torch.nn.functional.gelu(self.up(self.frozen(self.norm(h)))))
        logits = self.head(h[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        if extra:
            loss = loss + 0.05 * self.extra(h).pow(2).mean()
        return loss


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate())}


def parallelize(model: Model, tp: int, dp: int = 1):
    """Shard ``model`` over a tensor-parallel mesh of ``tp`` ranks (the last dim of a
    (dp, tp) world mesh when ``dp`` > 1)."""
    if dp == 1:
        mesh = init_device_mesh("cpu", (tp,))
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    return parallelize_module(model, mesh, PLAN)


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(n)]


def decay_groups(model):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


@torch.no_grad()
def whole(model) -> list[torch.Tensor]:
    """Every param as the whole tensor (a collective per DTensor: every rank calls it)."""
    # clone: full_tensor() of a Replicate DTensor is its local tensor, which later steps change
    return [(p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
            for p in model.parameters()]


def train(rank: int, world: int, *, tp: int | None = None, start: int = 0, stop: int = STEPS,
          load: str | None = None, save_at: int | None = None, save: str | None = None,
          plugin: dict | None = None) -> dict:
    """Steps [start, stop): ACCUM micro-steps each (summed by the engine), clipping, a param
    with a grad on every third step only. Data parallel rank d of ``world // tp`` gets
    rows [d*k, (d+1)*k) of each micro-batch; the ranks of a tensor-parallel group the same."""
    tp = world if tp is None else tp
    dp = world // tp
    data = batches(STEPS * ACCUM)
    model = Model()
    ckpt = torch.load(load, weights_only=True) if load else None
    if ckpt is not None:  # whole tensors: loaded before the model is sharded
        model.load_state_dict(ckpt["model"])
    if tp > 1:
        parallelize(model, tp, dp)
    opt = ZeroOffloadOptimizer(decay_groups(model), lr=LR, plugin=ZeroOffloadPlugin(
        bucket_size_mb=0.004, **(plugin or {"compute_dtype": "fp32"})))
    model.frozen.to(opt.dtype)  # the engine casts only the params it trains
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / 2, (STEPS - s) / (STEPS - 2)))
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
    k, d = ROWS // dp, rank // tp
    losses, norms, params = [], [], []
    for step in range(start, stop):
        total = 0.0
        for micro in range(ACCUM):
            ids = data[step * ACCUM + micro][d * k:(d + 1) * k]
            loss = model(ids, extra=step % 3 == 0)
            (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        sched.step()
        model.zero_grad(set_to_none=True)
        losses.append(total)
        params.append(whole(model))
        if save_at == step + 1:
            sd = {"model": opt.master_state_dict(model), "opt": opt.state_dict(),
                  "sched": sched.state_dict()}  # collectives: every rank calls them
            if rank == 0:
                torch.save(sd, save)
    masters = opt.master_state_dict(model)
    out = {"losses": losses, "norms": norms, "params": params, "masters": masters,
           "memory": opt.memory_report(), "sent": dict(getattr(opt.exchange, "sent", {})),
           "buckets": [(b.layout.sharded, b.layout.numel) for b in opt.buckets]}
    if dist.is_initialized():
        dist.barrier()
    return out


def runs(rank: int, world: int, *, jobs: list[tuple[str, dict]]) -> list[dict]:
    """Several runs in one spawn: starting processes costs more than a tiny run."""
    return [globals()[name](rank, world, **kwargs) for name, kwargs in jobs]


def keyed(rank: int, world: int, *, state: str = "int4", steps: int = 4) -> dict:
    """A bf16 master over ``world`` tensor-parallel ranks against the kernel applied by hand
    to each rank's local tensors: a second copy of the model, sharded the same way, gets
    the same data, and each of its trainable params p (index i in the optimizer's order)
    is updated with ``adam_update`` on ``local(p)`` with the rounding key
    ``step_key(seed, p's step, i)`` and first element 0, the rule docs/design.md states
    for tensor-parallel shards ("bf16 master"). One backward a step, no clipping: the two
    models compute the same gradients. Returns, per step, whether every local tensor of
    the engine's model equals the reference's, and the whole params."""
    model = parallelize(Model(), world)
    ref = parallelize(Model().to(torch.bfloat16), world)
    opt = ZeroOffloadOptimizer(decay_groups(model), lr=LR, plugin=ZeroOffloadPlugin(
        bucket_size_mb=0.004, compute_dtype="bf16", master_dtype="bf16", state_dtype=state))
    model.frozen.to(opt.dtype)
    fmt = mo.FORMATS[state]
    groups = [(i, wd, p) for i, (wd, p) in enumerate(
        (g["weight_decay"], p) for g in decay_groups(ref) for p in g["params"])]
    st = {}
    for _, _, p in groups:
        n = local(p).numel()
        st[id(p)] = [0, torch.zeros(fmt.storage(n), dtype=fmt.dtype),
                     torch.zeros(fmt.storage(n), dtype=fmt.dtype),
                     (torch.zeros(fmt.n_scales(n)), torch.zeros(fmt.n_scales(n)))
                     if fmt.scaled else None]
    data, same, params = batches(steps), [], []
    for t in range(steps):
        for m in (model, ref):
            m(data[t], extra=t % 3 == 0).backward()
        opt.step()
        opt.zero_grad()
        for index, wd, p in groups:
            if not p.requires_grad or p.grad is None:
                continue
            s = st[id(p)]
            s[0] += 1
            ca.adam_update(local(p).view(-1), local_grad(p, p.grad).reshape(-1), s[1], s[2],
                           step=s[0], lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                           scales=s[3], state_dtype=state,
                           sr=(ms.step_key(opt.sr_seed, s[0], index), 0))
            p.grad = None
        same.append(all(torch.equal(local(a), local(b))
                        for a, b in zip(model.parameters(), ref.parameters())))
        params.append(whole(model))
    dist.barrier()
    return {"same": same, "params": params}
