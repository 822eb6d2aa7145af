"""The check of what a resume reads (integrations/completeness.py) on hand-built checkpoints:
a file's structure is read without its data, and agrees with the loaders it stands in for.
The resume paths through the Trainer are in tests/acceptance/test_kill_resume.py."""

import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from hf_zoffload.integrations.completeness import (
    COMPLETE_NAME,
    file_problem,
    weight_files,
    why_incomplete,
    write_marker,
)

INDEX = "model.safetensors.index.json"


def _weights(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # odd sizes and mixed dtypes: offsets that are no multiple of anything
    return {"a.weight": torch.randn(7, 5, generator=g),
            "b.bias": torch.randn(3, generator=g).to(torch.bfloat16),
            "c.steps": torch.arange(11, dtype=torch.int64)}


def _trainer_files(folder: Path) -> None:
    opt = {"state": {0: {"exp_avg": torch.randn(13), "exp_avg_sq": torch.rand(13),
                         "step": torch.tensor(3.0)}},
           "param_groups": [{"lr": 1e-3, "params": [0]}],
           "zero_offload": {"bucket_order": [0], "view": torch.arange(10)[2:5]}}
    torch.save(opt, folder / "optimizer.pt")
    torch.save({"last_epoch": 3, "_step_count": 4}, folder / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state(), "python": (3, (1, 2), None)},
               folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A whole checkpoint with one weights file, marked."""
    c = tmp_path / "checkpoint-3"
    c.mkdir()
    save_file(_weights(), c / "model.safetensors")
    _trainer_files(c)
    write_marker(str(c), model_only=False)
    assert why_incomplete(str(c)) is None
    return c


@pytest.fixture
def sharded(tmp_path) -> Path:
    """A whole checkpoint with an index and two shards, unmarked (as a stock save)."""
    c = tmp_path / "checkpoint-3"
    c.mkdir()
    w = _weights()
    parts = {"model-00001-of-00002.safetensors": ["a.weight"],
             "model-00002-of-00002.safetensors": ["b.bias", "c.steps"]}
    for name, keys in parts.items():
        save_file({k: w[k] for k in keys}, c / name)
    (c / INDEX).write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, ks in parts.items() for k in ks}}))
    _trainer_files(c)
    assert why_incomplete(str(c)) is None
    assert weight_files(str(c)) == sorted(parts)
    return c


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:  # same size: the marker's sizes still match
        f.seek(at)
        f.write(data)


def test_corrupt_safetensors_header_is_named(ckpt):
    _overwrite(ckpt / "model.safetensors", 8, b"\xff" * 16)
    assert why_incomplete(str(ckpt)) == (
        "model.safetensors is corrupt (the header is not JSON: 'utf-8' codec can't decode "
        "byte 0xff in position 0: invalid start byte)")


def test_corrupt_safetensors_header_length_is_named(ckpt):
    _overwrite(ckpt / "model.safetensors", 0, (2**40).to_bytes(8, "little"))
    why = why_incomplete(str(ckpt))
    assert why.startswith("model.safetensors is corrupt (a header of 1099511627776 bytes in a "
                          "file of "), why


def test_truncated_shard_without_marker(sharded):
    shard = sharded / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 5)
    why = why_incomplete(str(sharded))
    assert why.startswith("model-00002-of-00002.safetensors is corrupt ("), why
    assert why.endswith(f"{shard.stat().st_size} bytes, its header describes "
                        f"{shard.stat().st_size + 5})"), why


def test_missing_shard_of_an_index(sharded):
    (sharded / "model-00001-of-00002.safetensors").unlink()
    assert why_incomplete(str(sharded)) == (
        f"no {COMPLETE_NAME} and no model-00001-of-00002.safetensors (named by {INDEX})")


def test_truncated_optimizer_without_marker(ckpt):
    (ckpt / COMPLETE_NAME).unlink()  # killed before the marker: sizes unknown
    opt = ckpt / "optimizer.pt"
    os.truncate(opt, opt.stat().st_size // 2)
    assert why_incomplete(str(ckpt)) == \
        "optimizer.pt is corrupt (BadZipFile: File is not a zip file)"


def test_garbled_optimizer_directory_with_marker(ckpt):
    opt = ckpt / "optimizer.pt"
    _overwrite(opt, opt.stat().st_size - 22, b"\0" * 22)  # the end-of-directory record
    assert why_incomplete(str(ckpt)) == \
        "optimizer.pt is corrupt (BadZipFile: File is not a zip file)"


def _rezip(src: Path, dst: Path, edit) -> None:
    """Copy a torch.save archive record by record, ``edit(name, data)`` -> data or None."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info))
            if data is not None:
                zout.writestr(info.filename, data)


def test_missing_and_short_storage_records(tmp_path, ckpt):
    opt = ckpt / "optimizer.pt"
    missing, short = tmp_path / "missing.pt", tmp_path / "short.pt"
    _rezip(opt, missing, lambda n, d: None if n.endswith("/data/1") else d)
    _rezip(opt, short, lambda n, d: d[:-4] if n.endswith("/data/0") else d)
    assert file_problem(str(missing)) == "record data/1 is missing"
    assert file_problem(str(short)) == "record data/0 has 48 bytes, its tensor 52"
    for bad in (missing, short):  # what torch.load makes of them
        with pytest.raises(RuntimeError):
            torch.load(bad, weights_only=True)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch boom",))


def test_the_pickle_is_read_without_running_anything(tmp_path, ckpt, monkeypatch):
    # a pickle that would run a command when loaded stock; the check names no global it
    # builds, so nothing runs and the archive's records are what it checks
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "evil.pt"
    _rezip(ckpt / "optimizer.pt", evil,
           lambda n, d: pickle.dumps({"x": _Boom()}, protocol=2) if n.endswith("data.pkl") else d)
    assert file_problem(str(evil)) is None
    assert not (tmp_path / "boom").exists()


def test_legacy_torch_format_is_accepted(tmp_path):
    path = tmp_path / "legacy.bin"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    assert file_problem(str(path)) is None


def _safetensors_loads(data: bytes) -> bool:
    try:
        load(data)
    except SafetensorError:
        return False
    return True


def test_safetensors_check_agrees_with_the_loader(tmp_path):
    """The reference: safetensors' own loader. Every cut of the file fails both; every
    single-byte change of the header that the check refuses, the loader refuses too (no false
    alarm), and the whole file passes both."""
    path = tmp_path / "w.safetensors"
    save_file(_weights(), path)
    data = path.read_bytes()
    assert file_problem(str(path)) is None and _safetensors_loads(data)
    bad = tmp_path / "bad.safetensors"
    n = int.from_bytes(data[:8], "little")
    # (sampled: each write of a file costs ~8 ms on a busy disk)
    for cut in [*range(0, 8 + n + 3, 3), *range(8 + n + 3, len(data), 17), len(data) - 1]:
        bad.write_bytes(data[:cut])
        assert file_problem(str(bad)) is not None and not _safetensors_loads(data[:cut]), cut
    flagged = 0
    for at in range(0, 8 + n, 3):
        byte = b"9}"[at % 2:at % 2 + 1]  # a digit, or a brace: numbers and nesting both move
        changed = data[:at] + byte + data[at + 1:]
        bad.write_bytes(changed)
        if file_problem(str(bad)) is not None:
            flagged += 1
            assert not _safetensors_loads(changed), (at, byte)
    assert flagged > n // 6  # most changes of a compact header break it


def test_torch_check_agrees_with_torch_load(tmp_path, ckpt):
    """The reference: torch.load. Every cut of a torch.save archive fails both; the whole
    archive passes both."""
    data = (ckpt / "optimizer.pt").read_bytes()
    bad = tmp_path / "bad.pt"
    for cut in range(0, len(data), 97):
        bad.write_bytes(data[:cut])
        assert file_problem(str(bad)) is not None, cut
        with pytest.raises(Exception):  # noqa: B017 (RuntimeError, EOFError, ...: any refusal)
            torch.load(io.BytesIO(data[:cut]), weights_only=True)
    assert file_problem(str(ckpt / "optimizer.pt")) is None
    torch.load(ckpt / "optimizer.pt", weights_only=True)


def test_bytes_garbled_inside_a_record_fail_its_crc(tmp_path, ckpt):
    opt = ckpt / "optimizer.pt"
    data = opt.read_bytes()
    with zipfile.ZipFile(opt) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
    # the record's bytes start after its local header (30 bytes, its name, its extra field)
    start = info.header_offset + 30 + int.from_bytes(data[info.header_offset + 26:
                                                          info.header_offset + 28], "little") \
        + int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    for at in (start, start + info.file_size // 2, start + info.file_size - 1):
        _overwrite(opt, at, bytes([data[at] ^ 0x01]))  # one bit: the size and structure hold
        assert why_incomplete(str(ckpt)) == (
            f"optimizer.pt is corrupt (record {info.filename}: its bytes' CRC-32 is "
            f"{__import__('zlib').crc32(opt.read_bytes()[start:start + info.file_size]):08x}, "
            f"{info.CRC:08x} was written (bytes garbled inside the data))"), at
        _overwrite(opt, at, data[at:at + 1])
        assert why_incomplete(str(ckpt)) is None


def test_a_changed_but_whole_set_is_accepted_and_described(ckpt):
    from hf_zoffload.integrations.completeness import changed_since_saved
    w = _weights()
    (ckpt / "model.safetensors").unlink()
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for (k, t), n in zip(w.items(), names):
        save_file({k: t}, ckpt / n)
    assert why_incomplete(str(ckpt)) == (  # shards and no index yet: really incomplete
        f"{INDEX} is missing (3 shards, such as {names[0]}, are there)")
    (ckpt / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict(zip(w, names))}))
    assert why_incomplete(str(ckpt)) is None
    assert changed_since_saved(str(ckpt)) == [
        "model.safetensors is missing", f"4 new files ({names[0]} to {INDEX})"]
    # re-saved at another size, still whole: accepted; the marker's difference is named
    torch.save({"last_epoch": 3, "_step_count": 4, "extra": list(range(50))},
               ckpt / "scheduler.pt")
    assert why_incomplete(str(ckpt)) is None
    assert any(c.startswith("scheduler.pt has ") for c in changed_since_saved(str(ckpt)))
    # broken: the difference from the marker, where it concerns the broken file, is named
    os.truncate(ckpt / "optimizer.pt", 100)
    size = json.loads((ckpt / COMPLETE_NAME).read_text())["files"]["optimizer.pt"]
    assert why_incomplete(str(ckpt)) == f"optimizer.pt has 100 bytes, {size} were saved"
