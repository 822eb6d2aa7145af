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
- the files above are there, and ``trainer_state.json`` (the file a kill between it and the
  marker could have cut short, in a checkpoint saved without one) reads as JSON;
- with the marker, every file it lists at the size it lists: a set that differs but is whole
  by every check here (its weights converted to an index and shards, a file re-saved) is
  accepted, and `changed_since_saved` says how it changed (the resume's one info line); a
  set that is broken is named by its difference from the marker where one concerns the
  broken file (``optimizer.pt has 10 bytes, 1600 were saved``);
- either way, the structure of every file above, without reading its data (`file_problem`):
  a ``.safetensors`` file's header (its 8-byte length and JSON) places every tensor inside
  the file, end to end, and the file ends where the last one does, as the safetensors loader
  requires; a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``) is a zip archive whose central
  directory opens, whose pickle (CRC-checked, read without importing or running anything)
  names storage records that are all there at their sizes, and whose every record's bytes
  match the CRC-32 the zip archive holds for it. A header or directory written half, bytes
  zeroed or garbled by a crash, a file cut short: all caught; bytes garbled inside a
  ``.safetensors`` file's tensor data are not (the format has no checksum over its data).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import mmap
import os
import pickle
import re
import zipfile
import zlib

import torch
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

__all__ = ["COMPLETE_NAME", "remove_marker", "write_marker", "why_incomplete", "file_problem",
           "weight_files", "nonfinite_problem", "changed_since_saved"]

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
    sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in _all_files(folder)}
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

    changed = _changes(folder, sizes) if sizes is not None else []
    problem = _set_problem(folder, model_only=model_only, marked=sizes is not None)
    # A set changed since its save (weights converted to shards, a file re-saved) that is
    # still whole is accepted (`changed_since_saved` says so); where a file of a broken one
    # differs from the marker's record, the difference names the cause.
    if problem is None:
        return None
    first = problem.split(" ", 1)[0]
    return next((c for c in changed if c.split(" ", 1)[0] == first), problem)


def changed_since_saved(folder: str) -> list[str]:
    """How ``folder``'s files differ from what its marker recorded (none without a marker):
    the one info line a resume of a changed but whole checkpoint logs."""
    try:
        with open(os.path.join(folder, COMPLETE_NAME)) as f:
            sizes = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    new = sorted(n for n in _all_files(folder) if n not in sizes)
    if len(new) > 2:  # a conversion to shards writes one file per shard: a count, not a list
        return _changes(folder, sizes) + [f"{len(new)} new files ({new[0]} to {new[-1]})"]
    return _changes(folder, sizes) + [f"{n} is new" for n in new]


def _all_files(folder: str) -> list[str]:
    return [os.path.relpath(os.path.join(d, n), folder) for d, _, names in os.walk(folder)
            for n in names if not n.startswith(COMPLETE_NAME)]


def _changes(folder: str, sizes: dict) -> list[str]:
    out = []
    for name, size in sizes.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            out.append(f"{name} is missing")
        elif os.path.getsize(path) != size:
            out.append(f"{name} has {os.path.getsize(path)} bytes, {size} were saved")
    return out


def _set_problem(folder: str, *, model_only: bool, marked: bool) -> str | None:
    """What makes the files of ``folder`` that a resume reads not a whole set, or None."""
    try:
        missing = _missing_reads(folder, model_only=model_only)
    except _Unreadable as e:
        return str(e)
    if missing:
        return (f"{missing[0][0]} is missing{missing[0][1]}" if marked else
                f"no {COMPLETE_NAME} and no {', '.join(name + why for name, why in missing)}")
    try:  # the Trainer's last file: a kill before the marker may have cut it short
        with open(os.path.join(folder, TRAINER_STATE_NAME)) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return (f"{TRAINER_STATE_NAME} is unreadable ({e})" if marked else
                f"no {COMPLETE_NAME} and {TRAINER_STATE_NAME} is unreadable ({e})")
    for name in _read_files(folder, model_only=model_only):
        problem = file_problem(os.path.join(folder, name))
        if problem:
            return f"{name} is corrupt ({problem})"
    return None


