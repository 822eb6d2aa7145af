"""scripts/bench/gpu_practicality.py, scripts/bench/gpu_peers.py and scripts/gpu_wheels.sh,
checked where there is no GPU: the rows and ratios, the argument errors, a tiny CPU run of each
way, the wheels unpacked onto sys.path, a peer missing (a figure) or broken (a failure), and a
carried stand-in for torchao measured against practicality's figures (all in this process,
with --device cpu, so this holds on a GPU machine too).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
BENCH = str(SCRIPTS / "bench")
sys.path.insert(0, BENCH)  # the measurement scripts import their siblings as a script does
try:
    import _gpu_llama as llama
    import gpu_peers
    import gpu_practicality
finally:
    sys.path.remove(BENCH)

GiB = 2**30
TINY = ("hidden_size=32,intermediate_size=64,num_attention_heads=4,num_key_value_heads=2,"
        "head_dim=8,vocab_size=97,max_position_embeddings=64")


# ------------------------------------------------------------------ practicality
def test_practicality_rows_and_ratios():
    amp = {"way": llama.AMP, "tokens_per_s": 40000.0, "ms_per_step": 204.8,
           "peak_bytes": 30 * GiB, "final_loss": 10.4}
    ours = {**amp, "way": llama.ZOFFLOAD, "tokens_per_s": 10000.0, "peak_bytes": None}
    delayed = {**ours, "way": llama.ZOFFLOAD + gpu_practicality.DELAYED,
               "tokens_per_s": 20000.0}
    assert gpu_practicality.row(ours, amp) == [llama.ZOFFLOAD, "10,000", "205", "n/a", "0.25",
                                               "10.400", "n/a"]
    overlapped = {**ours, "way": llama.ZOFFLOAD + gpu_practicality.OVERLAP, "hit_share": 0.625}
    assert gpu_practicality.row(overlapped, amp)[-1] == "0.62"
    assert gpu_practicality.row(amp, None)[3:5] == ["30.00", "n/a"]
    line = gpu_practicality.ratio_line([amp, ours, delayed])
    assert line.startswith("ZeRO-Offload runs at 25.0% of AMP AdamW's tokens/s, 50.0% with "
                           "the delayed update; reference (issue 22, DeepSpeed's study): "
                           "ZeRO-Offload at 17.6% of no-offload speed")
    assert gpu_practicality.ratio_line([amp, delayed]) == "ratios: n/a (a way did not finish)"
    assert gpu_practicality.check([amp, {**ours, "final_loss": float("nan")}]) == [
        f"{llama.ZOFFLOAD}: final loss nan"]


def test_practicality_arguments_are_checked(capsys):
    for bad in (["--batch", "0"], ["--steps", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit) as e:
            gpu_practicality.parse_args(bad)
        assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_practicality.parse_args(["--offload_fractions", "0,half"])
    assert e.value.code == 2 and "--offload_fractions: ZeRO-Offload setting 'offload_fraction'" \
        in capsys.readouterr().err


def test_practicality_runs_the_fractions_asked_for(capsys):
    rc = gpu_practicality.main(["--device", "cpu", "--overrides", TINY + ",num_hidden_layers=1",
                                "--batch", "2", "--seq", "16", "--warmup", "2", "--steps", "1",
                                "--offload_fractions", "0,auto"])
    assert rc == 0
    rows = [x for x in capsys.readouterr().out.splitlines()
            if x.startswith("summary: | ") and "tokens/s" not in x and "---" not in x]
    assert [r[len("summary: "):].split(" | ")[0][2:] for r in rows][3:5] == [
        llama.ZOFFLOAD + gpu_practicality.FRACTION + f for f in ("0", "auto")]


def test_practicality_runs_its_three_ways_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = gpu_practicality.main(["--device", "cpu", "--overrides", TINY + ",num_hidden_layers=1",
                                "--batch", "2", "--seq", "16", "--warmup", "1", "--steps", "2",
                                "--json", str(out)])
    assert rc == 0
    said = capsys.readouterr().out
    lines = [x[len("summary: "):] for x in said.splitlines() if x.startswith("summary: ")]
    assert lines[0].startswith("Llama 1 layers x 32") and "batch 2 x 16 tokens" in lines[0]
    assert lines[2] == "| " + " | ".join(gpu_practicality.HEADER) + " |"
    rows = [x for x in lines if x.startswith("| ") and "tokens/s" not in x and "---" not in x]
    overlap = llama.ZOFFLOAD + gpu_practicality.OVERLAP
    assert [r.split(" | ")[0][2:] for r in rows] == [
        llama.AMP, llama.ZOFFLOAD, llama.ZOFFLOAD + gpu_practicality.DELAYED, overlap,
        overlap + gpu_practicality.CLIPPED]
    assert rows[0].split(" | ")[4] == "1.00" and lines[-1].startswith("ZeRO-Offload runs at ")
    saved = json.loads(out.read_text())
    assert saved["batch"] == 2 and len(saved["results"]) == 5
    assert all(r["tokens_per_s"] > 0 for r in saved["results"])
    # the hit rate is the overlapped rows' own: the tiny model's norm stays under 1.0 or not,
    # but each of its steps speculated (1 warm-up + 2 timed)
    hits = [r.split(" | ")[-1].rstrip(" |") for r in rows]
    assert hits[:3] == ["n/a"] * 3 and all(h != "n/a" for h in hits[3:])
    assert saved["results"][3]["hit_share"] == 1.0  # no clipping: every step stood


def test_fsdp2_line_compares_the_step_times():
    alone = {"way": llama.ZOFFLOAD, "ms_per_step": 400.0}
    ours = {"way": llama.FSDP2, "ms_per_step": 500.0}
    theirs = {"way": llama.FSDP2_TORCH, "ms_per_step": 1500.0}
    assert gpu_practicality.fsdp2_line([alone, ours, theirs]) == (
        "FSDP2 parameter offload with ZeroOffloadOptimizer: 500 ms/step, 1.25x the step time "
        "of optimizer offload alone (400 ms), 3.00x faster than FSDP2 with torch "
        "AdamW(fused) on the host (1500 ms)")
    assert gpu_practicality.fsdp2_line([alone, theirs]) is None
    assert gpu_practicality.fsdp2_line([ours]).endswith("500 ms/step")


def test_practicality_leaves_out_the_ways_its_time_limit_cannot_hold(monkeypatch, capsys):
    """Under gpu_check.sh (its stage limit less 4 s): a way starts only while 1.1 x the longest
    so far is left; those left out are named in a bold line, and the stage still passes."""
    clock = {"t": 0.0}

    def measure(name, make, **kw):
        clock["t"] += 10.0  # each way takes 10 s
        return {"way": name, "tokens_per_s": 1.0, "ms_per_step": 1.0, "final_loss": 1.0,
                "peak_bytes": None, "steps": 3}

    monkeypatch.setattr(gpu_practicality, "measure", measure)
    monkeypatch.setattr(gpu_practicality.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(llama, "one_rank_group", lambda device: gpu_practicality.contextlib
                        .nullcontext())
    monkeypatch.setenv("GPU_CHECK_STAGE_S", "40")  # 36 s: three ways and no more
    rc = gpu_practicality.main(["--device", "cpu", "--fsdp2"])
    assert rc == 0
    out = capsys.readouterr().out
    overlap = llama.ZOFFLOAD + gpu_practicality.OVERLAP
    assert (f"summary: **not run, the 36 s time limit being near: {overlap}; "
            f"{overlap + gpu_practicality.CLIPPED}; {llama.FSDP2}; {llama.FSDP2_TORCH}**") in out
    with pytest.raises(SystemExit):
        gpu_practicality.parse_args(["--time_limit", "0"])


@pytest.mark.slow
def test_practicality_runs_the_fsdp2_ways_on_the_cpu(capsys):
    """FSDP2 parameter offload on a one-rank gloo group over a CPU mesh, with our optimizer
    and with torch's fused AdamW: both train (each loss finite), and the line compares them."""
    rc = gpu_practicality.main(["--device", "cpu", "--overrides", TINY + ",num_hidden_layers=1",
                                "--batch", "2", "--seq", "16", "--warmup", "1", "--steps", "1",
                                "--fsdp2"])
    assert rc == 0
    out = capsys.readouterr().out
    rows = [x for x in out.splitlines() if x.startswith("summary: | ") and "---" not in x]
    assert [r[len("summary: | "):].split(" | ")[0] for r in rows][-2:] == list(
        gpu_practicality.FSDP2_WAYS)
    assert "summary: FSDP2 parameter offload with ZeroOffloadOptimizer: " in out
    import torch.distributed as dist

    assert not dist.is_initialized()  # the group is the script's, for the FSDP2 ways


