"""The CPU-Adam benchmarks at tiny sizes: bench_cpu_adam.py prints every row once per thread
count, with the bytes per param each path moves and its ratios to each reference, timed in
rounds (scripts/bench/_interleave.py, tested in test_bench_interleave.py);
bench_kernel_loop.py builds its C driver and times every state."""

import re
import runpy
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_prints_every_row_with_its_bytes(capsys):
    bench = runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_cpu_adam.py"))  # main() not run
    argv = ["--sizes", "4K", "--threads", "1,2", "--repeats", "1", "--qblocks", "16,256",
            "--llama_div", "64"]
    threads = torch.get_num_threads()
    try:
        assert bench["main"](argv) == 0
    finally:
        torch.set_num_threads(threads)  # main() sets it per row
    out, heading, second = capsys.readouterr().out.partition("bf16 master against fp32 master")
    assert heading
    second, heading, third = second.partition("CPUAdam over TinyLlama-1.1B's param list")
    assert heading
    llama = re.findall(r"^\| 201 \| 0\.3M \| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", third,
                       re.M)
    assert [t for t, *_ in llama] == ["1", "2"] and all(float(x) > 0 for r in llama for x in r)
    assert "Rounds per block: 1, each timing every row once, the order rotating" in out
    header = next(line for line in out.splitlines() if line.startswith("| params |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    refs = {"vs torch fused": "torch AdamW(fused) fp32", "vs torch composed":
            "torch composed 16-bit", "vs fp32 state": "ours fp32 state, out over grads"}
    if "deepspeed not installed" not in out:
        refs["vs DeepSpeed"] = "DeepSpeedCPUAdam fp32"
    assert cols[7:] == ["of ceiling"] + [c for c in cols[8:] if c in refs]
    assert sorted(cols[8:]) == sorted(refs)
    table = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
             if line.startswith("| 0.004M |")]
    assert all(len(r) == len(cols) for r in table)
    ceiling = "ceiling (28 B): the fastest pass below, per round"
    ways = [r for r in table if r[2].startswith("ceiling pass, ")]
    assert sorted(r[2][len("ceiling pass, "):] for r in ways) == sorted(
        ["plain", "unroll 4", "prefetch 512", "prefetch 2048", "streaming stores",
         "the engine's shape (fp32 x3 and 16-bit, read and written)"] * 2)
    for r in ways:  # the ceiling is the fastest pass of each round: no pass above it
        assert float(r[7]) <= 1.0, r
    for r in table:  # each reference against itself, in the same round: exactly 1
        if r[2] == ceiling:
            assert r[7] == "1.00"
        for col, ref in refs.items():
            if r[2] == ref:
                assert r[cols.index(col)] == "1.00", (col, r)
    rows = re.findall(r"^\| 0\.004M \| (\d) \| ([^|]+?) \| ([\d.]+) \| [\d.]+ \|",
                      out, re.M)
    for threads in ("1", "2"):
        got = {name: float(nbytes) for t, name, nbytes in rows if t == threads}
        assert list(got)[0] == ceiling
        assert list(got)[-1] == "int8 ceiling (read 8, write 8)"
        assert got["ours fp32 state, out over grads"] == 28
        assert got["ours bf16 state, out over grads"] == 20
        assert got["ours undo of an fp32-state step, from 16-bit grads"] == 26
        assert got["ours int8 state (block 16), out over grads"] == 17  # + an fp32 scale / 16
        assert got["ours int8 state (block 256), out over grads"] == 16.0625
        assert got["ours int4 state (block 128), out over grads"] == 14.125  # nibbles, scales
        assert got["ours bf16 master + fp32 state, out over grads"] == 24
        assert got["ours bf16 master + bf16 state, out over grads"] == 16
        assert got["ours bf16 master + int8 state, out over grads"] == 12.0625
        assert got["ours bf16 master + int4 state (block 128), out over grads"] == 10.125
        assert got["int8 ceiling (read 8, write 8)"] == 16
    # the bf16 masters against the fp32 masters of the same moments (int8: the block-256 row)
    pairs = re.findall(r"^\| 0\.004M \| (\d) \| (\w+) \| ([\d.]+) / ([\d.]+) \| ([\d.]+) \|$",
                       second, re.M)
    assert [(t, s, float(a), float(b)) for t, s, a, b, _ in pairs] == [
        (t, s, a, b) for t in ("1", "2") for s, a, b in
        [("fp32", 28, 24), ("bf16", 20, 16), ("int8", 16.0625, 12.0625), ("int4", 14.125, 10.125)]]
    assert all(float(ratio) > 0 for *_, ratio in pairs)


@pytest.mark.slow
def test_kernel_loop_builds_and_times_every_state():
    loop = runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_kernel_loop.py"))
    ns = loop["run"](4096, 3, 1)
    assert list(ns) == [f"{m} master, {s} state" for m in ("fp32", "bf16")
                        for s in ("fp32", "bf16", "int8", "int4")]
    assert all(0 < v < 1e6 for v in ns.values()), ns


