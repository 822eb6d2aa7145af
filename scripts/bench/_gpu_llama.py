"""What the measured GPU stages (gpu_size.py, gpu_practicality.py, gpu_peers.py) share:
Llama configs given as dicts, their parameter counts without building a model, the model
built directly on its device in its dtype, and one training step per way of training it.

The ways, by the bytes of model states each keeps on the device:
- ``amp``: torch's plain mixed precision, fp32 params, ``torch.optim.AdamW(fused=True)``
  and bf16 autocast: 16 B/param (4 params, 4 grads, 8 moments), plus autocast's bf16 copies of
  the weights (2 B/param) through each forward.
- ``zoffload``: `ZeroOffloadOptimizer` with bf16 compute: the bf16 params (2 B/param) and two
  gradient buckets; fp32 master weights and the moments on the host.
- ``fsdp2``: FSDP2 parameter offload (``fully_shard`` per decoder layer and the root, with
  ``CPUOffloadPolicy``, one rank) with `ZeroOffloadOptimizer` as its optimizer: the bf16
  params live on the host too and FSDP2 brings them up a layer group at a time, so the
  device holds the root's params and two layers' with their grads
  (`memory.device_bytes_fsdp2`), whatever the layer count.
- ``fsdp2_torch``: the same FSDP2 with torch's own way, an fp32 model with
  ``MixedPrecisionPolicy(param_dtype=bf16)`` stepped by ``torch.optim.AdamW(fused=True)`` on
  the host's fp32 shards and grads (its fused CPU kernel: the fastest torch AdamW there).

Import-safe: transformers is imported on use (a script run without CUDA exits before).
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

# Llama-2-7B's layer and vocabulary, head untied: 202.4M params a layer, 262.1M in the
# embeddings and the head.
LLAMA_4096 = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=2048, tie_word_embeddings=False)
# TinyLlama-1.1B's shape (grouped-query attention, 4 KV heads): 1,100,048,384 params.
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)
AMP = "torch AdamW (fused), fp32 params, bf16 autocast, all on the device"
ZOFFLOAD = "ZeroOffloadOptimizer, bf16 params, fp32 master weights and moments on the host"
FSDP2 = ("ZeroOffloadOptimizer over FSDP2 parameter offload (CPUOffloadPolicy), bf16 params on "
         "the host")
FSDP2_TORCH = ("torch AdamW (fused) over FSDP2 parameter offload (CPUOffloadPolicy), fp32 "
               "params on the host, bf16 compute")


def with_overrides(base: dict, text: str, *, what: str = "--overrides") -> dict:
    """``base`` with ``k=v,...`` changes (integers), each key one of base's; one clear error
    (SystemExit) otherwise."""
    out = dict(base)
    allowed = [k for k in base if k != "tie_word_embeddings"]
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if key not in allowed or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"{what} {item!r}: expected key=positive integer with the key one "
                             f"of {', '.join(allowed)}")
        out[key] = int(value)
    return out


def n_params(base: dict, layers: int | None = None) -> int:
    """Params of the Llama of ``base`` (``layers`` layers if given), counted from its shape:
    embeddings, head (unless tied), final norm, and per layer attention, MLP and two norms."""
    h, v, i = base["hidden_size"], base["vocab_size"], base["intermediate_size"]
    q = base["num_attention_heads"] * base["head_dim"]
    kv = base["num_key_value_heads"] * base["head_dim"]
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    n = base["num_hidden_layers"] if layers is None else layers
    return (1 if base.get("tie_word_embeddings") else 2) * v * h + h + n * layer


def count(n) -> str:
    return "n/a" if n is None else f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def build_model(base: dict, dtype: torch.dtype, device, *, layers: int | None = None,
                checkpointing: bool = False):
    """The Llama built on ``device`` in ``dtype`` directly (params are created there, never as
    an fp32 copy on the host), in training mode, without the KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(base) if layers is None else {**base, "num_hidden_layers": layers}
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**cfg))
    finally:
        torch.set_default_dtype(old)
    if checkpointing:  # non-reentrant: torch's recommended form; the engine runs both
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def amp_step(model):
    """(step, finish) for fp32 params under bf16 autocast with fused AdamW; ``step(ids)``
    runs one optimizer step and returns the loss (detached)."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(ids):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, lambda: None


def zoffload_step(model, **plugin):
    """(step, finish, engine) for `ZeroOffloadOptimizer` with bf16 compute and ``plugin``'s
    other settings; ``finish()`` lands a delayed update."""
    from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin

    # model=: each module's forward waits for its own params' uploads, as the integrations do
    engine = ZeroOffloadOptimizer(model.parameters(), lr=1e-5, model=model,
                                  plugin=ZeroOffloadPlugin(compute_dtype="bf16", **plugin))

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return loss.detach()
    return step, engine.flush, engine


def token_ids(base: dict, batch: int, seq: int, device, *, seed: int = 1) -> torch.Tensor:
    """A fixed random batch, made on the CPU (the same values on any device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, base["vocab_size"], (batch, seq), generator=g).to(device)


@contextlib.contextmanager
def one_rank_group(device):
    """A one-rank process group for FSDP2 (NCCL on CUDA, gloo on the CPU) over an in-process
    store, for as long as the block runs; one that is already there is used as it is."""
    if dist.is_initialized():
        yield
        return
    device = torch.device(device)
    cuda = device.type == "cuda"
    # NCCL binds the group to one device, which needs its index ("cuda" alone is refused)
    bound = torch.device("cuda", torch.cuda.current_device() if device.index is None
                         else device.index) if cuda else None
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=120),
                            device_id=bound)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2_shard(model, device, *, mp=None):
    """``fully_shard`` each decoder layer, then the root (the embeddings, the final norm and
    the head: its own group), over a one-rank mesh on ``device`` with ``CPUOffloadPolicy``:
    the sharded params move to the host (pinned on CUDA, the policy's default), whatever
    device the model was built on. Needs `one_rank_group`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    cuda = torch.device(device).type == "cuda"
    kw = {"mesh": init_device_mesh(torch.device(device).type, (1,)),
          "offload_policy": CPUOffloadPolicy(pin_memory=cuda)}
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def fsdp2_step(model, device, **plugin):
    """(step, finish, engine): FSDP2 parameter offload of ``model`` (bf16, built on any
    device) with `ZeroOffloadOptimizer` as its optimizer (bf16 compute and ``plugin``'s other
    settings); the engine writes the new bf16 values into FSDP2's sharded host params."""
    return zoffload_step(fsdp2_shard(model, device), **plugin)


def fsdp2_torch_step(model, device):
    """(step, finish): FSDP2 parameter offload of the fp32 ``model`` as FSDP2 users run it:
    bf16 compute (``MixedPrecisionPolicy``), ``torch.optim.AdamW(fused=True)`` over the fp32
    sharded host params and their fp32 grads."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fsdp2_shard(model, device, mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, lambda: None
