"""Killed and resumed, nothing lost (issue 14, item 3).

`scripts/run_clm.py --zero_offload` is killed with SIGKILL at a seeded random step after a
checkpoint, resumed with --resume_from_checkpoint, and must log the same losses, bit for bit,
as a run that was never interrupted: fp32 and bf16, with and without the delayed update. A
checkpoint whose save was cut short must be refused with one clear error, never resumed from;
``--resume_from_checkpoint true`` resumes from the newest complete one, with a warning.

Every run_clm process spent ~11 s of its ~15 s importing torch and transformers, so the 13
runs are forked from one server that imported run_clm once (tests/_preloaded.py: each is
still its own process, killed alone by SIGKILL, with its own exit status), in two rounds: the
reference and killed runs, then the resumes and the broken checkpoint.
"""

import functools
import json
import logging
import os
import random
import re
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file, save_file
from transformers import GPT2LMHeadModel, PreTrainedModel
from transformers.trainer_utils import get_last_checkpoint

from hf_zoffload.integrations import completeness
from hf_zoffload.integrations.completeness import why_incomplete, write_marker
from hf_zoffload.integrations.trainer import ZeroOffloadTrainer, ZeroOffloadTrainingArguments
from tests._preloaded import Preloaded, Run
from tests._tiny import VOCAB, TokenBlocks, tiny_gpt2
from tests.acceptance.test_run_clm import ROOT, offline_env

# Checkpoints at 6, 12 and 14 (the Trainer also saves at the last step).
STEPS, SAVE_EVERY = 14, 6
KILL_SEED = 14
# Warm-up 2: the delay starts at step 3, so the checkpoint at 6 is saved with an update in
# flight (the save must land it first) and the resumed run is delayed from its first step.
DELAYED = ["--zero_offload_delayed_update", "true",
           "--zero_offload_delayed_update_warmup_steps", "2"]
COMBOS = {"fp32": [], "fp32-delayed": DELAYED, "bf16": ["--bf16"],
          "bf16-delayed": ["--bf16", *DELAYED]}
MARKER = ZeroOffloadTrainer.COMPLETE_NAME


def _kill_step(name: str) -> int:
    # After the checkpoint at SAVE_EVERY and 3 steps or more before the next save: the kill
    # lands a fraction of a step after the log line is read (a step is ~25 ms on an idle
    # core), so a loaded machine has 3 steps of slack before a kill could hit that save.
    return random.Random(f"{KILL_SEED}-{name}").randint(SAVE_EVERY + 1, 2 * SAVE_EVERY - 3)


def _argv(tok: Path, out: Path, extra) -> list[str]:
    # The built-in corpus and default GPT-2 (dropout on: the RNG state must resume too),
    # shrunk to 1 layer of width 32 on 32-token blocks; accumulation 2 for a real window.
    return ["--zero_offload",
            "--do_train", "--tokenizer_name", str(tok), "--corpus_mb", "0.05",
            "--config_overrides", "n_layer=1,n_embd=32,n_head=2", "--block_size", "32",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--max_steps", str(STEPS), "--learning_rate", "3e-3", "--logging_steps", "1",
            "--save_strategy", "steps", "--save_steps", str(SAVE_EVERY), "--report_to", "none",
            "--disable_tqdm", "true", "--use_cpu", "--dataloader_pin_memory", "false",
            "--zero_offload_cpu_threads", "1", "--output_dir", str(out), *extra]


def _env() -> dict:
    env = {k: v for k, v in offline_env().items() if not k.startswith("HF_ZOFFLOAD_")}
    # Unbuffered: the killer reads each step's log line as it is printed. One thread per
    # process: eight processes share the cores, and every run computes with the same count.
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


# What a run imports after run_clm's own imports (the tokenizer, the GPT-2 class, datasets).
PRELOAD = "import datasets; from transformers import AutoTokenizer, GPT2LMHeadModel"


def _kill_at(run: Run, fifo: Path, step: int, log: Path, result: dict) -> None:
    """SIGKILL ``run`` when its ``step``-th per-step log line appears on ``fifo`` (its
    output; logging_steps=1); record how many steps it logged in all."""
    seen = 0
    with open(fifo) as lines, open(log, "w") as f:
        for line in lines:
            f.write(line)
            if line.startswith("{'loss'"):
                seen += 1
                if seen == step:
                    run.kill()
    result.update(rc=run.wait(timeout=600), logged=seen)


