"""Training runs for tests/integrations/test_tensor_parallel.py: the ZeroOffloadTrainer with
``parallelism_config`` and a plain accelerate loop through `prepare_zero_offload` with an
accelerate ``ParallelismConfig``. Run as a script by torchrun (every rank runs every job,
rank 0 writes the results), or called in one process for the reference.

    python -m torch.distributed.run --nproc_per_node N tests/integrations/_tp_worker.py OUT JOBS TP

JOBS: comma-separated names of the functions below, each run with ``tp=TP`` tensor-parallel
ranks and N / TP data-parallel ones, splitting the batch of one process between them.
"""

from __future__ import annotations

import os
import sys

import accelerate
import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from transformers import (
    AutoModelForCausalLM,
    DistributedConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    get_scheduler,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_zoffload import (  # noqa: E402
    ZeroOffloadOptimizer,
    ZeroOffloadPlugin,
    prepare_zero_offload,
)
from hf_zoffload.integrations import compat, parallel  # noqa: E402
from hf_zoffload.integrations.parallel import ParallelismConfig  # noqa: E402
from hf_zoffload.integrations.trainer import (  # noqa: E402
    ZeroOffloadTrainer,
    ZeroOffloadTrainingArguments,
)
from tests._tiny import TokenBlocks  # noqa: E402

VOCAB, SEQ, STEPS, LR, MAX_NORM = 64, 16, 4, 1e-2, 0.5


def llama(seed: int = 0, **config):
    """2 heads and 2 key-value heads (one of each per rank at tp=2), an untied head."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": SEQ, "tie_word_embeddings": False, **config}))


def whole(model) -> dict[str, torch.Tensor]:
    """Every param whole (a collective per DTensor: every rank calls it)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def sharded(model) -> list[str]:
    """The names of the params held as a shard on this rank."""
    return [n for n, p in model.named_parameters()
            if isinstance(p, DTensor) and p.to_local().shape != p.shape]


def _pc(cls, tp: int, dp: int):
    return cls(tp_size=tp, dp_shard_size=dp) if tp > 1 else None


def _args(out: str, tp: int, dp: int, **kw):
    # accelerate's own ParallelismConfig: ZeroOffloadTrainer makes it work with CPU processes
    return ZeroOffloadTrainingArguments(**{
        "output_dir": out, "zero_offload": True,
        "parallelism_config": _pc(accelerate.ParallelismConfig, tp, dp),
        "per_device_train_batch_size": 4 // dp, "gradient_accumulation_steps": 2,
        "max_steps": STEPS, "learning_rate": LR, "weight_decay": 0.1,
        "max_grad_norm": MAX_NORM, "warmup_steps": 1, "logging_steps": 1,
        "save_strategy": "steps", "save_steps": STEPS, "report_to": [], "use_cpu": True,
        "seed": 0, "disable_tqdm": True, "ddp_timeout": 120, **kw})


def _trainer(model, args):
    return ZeroOffloadTrainer(model=model, args=args,
                              train_dataset=TokenBlocks(64, vocab=VOCAB, seq=SEQ))


def trainer(out: str, *, tp: int, dp: int = 1, model=None, resume_from: str | None = None,
            **kw) -> dict:
    """4 steps of 2 micro-batches of 4 blocks, clipping that bites, a checkpoint at the end
    (optimizer.pt and the weights) and the model saved to ``out``."""
    tr = _trainer(model or llama(), _args(out, tp, dp, **kw))
    tr.train(resume_from_checkpoint=resume_from)
    tr.save_model()
    logs = [e for e in tr.state.log_history if "loss" in e]
    return {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
            "params": whole(tr.model), "sharded": sharded(tr.model),
            "host": tr.engine.memory_report()["host_total"]}


def pretrained(out: str, *, tp: int, dp: int = 1) -> dict:
    """`trainer` on the same weights loaded by ``from_pretrained``: sharded at load time
    (transformers' DistributedConfig, which sets the Trainer's parallelism_config itself)."""
    init = os.path.join(os.path.dirname(out), "init")
    if not dist.is_initialized() or dist.get_rank() == 0:
        llama().save_pretrained(init)
    if dist.is_initialized():
        dist.barrier()
    kw = {"distributed_config": DistributedConfig(tp_size=tp)} if tp > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32, **kw)
    # saving the device copy: gathered whole, without transformers' own gather
    return trainer(out, tp=1, dp=dp, model=model, zero_offload_save_dtype="compute")


def loop(out: str, *, tp: int, dp: int = 1) -> dict:
    """The same model and schedule in a plain accelerate loop (prepare_zero_offload)."""
    AcceleratorState._reset_state()  # a Trainer may have made one already
    GradientState._reset_state()
    # split_batches: a prepared scheduler steps once per optimizer step, not once per process
    # (accelerate counts the tensor-parallel ranks as processes whose batches add up)
    # hf_zoffload's ParallelismConfig: accelerate's own refuses CPU processes
    acc = Accelerator(cpu=True, parallelism_config=_pc(ParallelismConfig, tp, dp),
                      gradient_accumulation_steps=2,
                      dataloader_config=DataLoaderConfiguration(split_batches=True))
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=STEPS)
    loader = torch.utils.data.DataLoader(TokenBlocks(64, vocab=VOCAB, seq=SEQ), batch_size=4)
    model, opt, loader, sched = prepare_zero_offload(acc, model, opt, loader, sched,
                                                     compute_dtype="fp32")
    losses, norms, it = [], [], iter(loader)
    for _ in range(STEPS * 2):
        batch = next(it)
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
    saved = acc.get_state_dict(model)  # every rank: the masters gathered whole
    return {"loss": losses, "grad_norm": norms, "params": whole(model), "saved": saved,
            "sharded": sharded(model)}


