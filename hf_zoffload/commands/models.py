"""The model a config describes, built on the meta device (no memory): its parameter count,
its tensor-parallel split and its FSDP2 groups, for `hf-zoffload estimate` and the wizard.
Nothing here downloads: a config is a local file or folder, a hub name already cached, or a
model type's default config."""

from __future__ import annotations

import json
import os
import re

from ..units import parse_quantity

_COUNT = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """'7B' -> 7_000_000_000; '124M', '350k', '1.5e9' and '1_000' too."""
    return parse_quantity(text, _COUNT, "parameter count", "7B, 124M, 1.5e9")


ESTIMATE_ADVICE = ("(estimate never downloads); pass --model_type with --config_overrides, or "
                   "--params")


def model_config(model: str | None, *, flag: str = "--model", model_type: str | None = None,
                 overrides: str | None = None, advice: str = ESTIMATE_ADVICE):
    """The transformers config of ``model`` (a config.json, a model folder, or a cached hub
    name; quoted in errors as ``flag``, with ``advice`` when it is none of these), or of
    ``model_type``'s defaults; ``overrides``: comma-separated ``key=value`` changes."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_type:
        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"unknown --model_type {model_type!r}")
        cfg = CONFIG_MAPPING[model_type]()
    elif os.path.isfile(model):  # a config.json
        try:
            with open(model) as fh:
                data = json.load(fh)
            found = data.get("model_type") if isinstance(data, dict) else None
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{flag} {model}: not a model config (a config.json, or a model "
                             f"folder holding one): its text is not JSON ({err})") from None
        if found not in CONFIG_MAPPING:
            raise ValueError(f"{model}: no known 'model_type' ({found!r})")
        cfg = CONFIG_MAPPING[found].from_json_file(model)
    else:
        try:  # a folder, or a hub name that is already cached: never the network
            cfg = AutoConfig.from_pretrained(model, local_files_only=True)
        except OSError as err:
            raise ValueError(
                f"{flag} {model!r} is neither a local config nor in the local cache "
                f"{advice}") from err
    if overrides:
        cfg.update_from_string(overrides)
    return cfg


def meta_model(cfg):
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(cfg)
        except ValueError:  # not a causal LM (bert, t5, ...): count the base model
            return AutoModel.from_config(cfg)


def count_params(cfg) -> int:
    """Trainable parameters of the model a config describes, built on the meta device (no
    memory, about 1 s for a 7B llama); tied weights count once."""
    return sum(p.numel() for p in meta_model(cfg).parameters() if p.requires_grad)


def split_params(cfg) -> tuple[int, int]:
    """(sharded, replicated) trainable parameters under the model's own tensor-parallel plan
    (``model.tp_plan``, what ``from_pretrained(tp_plan="auto")`` applies: module name
    patterns -> styles): a colwise module's weight and bias and a rowwise one's weight
    (embeddings included) are sharded; everything else (norms, rowwise biases, modules the
    plan does not name) is replicated on every rank."""
    model = meta_model(cfg)
    plan = getattr(model, "tp_plan", None) or {}
    if not plan:
        raise ValueError(f"--tp_size: the {cfg.model_type!r} model has no tensor-parallel "
                         "plan (tp_plan), so nothing would be sharded")
    rules = [(re.compile("^" + re.escape(pat).replace(r"\*", r"[^.]+") + "$"), style)
             for pat, style in plan.items()]
    sharded = replicated = 0
    for name, p in model.named_parameters():  # tied weights once, as parameters()
        if not p.requires_grad:
            continue
        module, _, kind = name.rpartition(".")
        style = next((st for rx, st in rules if rx.match(module)), "")
        if "colwise" in style or ("rowwise" in style and kind == "weight"):
            sharded += p.numel()
        else:
            replicated += p.numel()
    return sharded, replicated


def fsdp2_groups(cfg, world: int = 1) -> dict:
    """The ``fully_shard`` groups that accelerate's FSDP2 plugin and the Trainer's ``--fsdp``
    make of the model a config describes (auto wrap TRANSFORMER_BASED_WRAP, the default: one
    group per module whose class is in the model's ``_no_split_modules``, the rest in the
    root's group): ``root`` and ``largest`` (trainable params of the root's group and of the
    largest other one), ``groups`` (how many others), ``layers`` (their class names) and
    ``local`` (this rank's elements of FSDP2's padded shards over ``world`` ranks:
    ``ceil(dim0 / world) * row`` per param, rank 0 holding the longer ones; ``shards``: each
    param's)."""
    model = meta_model(cfg)
    names = set(getattr(model, "_no_split_modules", None) or ())
    owners = {}  # module name -> trainable params of its group (root: "")
    wrapped = [n for n, m in model.named_modules() if type(m).__name__ in names and n]
    shards = []
    for name, p in model.named_parameters():  # tied weights once, as parameters()
        if not p.requires_grad:
            continue
        # the innermost wrapped module holding it, else the root (FSDP2 groups nest)
        owner = max((w for w in wrapped if name.startswith(w + ".")), key=len, default="")
        owners[owner] = owners.get(owner, 0) + p.numel()
        rows = p.shape[0] if p.ndim else 1
        shards.append(-(-rows // world) * (p.numel() // max(1, rows)))
    others = [v for k, v in owners.items() if k]
    return {"root": owners.get("", 0), "largest": max(others, default=0),
            "groups": len(others), "layers": sorted(names & {type(m).__name__
                                                          for m in model.modules()}),
            "local": sum(shards), "shards": shards}