def _history(out: Path) -> dict[int, dict]:
    state = json.loads((out / "trainer_state.json").read_text())
    return {e["step"]: e for e in state["log_history"] if "loss" in e}


def _log(path: Path) -> str:
    return path.read_text()[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

    base = tmp_path_factory.mktemp("kill_resume")
    tok = base / "tok"  # built once: every run must see the same token ids
    train_tokenizer(stdlib_corpus(max_mb=0.05), vocab_size=300).save_pretrained(tok)
    res = {name: {"kill_at": _kill_step(name), "killed": {}} for name in COMBOS}
    with Preloaded(ROOT / "scripts" / "run_clm.py", _env(), PRELOAD) as server:
        procs, killers = [], []
        for name, extra in COMBOS.items():
            r = res[name]
            r["ref"], r["out"] = base / f"ref-{name}", base / f"run-{name}"
            procs.append((r, "ref_rc", server.start(_argv(tok, r["ref"], extra),
                                                    out=base / f"ref-{name}.log", cwd=base)))
            fifo = base / f"killed-{name}.fifo"
            os.mkfifo(fifo)
            killed = server.start(_argv(tok, r["out"], extra), out=fifo, cwd=base)
            killers.append(threading.Thread(target=_kill_at, args=(
                killed, fifo, r["kill_at"], base / f"killed-{name}.log", r["killed"])))
            killers[-1].start()
        for r, key, p in procs:
            r[key] = p.wait(timeout=600)
        for t in killers:
            t.join(timeout=600)

        # Round two: every resume, and one from a checkpoint cut short as a SIGKILL in the
        # middle of its optimizer.pt leaves it (the Trainer writes model, optimizer,
        # scheduler, RNG, trainer_state.json, then our marker): that file half written, the
        # later ones absent.
        procs = []
        for name, extra in COMBOS.items():
            r = res[name]
            r["ckpt"] = get_last_checkpoint(r["out"]) if r["out"].is_dir() else None
            if r["ckpt"]:
                # "true" (the newest complete checkpoint in --output_dir) for one combination,
                # the path for the others: both spellings of run_clm's option
                where = "true" if name == "fp32" else r["ckpt"]
                procs.append((r, "resume_rc", server.start(
                    _argv(tok, r["out"], [*extra, "--resume_from_checkpoint", where]),
                    out=base / f"resume-{name}.log", cwd=base)))
        broken = base / "broken"
        shutil.copytree(res["fp32"]["ref"], broken)
        cut = broken / f"checkpoint-{STEPS}"
        opt = cut / "optimizer.pt"
        os.truncate(opt, opt.stat().st_size // 2)
        for name in ("scheduler.pt", "rng_state.pth", "trainer_state.json", MARKER):
            (cut / name).unlink()
        res["broken"] = {"dir": broken, "listing": sorted(os.listdir(broken)),
                         "log": base / "broken.log"}
        procs.append((res["broken"], "rc", server.start(
            _argv(tok, broken, ["--resume_from_checkpoint", str(cut)]), out=res["broken"]["log"],
            cwd=base)))
        for r, key, p in procs:
            r[key] = p.wait(timeout=600)
    res["base"] = base
    return res


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMBOS))
def test_killed_run_resumes_to_the_same_losses(runs, name):
    r, base = runs[name], runs["base"]
    assert r["ref_rc"] == 0, _log(base / f"ref-{name}.log")
    killed = r["killed"]
    assert killed["rc"] == -signal.SIGKILL, _log(base / f"killed-{name}.log")
    # Killed after step kill_at (seed KILL_SEED), before the save at 2 * SAVE_EVERY: the
    # newest checkpoint is the one at SAVE_EVERY and steps after it were lost.
    assert r["kill_at"] <= killed["logged"] < 2 * SAVE_EVERY, killed
    assert Path(r["ckpt"]).name == f"checkpoint-{SAVE_EVERY}"
    assert (Path(r["ckpt"]) / MARKER).is_file()
    assert r["resume_rc"] == 0, _log(base / f"resume-{name}.log")

    ref, resumed = _history(r["ref"]), _history(r["out"])
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(SAVE_EVERY + 1, STEPS + 1):  # logged after the resume: bit for bit
        for key in ("loss", "grad_norm", "learning_rate"):
            assert resumed[step][key] == ref[step][key], (step, key, resumed[step], ref[step])
    got, want = load_file(r["out"] / "model.safetensors"), load_file(r["ref"] / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_delayed_runs_were_delayed(runs, dtype):
    # Equal through the warm-up (steps 1-3 compute on the same params), different from step
    # 4, whose forward runs on the params of step 2: else the option did not take effect.
    sync, delayed = _history(runs[dtype]["ref"]), _history(runs[f"{dtype}-delayed"]["ref"])
    assert [sync[s]["loss"] for s in (1, 2, 3)] == [delayed[s]["loss"] for s in (1, 2, 3)]
    assert sync[4]["loss"] != delayed[4]["loss"]


@pytest.mark.slow
def test_run_clm_refuses_a_checkpoint_cut_short(runs):
    b = runs["broken"]
    text = b["log"].read_text()
    assert b["rc"] != 0, text[-3000:]
    cut, prev = b["dir"] / f"checkpoint-{STEPS}", b["dir"] / f"checkpoint-{2 * SAVE_EVERY}"
    assert f"checkpoint {cut} is incomplete (no {MARKER} and no scheduler.pt, " in text, text
    assert f"The newest complete checkpoint is {prev}" in text, text[-3000:]
    assert sorted(os.listdir(b["dir"])) == b["listing"]  # refused before writing anything


# ------------------------------------------------------- in process: resume_from_checkpoint=True
def _reset_accelerate():
    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton
    GradientState._reset_state()


def _train(out: Path, resume=None, model=None) -> dict[int, float]:
    """4 steps of a tiny GPT-2, checkpoints at 2 and 4; returns the loss of each step."""
    _reset_accelerate()
    args = ZeroOffloadTrainingArguments(
        output_dir=str(out), zero_offload=True, max_steps=4, save_strategy="steps",
        save_steps=2, logging_steps=1, per_device_train_batch_size=2, learning_rate=1e-2,
        use_cpu=True, report_to=[], disable_tqdm=True, seed=0)
    trainer = ZeroOffloadTrainer(model=model or tiny_gpt2(), args=args,
                                 train_dataset=TokenBlocks(16, vocab=VOCAB, seq=16))
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        _reset_accelerate()
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted run for every variant below to copy: (its losses, its directory)."""
    out = tmp_path_factory.mktemp("full")
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
            mp.delenv(key)
        logs = _train(out)
    assert sorted(logs) == [1, 2, 3, 4]
    return logs, out


@pytest.fixture
def run_copy(full_run, tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    shutil.copytree(full_run[1], tmp_path, dirs_exist_ok=True)
    return full_run[0], tmp_path


def _cut_short(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _garble(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:  # same size: the marker's sizes still match
        f.seek(at)
        f.write(data)


# What a save killed at some point, or a crash of the machine, leaves in checkpoint-4. The
# first two are resumed from without a word by the stock load (it skips missing files).
BREAKS = {
    "optimizer.pt missing": (lambda c: (c / "optimizer.pt").unlink(),
                             "optimizer.pt is missing"),
    "rng_state.pth missing": (lambda c: (c / "rng_state.pth").unlink(),
                              "rng_state.pth is missing"),
    "weights cut short": (lambda c: _cut_short(c / "model.safetensors"),
                          r"model.safetensors has \d+ bytes, \d+ were saved"),
    "killed before the last file": (
        lambda c: [(c / n).unlink() for n in ("trainer_state.json", MARKER)],
        f"no {MARKER} and no trainer_state.json"),
    # a crash garbling a header: the sizes match, the content does not
    "weights header garbled": (lambda c: _garble(c / "model.safetensors", 8, b"\xff" * 16),
                               r"model.safetensors is corrupt \(the header is not JSON: .+\)"),
    # 1,000 random bytes in the middle of the optimizer state (issue 35): the sizes and the
    # archive's structure are whole, its records' CRC-32 is not
    "optimizer data garbled": (
        lambda c: _garble(c / "optimizer.pt", (c / "optimizer.pt").stat().st_size // 2,
                          random.Random(35).randbytes(1000)),
        r"optimizer.pt is corrupt \(record \S+/data/\d+: its bytes' CRC-32 is [0-9a-f]{8}, "
        r"[0-9a-f]{8} was written \(bytes garbled inside the data\)\)"),
}


@pytest.mark.parametrize("kind", list(BREAKS))
def test_a_broken_newest_checkpoint_is_skipped_by_resume_true(run_copy, kind, caplog):
    full, out = run_copy
    brk, why = BREAKS[kind]
    brk(out / "checkpoint-4")
    _refused_then_resumed_from_the_one_named(full, out, why, caplog)


def _refused_then_resumed_from_the_one_named(full, out, why, caplog) -> None:
    """The path of the broken checkpoint-4 is refused, naming checkpoint-2, before the model
    changed; resume=True resumes from checkpoint-2 with one warning naming checkpoint-4 and
    why, and logs the uninterrupted run's losses."""
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=rf"checkpoint-4 is incomplete \({why}\): its save was "
                       rf"interrupted. The newest complete checkpoint is .*checkpoint-2"):
        _train(out, resume=str(out / "checkpoint-4"), model=model)
    # refused before the checkpoint's weights were loaded: still the seeded initial ones
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 tiny_gpt2().state_dict().values()))
    with caplog.at_level(logging.WARNING, logger="hf_zoffload"):
        resumed = _train(out, resume=True)
    warned = [r.getMessage() for r in caplog.records if "resume_from_checkpoint" in r.getMessage()]
    assert len(warned) == 1, warned
    assert re.fullmatch(rf"resume_from_checkpoint=True: resuming from \S*checkpoint-2, the "
                        rf"newest complete checkpoint; skipped \S*checkpoint-4 \({why}\)",
                        warned[0]), warned[0]
    assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]


