#!/usr/bin/env python
"""A plain Accelerate training loop on a tiny causal LM, with and without ZeRO-Offload.

With ``--zero_offload`` the loop is the same; only the two lines marked ``# ZeRO-Offload``
differ from the plain loop (an import, and ``prepare_zero_offload`` in place of
``accelerator.prepare``). The compute dtype follows accelerate's mixed_precision (fp32 for
"no"); the other settings come from HF_ZOFFLOAD_* / the sidecar yaml, e.g. through
``hf-zoffload launch``:

    python scripts/train_accelerate.py --zero_offload
    HF_ZOFFLOAD_BUCKET_SIZE_MB=1 python scripts/train_accelerate.py --zero_offload
    hf-zoffload launch --config_file cfg.yaml scripts/train_accelerate.py --zero_offload

Prints one json line: the loss of every micro-batch and the gradient norm of every step. A bad
setting or model type is one line and exit status 2; HF_ZOFFLOAD_TRACEBACK=1 shows its
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, get_scheduler

# Runnable from a checkout without installing: scripts/.. is the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_zoffload.commands.errors import run_command  # noqa: E402

# Two layers, 64 wide, vocab 128: ~0.1M params, a step takes milliseconds on one core.
# Dropout off, so the run is a deterministic function of the seed.
TINY = ("n_layer=2,n_embd=64,n_head=2,vocab_size=128,n_positions=64,"
        "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="A bad setting or model type is one line and exit "
                                       "status 2; HF_ZOFFLOAD_TRACEBACK=1 shows its traceback.")
    p.add_argument("--model_type", default="gpt2")
    p.add_argument("--config_overrides", default=TINY)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps")
    p.add_argument("--grad_accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=0.5, help="0 disables clipping")
    p.add_argument("--warmup_steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zero_offload", action="store_true", help="use prepare_zero_offload")
    p.add_argument("--output_json", default=None, help="also write the json line here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.model_type not in CONFIG_MAPPING:  # before the accelerator starts anything
        raise ValueError(f"unknown --model_type {args.model_type!r}; allowed: the transformers "
                         "model types, e.g. gpt2, llama")
    config = CONFIG_MAPPING[args.model_type]()
    config.update_from_string(args.config_overrides)  # an unknown key: ValueError
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    n = args.steps * args.grad_accum * args.batch_size
    gen = torch.Generator().manual_seed(args.seed)
    # Arithmetic sequences (random start and stride): learnable, so the loss visibly falls.
    start = torch.randint(config.vocab_size, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    ids = (start + stride * torch.arange(args.seq_len)) % config.vocab_size
    loader = DataLoader(TensorDataset(ids), batch_size=args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.steps)

    if args.zero_offload:
        from hf_zoffload import prepare_zero_offload  # ZeRO-Offload

        model, optimizer, loader, scheduler = prepare_zero_offload(  # ZeRO-Offload
            accelerator, model, optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler)

    losses, norms = [], []
    model.train()
    for (batch,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                norms.append(float(norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    plugin = getattr(optimizer.optimizer, "plugin", None)  # reporting only: what was used
    result = {"zero_offload": args.zero_offload, "losses": losses, "grad_norms": norms,
              "lr": scheduler.get_last_lr()[0], "num_processes": accelerator.num_processes,
              "model_class": type(model).__name__,
              "world_size": torch.distributed.get_world_size()
              if torch.distributed.is_initialized() else 1,
              "zoffload": plugin.to_dict() if plugin is not None else None}
    if accelerator.is_main_process:
        line = json.dumps(result)
        print(line)
        if args.output_json:
            with open(args.output_json, "w") as fh:
                fh.write(line + "\n")
    # Destroys the process group: a gloo group left to the interpreter's exit once aborted a
    # rank ("terminate called without an active exception") while the other was closing.
    accelerator.end_training()
    return result


if __name__ == "__main__":
    sys.exit(run_command("train_accelerate.py", main))