# ------------------------------------------------------------------ peers
def _wheel(folder: Path, name: str, files: dict[str, str], version="9.9.0") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, textwrap.dedent(text))
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return path


@pytest.fixture
def clean_imports(monkeypatch):
    """sys.path and any torchao modules as they were, after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # what load_torchao sets
    yield
    for mod in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        del sys.modules[mod]


# A stand-in for torchao's CPUOffloadOptimizer with its call signature, on the CPU: torch's
# AdamW over the params (the real one needs CUDA; its logic is not what is tested here).
FAKE_TORCHAO = {
    "torchao/__init__.py": "from . import optim\n",
    "torchao/optim/__init__.py": """
        import torch

        class CPUOffloadOptimizer:
            def __init__(self, params, optimizer_class, *, offload_gradients=False, **kw):
                assert offload_gradients and optimizer_class is torch.optim.AdamW
                self.opt = optimizer_class(list(params), **kw)

            def step(self):
                self.opt.step()

            def zero_grad(self):
                self.opt.zero_grad()
        """}


def test_unpack_wheels_puts_them_first_on_the_path(tmp_path, clean_imports):
    _wheel(tmp_path / "wheels", "fake_peer", {"fake_peer/__init__.py": "VALUE = 7\n"})
    (tmp_path / "wheels" / "notes.txt").write_text("not a wheel")
    names = gpu_peers.unpack_wheels(str(tmp_path / "wheels"), str(tmp_path / "site"))
    assert names == ["fake_peer-9.9.0-py3-none-any.whl"] and sys.path[0] == str(tmp_path / "site")
    import fake_peer

    assert fake_peer.VALUE == 7
    del sys.modules["fake_peer"]
    assert gpu_peers.unpack_wheels(str(tmp_path / "none"), str(tmp_path / "site2")) == []


def test_torchao_missing_is_a_figure_not_a_failure(clean_imports, capsys):
    cls, where, broken = gpu_peers.load_torchao()
    assert cls is None and not broken
    assert where.startswith("not available: no torchao wheel carried (bash scripts/gpu_wheels.sh")
    rc = gpu_peers.main(["--device", "cpu", "--wheels", "/nonexistent",
                         "--overrides", TINY + ",num_hidden_layers=1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "that stage did not run" in out and "| DeepSpeed ZeRO-2, offload_optimizer cpu | " \
                                               "not measured: PyPI has DeepSpeed" in out


def test_peers_measure_a_carried_torchao_against_practicality(tmp_path, clean_imports, capsys,
                                                               monkeypatch):
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    _wheel(tmp_path / "wheels", "torchao", FAKE_TORCHAO)
    amp = {"way": llama.AMP, "tokens_per_s": 1e9, "ms_per_step": 1.0, "peak_bytes": GiB,
           "final_loss": 5.0}
    ours = {**amp, "way": llama.ZOFFLOAD, "tokens_per_s": 5e8}
    ref = tmp_path / "p.json"
    ref.write_text(json.dumps({"overrides": TINY + ",num_hidden_layers=1", "batch": 2,
                               "seq": 8, "warmup": 1, "steps": 1, "results": [amp, ours]}))
    rc = gpu_peers.main(["--device", "cpu", "--wheels", str(tmp_path / "wheels"),
                         "--against", str(ref)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "batch 2 x 8 tokens, 1 warm-up + 1 timed steps (gpu_practicality.py's figures " \
           "from this run)" in out
    row = next(x for x in out.splitlines() if x.startswith(f"summary: | {gpu_peers.TORCHAO}"))
    cells = row.split(" | ")
    assert float(cells[2].replace(",", "")) > 0 and float(cells[5]) < 1  # vs AMP: 1e9 tokens/s
    assert f"| {llama.ZOFFLOAD} (practicality stage) | 500,000,000 |" in out
    assert "summary: torchao: torchao 9.9.0 from its carried wheel" in out
    assert not list(tmp_path.glob("gpu_peers_*"))  # its scratch folder is gone


def test_peers_start_no_peer_their_time_limit_cannot_hold(tmp_path, clean_imports, capsys,
                                                          monkeypatch):
    """Under gpu_check.sh (its stage limit less 3 s): with under MIN_START_S left the peer is
    not started; its row says so, a missing figure, and the stage passes."""
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    _wheel(tmp_path / "wheels", "torchao", FAKE_TORCHAO)
    monkeypatch.setenv("GPU_CHECK_STAGE_S", "5")  # 2 s: under MIN_START_S
    assert gpu_peers.parse_args([]).time_limit == 2.0
    rc = gpu_peers.main(["--device", "cpu", "--wheels", str(tmp_path / "wheels"),
                         "--overrides", TINY + ",num_hidden_layers=1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert (f"| {gpu_peers.TORCHAO} | not run: under {gpu_peers.MIN_START_S:.0f} s of the "
            "time limit left |") in out
    with pytest.raises(SystemExit):
        gpu_peers.parse_args(["--time_limit", "0"])


def test_a_broken_carried_torchao_fails_the_stage(tmp_path, clean_imports, capsys):
    _wheel(tmp_path / "wheels", "torchao", {"torchao/__init__.py": "import no_such_dep\n"})
    rc = gpu_peers.main(["--device", "cpu", "--wheels", str(tmp_path / "wheels"),
                         "--overrides", TINY + ",num_hidden_layers=1"])
    assert rc == 1
    assert "import failed: ModuleNotFoundError: No module named 'no_such_dep'" in \
        capsys.readouterr().out


def test_gpu_wheels_script_fetches_only_binary_wheels_for_the_gpu_machine():
    text = (SCRIPTS / "gpu_wheels.sh").read_text()
    assert "--no-deps --only-binary=:all:" in text and "--python-version 3.12" in text
    assert "WHEELS=(torchao==0.18.0)" in text
    assert "wheels/" in (ROOT / ".gitignore").read_text().splitlines()
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_wheels.sh")], capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_a_way_past_its_deadline_times_fewer_steps_and_still_gives_its_figure():
    """``measure``'s deadline: past it, one warm-up step and one timed step still run (a
    figure), the rest do not start; ``steps`` says how many were timed and the rates use it."""
    args = gpu_practicality.parse_args(["--device", "cpu", "--overrides", TINY, "--batch", "2",
                                        "--seq", "16", "--warmup", "3", "--steps", "5"])
    calls = []

    def make(model):
        step, finish = llama.zoffload_step(model)[:2]
        return (lambda ids: calls.append(1) or step(ids)), finish
    base = llama.with_overrides(llama.LLAMA_1B, TINY, what="test")
    r = gpu_practicality.measure("zo", make, base=base, dtype=torch.bfloat16, args=args,
                                 deadline=0.0)  # long past
    assert r["steps"] == 1 and len(calls) == 2
    assert r["tokens_per_s"] == pytest.approx(2 * 16 / (r["ms_per_step"] / 1e3))
    full = gpu_practicality.measure("zo", make, base=base, dtype=torch.bfloat16, args=args)
    assert full["steps"] == 5 and len(calls) == 2 + 8