def _nan_master(ckpt: Path) -> None:
    """A master weight of ``ckpt``'s optimizer state made NaN, the file and its marker
    rewritten whole: what a run that had diverged saves."""
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    state["state"][0]["master"].view(-1)[3] = float("nan")
    torch.save(state, ckpt / "optimizer.pt")
    write_marker(str(ckpt), model_only=False)
    assert why_incomplete(str(ckpt)) is None


def test_a_non_finite_optimizer_state_is_refused_and_skipped(run_copy, caplog):
    full, out = run_copy
    _nan_master(out / "checkpoint-4")
    model = tiny_gpt2()
    ckpt = out / "checkpoint-4"
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(str(ckpt))}: optimizer.pt "
                       r"holds non-finite values \(param 0's master: 1 of \d+\): its run had "
                       r"diverged when it saved, or the file changed since; nothing was loaded\. "
                       r"The newest complete checkpoint is \S*checkpoint-2"):
        _train(out, resume=str(ckpt), model=model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 tiny_gpt2().state_dict().values()))
    with caplog.at_level(logging.WARNING, logger="hf_zoffload"):
        resumed = _train(out, resume=True)
    warned = [r.getMessage() for r in caplog.records if "resume_from_checkpoint" in r.getMessage()]
    assert len(warned) == 1 and "skipped" in warned[0] and \
        "checkpoint-4 (optimizer.pt holds non-finite values" in warned[0], warned
    assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]


