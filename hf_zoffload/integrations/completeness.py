"""Whether a Trainer checkpoint folder is whole: the marker `ZeroOffloadTrainer` writes last
(`write_marker`), and the check it runs before a resume loads anything (`why_incomplete`).

Why a check: ``get_last_checkpoint`` (``resume_from_checkpoint=True``) takes the highest
``checkpoint-N`` whole or not, and the stock load skips a missing ``optimizer.pt`` or
``rng_state.pth`` without a word: a save cut short would resume as a different run.

The marker, ``zero_offload_complete.json``, is written after the Trainer's last file,
atomically, with every file's size and whether the save was model-only (``save_only_model``).
Sizes, not checksums: a killed process loses no data it wrote (the page cache outlives it); a
machine crash can, and leaves files short or empty.

The check verifies what a resume reads (transformers 5.x: ``Trainer._load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_rng_state``, ``TrainerState.load_from_json``):

- the weights: ``model.safetensors`` (or ``pytorch_model.bin``, or a PEFT adapter's file),
  which the load takes first when present; else the index (``model.safetensors.index.json``,
  else ``pytorch_model.bin.index.json``) and every shard its ``weight_map`` names;
- ``optimizer.pt``, ``scheduler.pt`` and an ``rng_state*.pth``, unless the save was
  model-only; ``trainer_state.json``;
- with the marker: every file it lists, at the size it lists (shards included);
- without it (saved by the stock Trainer, or killed between ``trainer_state.json`` and the
  marker: every file whole then): the files above are there, and ``trainer_state.json``, the
  file such a kill could have cut short, reads as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

__all__ = ["COMPLETE_NAME", "remove_marker", "write_marker", "why_incomplete"]

COMPLETE_NAME = "zero_offload_complete.json"
# Read whole when present, before any index (in this order of preference).
_SINGLE_FILES = (SAFE_WEIGHTS_NAME, WEIGHTS_NAME, ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
_INDEXES = (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME)
# save_pretrained's shard names: model-00001-of-00004.safetensors, pytorch_model-00001-of-...
_SHARD = re.compile(r".+-\d{5}-of-\d{5}\.(safetensors|bin)")


def remove_marker(folder: str) -> None:
    """A re-save into ``folder`` starts unmarked: until its new marker is written, it is not
    whole."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, COMPLETE_NAME))


def write_marker(folder: str, *, model_only: bool) -> None:
    """Record every file under ``folder`` with its size, atomically (the last write of a
    save)."""
    marker = os.path.join(folder, COMPLETE_NAME)
    sizes = {os.path.relpath(os.path.join(d, n), folder): os.path.getsize(os.path.join(d, n))
             for d, _, names in os.walk(folder) for n in names
             if not n.startswith(COMPLETE_NAME)}
    with open(marker + ".tmp", "w") as f:
        json.dump({"files": sizes, "model_only": bool(model_only)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker + ".tmp", marker)


def why_incomplete(folder: str) -> str | None:
    """Why ``folder`` is not a checkpoint a resume can read whole, or None."""
    try:
        with open(os.path.join(folder, COMPLETE_NAME)) as f:
            record = json.load(f)
        sizes = record["files"]
        if not isinstance(sizes, dict) or not all(
                isinstance(k, str) and isinstance(v, int) for k, v in sizes.items()):
            raise ValueError("'files' is not a mapping of names to sizes")
        # A marker written before "model_only" was recorded: it lists what the save wrote.
        model_only = record.get("model_only", OPTIMIZER_NAME not in sizes)
        if not isinstance(model_only, bool):
            raise ValueError("'model_only' is not true or false")
    except FileNotFoundError:
        sizes, model_only = None, False
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{COMPLETE_NAME} is unreadable ({e})"

    if sizes is not None:
        for name, size in sizes.items():
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                return f"{name} is missing"
            if os.path.getsize(path) != size:
                return f"{name} has {os.path.getsize(path)} bytes, {size} were saved"
    try:
        missing = _missing_reads(folder, model_only=model_only)
    except _Unreadable as e:
        return str(e)
    if sizes is not None:
        return f"{missing[0][0]} is missing{missing[0][1]}" if missing else None
    if missing:
        return f"no {COMPLETE_NAME} and no {', '.join(name + why for name, why in missing)}"
    try:  # the Trainer's last file: a kill before the marker may have cut it short
        with open(os.path.join(folder, TRAINER_STATE_NAME)) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"no {COMPLETE_NAME} and {TRAINER_STATE_NAME} is unreadable ({e})"
    return None


class _Unreadable(ValueError):
    pass


def _missing_reads(folder: str, *, model_only: bool) -> list[tuple[str, str]]:
    """The files a resume reads that are not in ``folder``: (name, what a message adds)."""
    names = set(os.listdir(folder))
    missing = _missing_weights(folder, names)
    if not model_only:
        missing += [(n, "") for n in (OPTIMIZER_NAME, SCHEDULER_NAME) if n not in names]
        # rng_state.pth with one process, rng_state_<rank>.pth with several; a resume with
        # another process count reads what there is (the stock load skips the others).
        if not any(n.startswith("rng_state") and n.endswith(".pth") for n in names):
            missing.append(("rng_state.pth", ""))
    if TRAINER_STATE_NAME not in names:
        missing.append((TRAINER_STATE_NAME, ""))
    return missing


def _missing_weights(folder: str, names: set[str]) -> list[tuple[str, str]]:
    if any(n in names for n in _SINGLE_FILES) or _adapter_subfolders(folder, names):
        return []
    for index in _INDEXES:
        if index in names:
            try:
                with open(os.path.join(folder, index)) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise _Unreadable(f"{index} is unreadable ({e})") from None
            return [(s, f" (named by {index})") for s in shards if s not in names]
    shards = sorted(n for n in names if _SHARD.fullmatch(n))
    if shards:  # save_pretrained writes the index after the last shard
        index = SAFE_WEIGHTS_INDEX_NAME if shards[0].endswith(".safetensors") \
            else WEIGHTS_INDEX_NAME
        return [(index, f" ({len(shards)} shards, such as {shards[0]}, are there)")]
    return [(SAFE_WEIGHTS_NAME, f" (or {SAFE_WEIGHTS_INDEX_NAME} and its shards)")]


def _adapter_subfolders(folder: str, names: set[str]) -> bool:
    """PEFT models with several adapters save each in a subfolder of its name."""
    return any(os.path.isfile(os.path.join(folder, n, a)) for n in names
               if os.path.isdir(os.path.join(folder, n))
               for a in (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME))