def resumed(out: str, *, tp: int, dp: int = 1) -> dict:
    """`trainer` checkpointing every 2 steps, then resumed from checkpoint-2 by a new
    Trainer (the model loads the whole weights, each rank keeping its part)."""
    _trainer(llama(), _args(out, tp, dp, save_steps=2)).train()
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return trainer(out, tp=tp, dp=dp, resume_from=os.path.join(out, "checkpoint-2"))


def _refused(make) -> str:
    """The message of the ValueError ``make()`` raises ('' if none)."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    try:
        make()
    except ValueError as e:
        return str(e)
    return ""


def refusals(out: str, *, tp: int, dp: int = 1) -> dict:
    """What cannot work raises before the model changes: {case: (message, still whole)}."""
    assert tp > 1
    cases = {
        "heads": lambda: llama(num_key_value_heads=1),
        "tied": lambda: llama(tie_word_embeddings=True),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ,
                                                   n_embd=32, n_layer=1, n_head=2)),
        "seeds": lambda: llama(seed=dist.get_rank()),
    }
    out_ = {}
    for name, make in cases.items():
        model = make()
        msg = _refused(lambda m=model: _trainer(m, _args(out, tp, dp)))
        out_[name] = (msg, not sharded(model))
    model = llama()
    out_["save_on_each_node"] = (_refused(lambda: _trainer(model, _args(
        out, tp, dp, save_on_each_node=True))), not sharded(model))
    out_["cp"] = (_refused(lambda: _trainer(llama(), _args(
        out, 1, 1, parallelism_config=accelerate.ParallelismConfig(cp_size=tp * dp)))), True)

    def engine_on_whole_model():
        acc = Accelerator(cpu=True, parallelism_config=_pc(ParallelismConfig, tp, dp))
        opt = ZeroOffloadOptimizer(model.parameters(), plugin=ZeroOffloadPlugin(
            compute_dtype="fp32"))
        prepare_zero_offload(acc, model, opt)

    model = llama()
    out_["engine_first"] = (_refused(engine_on_whole_model), not sharded(model))

    def no_parallelism_config():
        acc = Accelerator(cpu=True)
        opt = torch.optim.AdamW(model.parameters())
        prepare_zero_offload(acc, model, opt, compute_dtype="fp32")

    model = llama()
    parallelize_module(model, init_device_mesh("cpu", (tp,)), {"model.layers.0.mlp.up_proj":
                                                              ColwiseParallel()})
    out_["no_config"] = (_refused(no_parallelism_config), True)
    return out_


def as_before_5_23(mp: pytest.MonkeyPatch) -> None:
    """Make the installed transformers look like 5.16 to 5.18 to compat.py: no
    ``_resolve_parallel_plans``, and an ``apply_tensor_parallelism(model, tp_mesh)`` that
    shards by the model's own plan. Nothing to change where it is such a version."""
    owner = next((c for c in PreTrainedModel.__mro__ if "_resolve_parallel_plans" in vars(c)),
                 None)
    if owner is None:
        return
    resolve, apply = owner._resolve_parallel_plans, compat.apply_tensor_parallelism

    def apply_by_the_models_plan(model, tp_mesh):
        plan, _, _ = resolve(model, DistributedConfig(tp_size=tp_mesh.size()))
        return apply(model, tp_mesh, plan)

    mp.delattr(owner, "_resolve_parallel_plans")
    mp.setattr(compat, "apply_tensor_parallelism", apply_by_the_models_plan)


def forms(out: str, *, tp: int, dp: int = 1) -> dict:
    """`parallel.shard_model` through the installed transformers' tensor-parallel API and
    through it made to look like 5.16 to 5.18 (`as_before_5_23`): for each, every param's
    kind, placements and local part, the logits of one batch, and the params whose old
    object the returned map takes to the new one; and the message when the API shards
    nothing of the plan."""
    assert dp == 1
    mesh = init_device_mesh("cpu", (tp,))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    got = {}
    for form in ("installed", "before_5_23"):
        with pytest.MonkeyPatch.context() as mp:
            if form == "before_5_23":
                as_before_5_23(mp)
            model = llama()
            old = dict(model.named_parameters())
            replaced = parallel.shard_model(model, mesh)
        now = dict(model.named_parameters())
        got[form] = {
            "params": {n: (type(p).__name__, str(getattr(p, "placements", "")),
                           (p.to_local() if isinstance(p, DTensor) else p).detach().clone())
                       for n, p in now.items()},
            "logits": model(input_ids=ids).logits.detach(),
            "map": sorted(n for n, p in old.items() if replaced.get(id(p)) is now[n]),
            "map_size": len(replaced)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compat, "apply_tensor_parallelism", lambda model, tp_mesh: model)
        try:
            parallel.shard_model(llama(), mesh)
            got["unknown_api"] = ""
        except RuntimeError as e:
            got["unknown_api"] = str(e)
    return got


def main(out: str, jobs: str, tp: str) -> None:
    tp, world = int(tp), int(os.environ["WORLD_SIZE"])
    results = {name: globals()[name](os.path.join(out, name), tp=tp, dp=world // tp)
               for name in jobs.split(",")}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    dist.barrier()


def cli(argv: list[str]) -> int:
    """What a rank runs (under torchrun, or forked by tests/_preloaded.py's server)."""
    main(*argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