def _convert_to_shards(ckpt: Path) -> list[Path]:
    """What transformers' test_resume_training_with_checkpoint does to a checkpoint: its
    model.safetensors replaced by an index and one shard per tensor."""
    weights = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = [f"model-{i + 1:05d}-of-{len(weights):05d}.safetensors" for i in range(len(weights))]
    (ckpt / INDEX).write_text(json.dumps(
        {"metadata": {}, "weight_map": dict(zip(weights, names))}, indent=2, sort_keys=True))
    for (key, t), name in zip(weights.items(), names):
        save_file({key: t.contiguous()}, ckpt / name)
    return [ckpt / n for n in names]


def test_a_converted_checkpoint_resumes_with_one_info_line(run_copy, caplog):
    full, out = run_copy
    ckpt = out / "checkpoint-2"
    shards = _convert_to_shards(ckpt)
    assert len(shards) > 2 and why_incomplete(str(ckpt)) is None
    with caplog.at_level(logging.INFO, logger="hf_zoffload"):
        resumed = _train(out, resume=str(ckpt))
    said = [r.getMessage() for r in caplog.records if "changed since it was saved" in
            r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"checkpoint {ckpt} changed since it was saved "
                              f"(model.safetensors is missing; {len(shards) + 1} new files "
                              f"({shards[0].name} to {INDEX})); what a resume reads is "
                              f"whole: resuming from it"), said[0]
    assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]  # bit for bit
    # really broken after the conversion: still refused, naming the shard
    _cut_short(shards[1])
    with pytest.raises(ValueError, match=rf"checkpoint-2 is incomplete \({shards[1].name} is "
                       r"corrupt \(\d+ bytes, its header describes \d+\)\)"):
        _train(out, resume=str(ckpt))
    shards[1].unlink()
    with pytest.raises(ValueError, match=rf"checkpoint-2 is incomplete \({shards[1].name} is "
                       rf"missing \(named by {INDEX}\)\)"):
        _train(out, resume=str(ckpt))


