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
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_zoffload.integrations.trainer import (  # noqa: E402
    ZeroOffloadTrainer,
    ZeroOffloadTrainingArguments,
)
from tests._tiny import VOCAB, TokenBlocks, tiny_llama  # noqa: E402

STEPS, BATCH, SEQ, LR, MAX_NORM = 4, 4, 16, 1e-2, 0.5
FSDP = "full_shard offload"


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


def trainer(out: str, *, fsdp: bool, resume_from: str | None = None, **kw) -> dict:
    """4 steps of 2 micro-batches of 4 blocks (split between the ranks), fp32, clipping that
    bites, checkpoints at 2 and 4; resumed from ``resume_from`` if given. Returns the logged
    losses and norms, the rows of a micro-step over all ranks, the whole params, the host
    bytes and the exchange's class."""
    AcceleratorState._reset_state()  # an earlier job's accelerate state
    GradientState._reset_state()
    # torchrun's (and `one_rank`'s) WORLD_SIZE: the process group is up only once the first
    # job's arguments have set it up, so asking torch.distributed gave the first job of a run
    # a per-rank batch of BATCH and the later ones BATCH // 2 (the "2-rank discrepancy").
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = ZeroOffloadTrainingArguments(**{
        "output_dir": out, "zero_offload": True, "fsdp": FSDP if fsdp else None,
        "per_device_train_batch_size": BATCH // world, "gradient_accumulation_steps": 2,
        "max_steps": STEPS, "learning_rate": LR, "weight_decay": 0.1,
        "max_grad_norm": MAX_NORM, "warmup_steps": 1, "logging_steps": 1,
        "save_strategy": "steps", "save_steps": 2, "report_to": [], "use_cpu": True,
        "seed": 0, "disable_tqdm": True, "ddp_timeout": 120,
        "dataloader_pin_memory": False, **kw})
    tr = ZeroOffloadTrainer(model=tiny_llama(), args=args,
                            train_dataset=TokenBlocks(64, vocab=VOCAB, seq=SEQ))
    tr.train(resume_from_checkpoint=resume_from)
    logs = [e for e in tr.state.log_history if "loss" in e]
    return {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
            "rows": args.per_device_train_batch_size * world,
            "params": whole(tr.model), "host": tr.engine.memory_report()["host_total"],
            "exchange": type(tr.engine.exchange).__name__}


def fsdp2(out: str) -> dict:
    return trainer(out, fsdp=True)


def plain(out: str) -> dict:
    return trainer(out, fsdp=False)


def main(out: str, jobs: str) -> None:
    results = {name: globals()[name](os.path.join(out, name)) for name in jobs.split(",")}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