@pytest.mark.slow
def test_kernel_loop_clock_probe_measures_the_core():
    """The probe's figures are a clock and two throughputs a CPU can have: a core between 0.5
    and 8 GHz, vsqrtps and vdivps of 8 lanes between 1 and 60 cycles each, the pair
    interleaved no faster than the slower of the two alone; and on a CPU with AVX-512 (only
    there) the 16-lane figures, alike."""
    loop = runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_kernel_loop.py"))
    core = loop["clock"]()
    assert 0.5 < core["ghz"] < 8, core
    assert 1 < core["sqrt"] < 60 and 1 < core["div"] < 60, core
    assert 0.9 * max(core["sqrt"], core["div"]) < core["sqrt+div"] < 120, core
    # -march=native: the CPU's own ISA
    assert ("zmm" in core) == ("avx512f" in loop["_cpu_flags"]()), core
    if "zmm" in core:  # 16-lane figures: two ops of 2-120 cycles each, 16 shifts 2-64 cycles
        z = core["zmm"]
        assert list(z) == list(loop["ZMM"]), z
        assert 2 < z["2 vsqrtps"] < 240 and 2 < z["2 vdivps"] < 240 and 2 < z["16 vpsrld"] < 64
        for op in ("2 vsqrtps", "2 vdivps"):  # interleaved: no faster than the slower alone
            assert 0.9 * max(z[op], z["16 vpsrld"]) < z[f"{op} + 16 vpsrld"], z


@pytest.mark.parametrize("figures, port", [
    ((1.00, 2.00, 1.00), "the shifts'"),  # vpsrld on the Xeon of family 6 model 167
    ((2.00, 2.00, 3.00), "the shuffles'"),  # vpermt2w there: 2 uops, port 5
    ((0.54, 1.08, 1.08), "either"),  # vmulps there
    ((1.23, 1.61, 1.61), "both"),  # vpmulld there
])
def test_port_class_reads_which_port_an_op_shares(figures, port):
    loop = runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_kernel_loop.py"))
    assert loop["port_class"](*figures) == port


@pytest.mark.slow
def test_port_probe_times_the_coded_pass_ops_where_the_cpu_has_avx512():
    """Where the CPU has AVX-512, every op it has of PORT_OPS gets three throughputs a core can
    have and a class, and each reference op shares its own port (an op beside 16 of itself
    takes twice as long as alone, whatever its port); elsewhere one clear error."""
    loop = runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_kernel_loop.py"))
    flags = loop["_cpu_flags"]()
    if not {"avx512f", "avx512bw"} <= flags:
        with pytest.raises(RuntimeError, match="AVX-512"):
            loop["ports"]()
        return
    ghz, rows = loop["ports"]()
    assert 0.5 < ghz < 8
    assert list(rows) == [name for name, _, flag in loop["PORT_OPS"] if flag in flags], rows
    for name, figures in rows.items():
        assert all(0.1 < f < 20 for f in figures), (name, figures)
        assert loop["port_class"](*figures) in loop["PORT_CLASSES"]
    for ref, beside in zip(loop["PORT_REFS"], (1, 2), strict=True):
        alone, pair = rows[ref][0], rows[ref][beside]
        assert pair == pytest.approx(2 * alone, rel=0.25), (ref, rows[ref])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="counting needs valgrind")
def test_kernel_loop_counts_instructions_of_every_state():
    loop = runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_kernel_loop.py"))
    counts = loop["instructions"](4096, 1)
    assert list(counts) == [f"{m} master, {s} state" for m in ("fp32", "bf16")
                            for s in ("fp32", "bf16", "int8", "int4")]
    # the vector kernels: a few instructions per param, more where moments are coded
    assert all(1 < v < 40 for v in counts.values()), counts
    assert counts["fp32 master, fp32 state"] < counts["fp32 master, int8 state"], counts


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("objdump") is None,
                    reason="the split needs valgrind and objdump")
def test_kernel_loop_splits_the_count_by_kind():
    """The kinds add up to the count, and every mode takes the update's one vsqrtps and one
    vdivps per 8 params: 0.25 divider instructions per param."""
    loop = runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_kernel_loop.py"))
    modes = [m for m in loop["MODES"] if m[0] in ("fp32 master, fp32 state",
                                                   "bf16 master, int4 state")]
    split = loop["kinds"](4096, 1, modes)
    total = loop["instructions"](4096, 1, modes)
    for name, per in split.items():
        assert list(per) == list(loop["KINDS"]), per
        assert sum(per.values()) == pytest.approx(total[name], rel=0.02), (name, per, total)
        assert per["divider"] == pytest.approx(0.25, abs=0.01), (name, per)
        assert per["vector ALU"] > 1 and per["scalar"] > 0, (name, per)


@pytest.mark.parametrize("argv", [["--kinds"], ["--instructions", "--clock"],
                                  ["--ports", "--clock"]])
def test_kernel_loop_refuses_options_it_would_ignore(argv, capsys):
    loop = runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_kernel_loop.py"))
    with pytest.raises(SystemExit) as e:
        loop["main"](argv)
    assert e.value.code == 2
    assert "give" in capsys.readouterr().err