def test_resume_true_with_no_complete_checkpoint_is_one_error(run_copy):
    _, out = run_copy
    for step in (2, 4):
        (out / f"checkpoint-{step}" / "optimizer.pt").unlink()
    listing = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(ValueError, match=rf"^resume_from_checkpoint=True: no complete "
                       rf"checkpoint in {re.escape(str(out))}: \S*checkpoint-4 is incomplete "
                       rf"\(optimizer.pt is missing\); \S*checkpoint-2 is incomplete "
                       rf"\(optimizer.pt is missing\). Start without resuming"):
        _train(out, resume=True)
    assert sorted(p.name for p in out.rglob("*")) == listing


def test_a_file_that_fails_to_load_is_named(run_copy, monkeypatch):
    """Past the structure check (an unknown dtype is only placed, not judged; a check that saw
    nothing), a file that fails to load is one error naming it and the checkpoint, before
    anything is trained or written."""
    _, out = run_copy
    ckpt = out / "checkpoint-4"
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data.replace(b'"F32"', b'"F33"', 1))
    write_marker(str(ckpt), model_only=False)
    listing = {p: p.stat().st_size for p in out.rglob("*")}
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(str(ckpt))}: "
                       r"model.safetensors failed to load \(SafetensorError: .*F33.*\); "
                       r"nothing was trained or saved$"):
        _train(out, resume=str(ckpt))
    weights.write_bytes(data)
    opt = ckpt / "optimizer.pt"
    _cut_short(opt)
    (ckpt / MARKER).unlink()
    monkeypatch.setattr(completeness, "file_problem", lambda path: None)
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(str(ckpt))}: optimizer.pt "
                       r"failed to load \(RuntimeError: .+\); nothing was trained or saved$"):
        _train(out, resume=str(ckpt))
    assert {p: p.stat().st_size for p in out.rglob("*") if p.exists()} == {
        p: (opt.stat().st_size if p == opt else n) for p, n in listing.items()
        if p != ckpt / MARKER}


def test_checkpoint_killed_after_its_last_file_still_resumes(run_copy):
    # The marker is written after trainer_state.json; a kill between the two leaves every file
    # whole, and a checkpoint saved without offload has no marker at all: both resume.
    full, out = run_copy
    sizes = json.loads((out / "checkpoint-4" / MARKER).read_text())["files"]
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "model.safetensors"} <= sizes.keys()
    (out / "checkpoint-2" / MARKER).unlink()
    resumed = _train(out, resume=str(out / "checkpoint-2"))
    assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]


# ------------------------------------------------------- sharded weights (issue 24, item 2)
# How a tiny model gets saved as shards: in transformers 5.x Trainer._save calls
# model.save_pretrained(output_dir, state_dict=..., is_main_process=...) without
# max_shard_size, so PreTrainedModel.save_pretrained's default (50GB) decides; the offload
# path's per-instance save_pretrained (core._save_pretrained) calls the class's. A class
# default of 40KB splits the tiny GPT-2's ~120 KB of fp32 weights into shards and
# model.safetensors.index.json, as max_shard_size does for a model of billions of params.
INDEX = "model.safetensors.index.json"


def _shard_saves(mp) -> None:
    mp.setattr(GPT2LMHeadModel, "save_pretrained", functools.partialmethod(
        PreTrainedModel.save_pretrained, max_shard_size="40KB"))


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
            mp.delenv(key)
        _shard_saves(mp)
        logs = _train(out)
    return logs, out