def nonfinite_problem(folder: str) -> str | None:
    """Which optimizer state of ``folder`` holds a non-finite number (a master weight or a
    moment: a run that had diverged when it saved, or bytes changed since), or None. Read
    memory-mapped, one tensor at a time, after `why_incomplete` found the file whole; the
    model's weights are not checked (a model may keep -inf in a saved buffer, a mask)."""
    path = os.path.join(folder, OPTIMIZER_NAME)
    if not os.path.isfile(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    per_param = state.get("state") if isinstance(state, dict) else None
    for index, entry in (per_param or {}).items():
        for key, t in (entry.items() if isinstance(entry, dict) else ()):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                bad = t.numel() - int(torch.isfinite(t).sum())
                if bad:
                    return (f"{OPTIMIZER_NAME} holds non-finite values (param {index}'s "
                            f"{key}: {bad} of {t.numel()})")
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
        if not _rng_files(names):
            missing.append(("rng_state.pth", ""))
    if TRAINER_STATE_NAME not in names:
        missing.append((TRAINER_STATE_NAME, ""))
    return missing


def _rng_files(names) -> list[str]:
    return sorted(n for n in names if n.startswith("rng_state") and n.endswith(".pth"))


def _read_files(folder: str, *, model_only: bool) -> list[str]:
    """The files of a checkpoint with nothing missing that a resume reads, weights first."""
    names = set(os.listdir(folder))
    out = weight_files(folder)
    if not model_only:
        out += [OPTIMIZER_NAME, SCHEDULER_NAME, *_rng_files(names)]
    return out


def weight_files(folder: str) -> list[str]:
    """The weight files a resume of ``folder`` reads (as `_missing_weights` finds them):
    the first single file present, else the index's shards; adapters in subfolders are
    left to PEFT (empty list)."""
    names = set(os.listdir(folder))
    for n in _SINGLE_FILES:
        if n in names:
            return [n]
    for index in _INDEXES:
        if index in names:
            with open(os.path.join(folder, index)) as f:
                return sorted(set(json.load(f)["weight_map"].values()))
    return []


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


# --------------------------------------------------------------------------- file structure
# What it costs, measured on the 2-vCPU EPYC (Zen 3) for a 134M-param Llama (hidden 768, 12
# layers, untied vocab 32000): model.safetensors (537 MB, fp32) 0.3 ms from the page cache,
# 3 ms after evicting it (its header only); the engine's optimizer.pt (1.6 GB, 450 records, a
# 35 KB pickle) 18-33 ms cached for the directory and the pickle, plus its records' CRC-32:
# 0.4 s for 512 MB from the page cache on the same machine under load (1.4-2.0 GB/s through
# the map; 0.2-0.6 GB/s through readinto into a buffer), so about 1 s for the 1.6 GB; the
# resume then reads the same pages from the cache.
def file_problem(path: str) -> str | None:
    """What is wrong with the file at ``path`` (its format by its name), or None: a
    safetensors header, a torch.save archive's directory, pickle and records' CRC-32 (module
    docstring)."""
    if path.endswith(".safetensors"):
        return _safetensors_problem(path)
    if path.endswith((".pt", ".pth", ".bin")):
        return _torch_save_problem(path)
    return None


# Bytes per element of the safetensors dtypes; a dtype not listed (sub-byte floats, one added
# later) is only checked to lie within the file.
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
             "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
             "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_ST_MAX_HEADER = 100_000_000  # the safetensors loader refuses longer headers


def _safetensors_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes: no header length"
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _ST_MAX_HEADER):
            return f"a header of {n} bytes in a file of {size}"
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except ValueError as e:  # UnicodeDecodeError is one
            return f"the header is not JSON: {e}"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            return f"tensor {key!r} has no valid dtype, shape and data_offsets"
        itemsize = _ST_BYTES.get(dtype)
        if end < begin or (itemsize is not None and end - begin != math.prod(shape) * itemsize):
            return f"tensor {key!r}: data_offsets [{begin}, {end}] for {dtype} {shape}"
        spans.append((begin, end, key))
    at = 0
    for begin, end, key in sorted(spans):  # end to end from 0, as the loader requires
        if begin != at:
            return f"tensor {key!r} starts at byte {begin} of the data, not {at}"
        at = end
    if 8 + n + at != size:
        return f"{size} bytes, its header describes {8 + n + at}"
    return None


