"""Trainer runs for tests/integrations/test_fsdp2.py: the ZeroOffloadTrainer with ``--fsdp
"full_shard offload"`` (FSDP2 parameter offload) and without (the plain ZeRO-Offload mode), on
the tiny Llama. Run as a script by torchrun (every rank runs every job, rank 0 writes the
results), or called in one process (`one_rank` sets up the one-rank gloo group the Trainer's
``--fsdp`` needs: transformers refuses FSDP outside distributed training).

    python -m torch.distributed.run --nproc_per_node N tests/integrations/_fsdp2_worker.py OUT JOBS
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_zoffload.integrations.trainer import (  # noqa: E402
    ZeroOffloadTrainer,
    ZeroOffloadTrainingArguments,
)
from tests._tiny import VOCAB, TokenBlocks, tiny_llama  # noqa: E402

STEPS, BATCH, SEQ, LR, MAX_NORM = 4, 4, 16, 1e-2, 0.5
FSDP = "full_shard offload"
# load_best_model_at_end over a held-out set: evaluated and saved every step, the best and the
# newest checkpoint kept. "Best" is the highest held-out loss, so that it is not the last
# checkpoint (the lowest was the last one here): the loaded weights differ from the last step's.
BEST = dict(eval_strategy="steps", eval_steps=1, save_steps=1, load_best_model_at_end=True,
            metric_for_best_model="eval_loss", greater_is_better=True, save_total_limit=2)


@contextlib.contextmanager
def one_rank(mp):
    """This process as rank 0 of 1 (gloo, an in-memory store), as torchrun would start it;
    ``mp``: a pytest MonkeyPatch for the environment accelerate reads and writes."""
    for key, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29500"),
                       # unset, accelerate's MULTI_CPU set-up changes torch's thread count
                       ("OMP_NUM_THREADS", str(torch.get_num_threads()))):
        mp.setenv(key, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def whole(model) -> dict[str, torch.Tensor]:
    """Every param whole, fp32 (a collective per DTensor: every rank calls it)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in model.named_parameters()}


def by_hand(model):
    """``model`` sharded by ``fully_shard`` with CPU offload: each decoder layer, then the
    root (what a user's own FSDP2 set-up does, without accelerate's plugin)."""
    policy = CPUOffloadPolicy(pin_memory=False)  # no device to pin for
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=policy)
    return fully_shard(model, offload_policy=policy)


def trainer(out: str, *, fsdp: bool | str, resume_from: str | None = None, best: bool = False,
            **kw) -> dict:
    """4 steps of 2 micro-batches of 4 blocks (split between the ranks), fp32, clipping that
    bites, checkpoints at 2 and 4; ``fsdp``: ``--fsdp "full_shard offload"`` (True), or
    "hand" for a model sharded `by_hand` without --fsdp; resumed from ``resume_from`` if
    given; with ``best``, `BEST`'s evaluations and checkpoints. Returns the logged losses
    and norms, the rows of a micro-step over all ranks, the whole params, the host bytes and
    the exchange's class; with ``best`` also the best checkpoint and the whole fp32 masters
    (rank 0's gather)."""
    AcceleratorState._reset_state()  # an earlier job's accelerate state
    GradientState._reset_state()
    # torchrun's (and `one_rank`'s) WORLD_SIZE: the process group is up only once the first
    # job's arguments have set it up, so asking torch.distributed gave the first job of a run
    # a per-rank batch of BATCH and the later ones BATCH // 2 (the "2-rank discrepancy").
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = ZeroOffloadTrainingArguments(**{
        "output_dir": out, "zero_offload": True, "fsdp": FSDP if fsdp is True else None,
        "per_device_train_batch_size": BATCH // world, "gradient_accumulation_steps": 2,
        "max_steps": STEPS, "learning_rate": LR, "weight_decay": 0.1,
        "max_grad_norm": MAX_NORM, "warmup_steps": 1, "logging_steps": 1,
        "save_strategy": "steps", "save_steps": 2, "report_to": [], "use_cpu": True,
        "seed": 0, "disable_tqdm": True, "ddp_timeout": 120,
        "dataloader_pin_memory": False, **(BEST if best else {}), **kw})
    model = by_hand(tiny_llama()) if fsdp == "hand" else tiny_llama()
    tr = ZeroOffloadTrainer(model=model, args=args,
                            train_dataset=TokenBlocks(64, vocab=VOCAB, seq=SEQ),
                            eval_dataset=TokenBlocks(4, vocab=VOCAB, seq=SEQ, seed=3)
                            if best else None)
    tr.train(resume_from_checkpoint=resume_from)
    logs = [e for e in tr.state.log_history if "loss" in e]
    out = {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
           "rows": args.per_device_train_batch_size * world,
           "params": whole(tr.model), "host": tr.engine.memory_report()["host_total"],
           "exchange": type(tr.engine.exchange).__name__}
    if best:  # master_state_dict is a gather every rank enters
        out.update(best=tr.state.best_model_checkpoint,
                   masters=tr.engine.master_state_dict(tr.model))
    return out


def fsdp2(out: str) -> dict:
    return trainer(out, fsdp=True)


def plain(out: str) -> dict:
    return trainer(out, fsdp=False)


def fsdp2_hand(out: str) -> dict:
    return trainer(out, fsdp="hand")


def fsdp2_best(out: str) -> dict:
    return trainer(out, fsdp=True, best=True, bf16=True)


def main(out: str, jobs: str) -> None:
    results = {name: globals()[name](os.path.join(out, name)) for name in jobs.split(",")}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    dist.barrier()


def cli(argv: list[str]) -> int:
    """What a rank runs (under torchrun, or forked by tests/_preloaded.py's server)."""
    main(*argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