@pytest.fixture
def sharded_copy(sharded_run, tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    _shard_saves(monkeypatch)  # the resumed runs save sharded too
    shutil.copytree(sharded_run[1], tmp_path, dirs_exist_ok=True)
    return sharded_run[0], tmp_path


def _shards(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("model-*-of-*.safetensors"))


def test_sharded_checkpoint_resumes_like_an_unsharded_one(full_run, sharded_copy):
    full, _ = full_run
    sharded, out = sharded_copy
    ckpt = out / "checkpoint-2"
    shards = _shards(ckpt)
    assert len(shards) >= 2 and (ckpt / INDEX).is_file()
    assert not (ckpt / "model.safetensors").exists()  # the resume reads the shards
    named = set(json.loads((ckpt / INDEX).read_text())["weight_map"].values())
    assert named == {p.name for p in shards}
    sizes = json.loads((ckpt / MARKER).read_text())["files"]
    assert all(sizes[p.name] == p.stat().st_size for p in shards) and INDEX in sizes
    assert sharded == full  # how the weights are saved changes nothing in the run

    resumed = _train(out, resume=str(ckpt))
    assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]  # bit for bit
    # saved by the stock Trainer (no marker), or killed between the last file and it: whole
    (ckpt / MARKER).unlink()
    resumed = _train(out, resume=str(ckpt))
    assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]


def _second_shard(c: Path) -> Path:
    return _shards(c)[1]


def _killed_while_writing_shards(c: Path) -> None:
    # save_pretrained writes the index after the last shard; the Trainer's files come after
    for name in (INDEX, "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                 MARKER):
        (c / name).unlink()
    _second_shard(c).unlink()


SHARD = r"model-00002-of-\d{5}\.safetensors"
# What a save cut short (a kill, or a machine crash: files short or gone) leaves of a sharded
# checkpoint-4; the second group has no marker, as a save killed before it.
SHARDED_BREAKS = {
    "a shard missing": (lambda c: _second_shard(c).unlink(), rf"{SHARD} is missing"),
    "a shard cut short": (lambda c: _cut_short(_second_shard(c)),
                          rf"{SHARD} has \d+ bytes, \d+ were saved"),
    "the index missing": (lambda c: (c / INDEX).unlink(), rf"{INDEX} is missing"),
    "no marker, a shard missing": (
        lambda c: [(c / MARKER).unlink(), _second_shard(c).unlink()],
        rf"no {MARKER} and no {SHARD} \(named by {INDEX}\)"),
    "no marker, the index missing": (
        lambda c: [(c / MARKER).unlink(), (c / INDEX).unlink()],
        rf"no {MARKER} and no {INDEX} \(\d+ shards, such as model-00001-of-\d{{5}}"
        r"\.safetensors, are there\)"),
    "no marker, the index cut short": (
        lambda c: [(c / MARKER).unlink(), _cut_short(c / INDEX)], rf"{INDEX} is unreadable \(.+\)"),
    "killed while writing the shards": (
        _killed_while_writing_shards,
        rf"no {MARKER} and no {INDEX} \(\d+ shards, such as .*, are there\), optimizer.pt, "
        r"scheduler.pt, rng_state.pth, trainer_state.json"),
    "no marker, trainer_state.json cut short": (
        lambda c: [(c / MARKER).unlink(), _cut_short(c / "trainer_state.json")],
        rf"no {MARKER} and trainer_state.json is unreadable \(.+\)"),
}


@pytest.mark.parametrize("kind", list(SHARDED_BREAKS))
def test_a_sharded_checkpoint_cut_short_is_refused(sharded_copy, kind, caplog):
    full, out = sharded_copy
    brk, why = SHARDED_BREAKS[kind]
    brk(out / "checkpoint-4")
    _refused_then_resumed_from_the_one_named(full, out, why, caplog)  # checkpoint-2: whole


def test_a_model_only_save_needs_no_optimizer_state(run_copy):
    # save_only_model=True writes the weights and trainer_state.json only; its marker says
    # so, and a resume (stock: a fresh optimizer) is not refused as interrupted. The same
    # files under a marker of a full save are.
    _, out = run_copy
    ckpt = out / "checkpoint-4"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (ckpt / name).unlink()
    write_marker(str(ckpt), model_only=True)
    assert why_incomplete(str(ckpt)) is None
    write_marker(str(ckpt), model_only=False)
    assert why_incomplete(str(ckpt)) == "optimizer.pt is missing"