_ZIP_MAGIC, _PICKLE_PROTO = b"PK\x03\x04", b"\x80"


def _torch_save_problem(path: str) -> str | None:
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:1] == _PICKLE_PROTO:  # torch.save's legacy (pre-1.6) format: sizes checked only
        return None
    if head != _ZIP_MAGIC:
        return "not a torch.save zip archive"
    try:
        with zipfile.ZipFile(path) as zf:  # reads the central directory at the end
            infos = {i.filename: i for i in zf.infolist()}
            pkl = [n for n in infos if n.rsplit("/", 1)[-1] == "data.pkl"]
            if len(pkl) != 1:
                return "no data.pkl record"
            prefix = pkl[0][:-len("data.pkl")]
            past = [n for n, i in infos.items() if i.header_offset + i.compress_size
                    > zf.start_dir]
            if past:
                return f"record {past[0]} runs into the central directory"
            records = _StorageRecords(zf.read(pkl[0]))  # CRC-checked
            records.load()
    except (zipfile.BadZipFile, OSError, EOFError, pickle.UnpicklingError, ValueError,
            IndexError, TypeError, AttributeError, KeyError, OverflowError, RecursionError) as e:
        return f"{type(e).__name__}: {e}"
    for key, nbytes in records.storages:
        info = infos.get(f"{prefix}data/{key}")
        if info is None:
            return f"record data/{key} is missing"
        if nbytes is not None and info.file_size != nbytes:
            return f"record data/{key} has {info.file_size} bytes, its tensor {nbytes}"
    return _crc_problem(path, list(infos.values()))


_CRC_CHUNK = 64 * 2**20  # a memoryview slice of the map: no copy, any size is as fast


def _crc_problem(path: str, infos: list[zipfile.ZipInfo]) -> str | None:
    """Each record's CRC-32 against its bytes (torch.save writes every record stored, with
    its CRC-32): what catches bytes garbled inside a tensor's data. 3.0 GB/s on the 2-vCPU
    EPYC (zlib 1.2.13, from the page cache), against 1.0 GB/s through zipfile's reader, so
    the mapped bytes are checked in place."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            for info in infos:
                at = info.header_offset
                if view[at:at + 4] != _ZIP_MAGIC or info.compress_type != zipfile.ZIP_STORED:
                    return f"record {info.filename} has no stored local header"
                n, m = int.from_bytes(view[at + 26:at + 28], "little"), \
                    int.from_bytes(view[at + 28:at + 30], "little")
                start = at + 30 + n + m
                if start + info.compress_size > len(view):
                    return f"record {info.filename} runs past the end of the file"
                crc = 0
                for off in range(start, start + info.compress_size, _CRC_CHUNK):
                    crc = zlib.crc32(view[off:min(off + _CRC_CHUNK,
                                                  start + info.compress_size)], crc)
                if crc != info.CRC:
                    return (f"record {info.filename}: its bytes' CRC-32 is {crc:08x}, "
                            f"{info.CRC:08x} was written (bytes garbled inside the data)")
        finally:
            view.release()
    return None


class _Stub:
    """Whatever the pickle names: built and filled without importing or running anything."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


# torch's typed storage classes by name: bytes per element (UntypedStorage counts bytes).
_STORAGE_BYTES = {"DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2,
                  "BFloat16Storage": 2, "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2,
                  "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
                  "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16, "UntypedStorage": 1}


class _StorageRecords(pickle.Unpickler):
    """Reads a ``torch.save`` pickle for the storages it names: (record key, bytes or None).
    torch writes each storage as the persistent id ('storage', storage class, key, location,
    element count) and its bytes as the record ``data/<key>``."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.storages: list[tuple[str, int | None]] = []

    def find_class(self, module, name):
        return type(name, (_Stub,), {})  # a named stub: never an import

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            itemsize = _STORAGE_BYTES.get(getattr(pid[1], "__name__", None))
            numel = pid[4] if isinstance(pid[4], int) else None
            self.storages.append((str(pid[2]), None if itemsize is None or numel is None
                                  else itemsize * numel))
        return _Stub()
