"""scripts/bench/sweep_q4_code.py (the 4-bit code and block sweep): its parametrized codec is
the project's own 4- and 8-bit references where it names their codes, its reference
optimizer steps like exact Adam where no code rounds, and a short run of every measurement
prints its tables."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import sweep_q4_code as sw  # noqa: E402

from hf_zoffload.ops import moments as mo  # noqa: E402


def _moments(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over ~20 binades, zeros, and a subnormal-only block
    m = torch.randn(n, generator=g) * torch.exp(4 * torch.randn(n, generator=g))
    v = (torch.randn(n, generator=g) * torch.exp(4 * torch.randn(n, generator=g))).square()
    m[::7] = 0.0
    v[::5] = 0.0
    if n > 300:
        m[256:300] = 1e-40
    return m, v


def _same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("n", [1, 127, 129, 1000, 4099])
def test_current_codes_are_the_projects_references(n):
    m, v = _moments(n, n)
    qm, qv = sw.store(sw.parse(sw.CURRENT), m, v)
    rm, rv = mo.decode_reference4(*mo.encode_reference4(m, v), n)
    assert _same_bits(qm, rm) and _same_bits(qv, rv)
    if n > 32:  # another block is another result: the block is a parameter, not fixed
        assert not _same_bits(sw.store(sw.parse("pow2/e3m1/32"), m, v)[0], rm)
    qm, qv = sw.store(sw.parse(sw.INT8), m, v)
    rm, rv = mo.decode_reference(*mo.encode_reference(m, v))
    assert _same_bits(qm, rm) and _same_bits(qv, rv)


@pytest.mark.parametrize("name", ["pow2", "e2m1", "lin"])
def test_m_levels_top_at_one_round_to_nearest_and_flush_below(name):
    code = sw.M_CODES[name]
    levels = code.round(torch.linspace(0, 1, 100001))
    assert levels.max() == 1.0 and levels.min() == 0.0
    distinct = levels.unique()
    assert len(distinct) == code.top + 1  # every code is used
    assert float(distinct[1]) == pytest.approx(code.lowest())
    # each level is stored as itself
    assert torch.equal(code.round(distinct), distinct)


def test_linear_levels_are_even_and_float_levels_binades():
    lin = sw.M_CODES["lin"].round(torch.linspace(0, 1, 1001)).unique()
    assert torch.allclose(lin, torch.arange(8) / 7.0)
    pow2 = sw.M_CODES["pow2"].round(torch.linspace(0, 1, 100001)).unique()
    assert torch.equal(pow2[1:], 2.0 ** torch.arange(-6, 1, dtype=torch.float32))
    e3m1 = sw.U_CODES["e3m1"].round(torch.linspace(0, 1, 100001)).unique()
    assert len(e3m1) == 15 and float(e3m1[1]) == 1.5 * 2.0**-7


def test_without_rounding_the_reference_optimizer_is_adamw(monkeypatch):
    """With the moments kept as they are (store an identity) the reference's arithmetic is
    AdamW's: the ratio cap never binds on exact moments."""
    monkeypatch.setattr(sw, "store", lambda c, m, v: (m, v))
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(300))
    b = torch.nn.Parameter(a.detach().clone())
    start = a.detach().clone()
    oa = sw.Q4Adam([a], sw.parse(sw.CURRENT), lr=1e-2)
    ob = torch.optim.AdamW([b], lr=1e-2, betas=sw.BETAS, eps=sw.EPS, weight_decay=sw.WD,
                           foreach=False)
    for i in range(5):
        g = torch.randn(300, generator=torch.Generator().manual_seed(i))
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert float((a.detach() - start).abs().mean()) > 1e-2  # 1e4 x atol: not void


def test_bad_candidates_are_refused_by_name(capsys):
    for argv, name in ((["--candidates", "pow2/e9m9/128"], "'pow2/e9m9/128'"),
                       (["--steps", "0", "--train", "pow2/e3m1/33"], "'pow2/e3m1/33'")):
        with pytest.raises(SystemExit) as exit_info:
            sw.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert name in err and "a candidate is m/u/block" in err


def test_speed_table_times_the_kernel_at_each_block(capsys):
    assert sw.main(["--steps", "0", "--speed", "--speed_elements", "3000", "--rounds", "2",
                    "--speed_blocks", "64,128"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 64 ")
            or line.startswith("| 128 ")]
    assert len(rows) == 2 and rows[1][2].strip(" |") == "1.000"


@pytest.mark.slow
def test_shadow_and_training_tables(capsys):
    assert sw.main(["--steps", "3", "--candidates", f"{sw.CURRENT},lin/e3m1/64",
                    "--train", sw.CURRENT, "--train_steps", "20"]) == 0
    out = capsys.readouterr().out
    assert f"| {sw.CURRENT} (current) | 1.062 |" in out and "| lin/e3m1/64 | 1.125 |" in out
    assert "| fp32 AdamW |" in out and f"| {sw.CURRENT} | " in out
