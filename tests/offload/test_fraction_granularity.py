"""offload_fraction on a model whose state is one bucket (issue 35, item 5): buckets are the
unit of placement, so 0.5 asked puts it all on the host; the memory report says what was
asked, what was placed and what bucket size comes closer, and that size does."""

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from hf_zoffload.offload.memory import format_report
from tests._tiny import tiny_gpt2


def _report(**plugin):
    model = tiny_gpt2()
    opt = ZeroOffloadOptimizer(model.parameters(), lr=1e-3, model=model,
                               plugin=ZeroOffloadPlugin(compute_dtype="fp32", **plugin))
    try:
        return opt.memory_report(), len(opt.buckets)
    finally:
        opt.close()


def test_one_bucket_says_what_was_placed_and_which_bucket_size_comes_closer():
    report, n = _report(offload_fraction=0.5)  # default 32 MiB: the tiny model is one bucket
    assert n == 1 and report["offload_fraction"] == 1.0
    lines = format_report(report).splitlines()
    hint = report["bucket_size_hint_mb"]
    said = [line for line in lines if "asked" in line]
    assert said == [f"  offload_fraction 0.5 asked, 1.000 placed (whole buckets only): "
                    f"bucket_size_mb {hint:.3g} or less comes closer"], lines
    # the hint: a quarter of the smaller side's share of the 16-bit gradient
    n_params = sum(p.numel() for p in tiny_gpt2().parameters())
    assert abs(hint - 0.5 / 4 * n_params * 2 / 2**20) < 1e-3 * hint
    # and following it places within a bucket of what was asked
    closer, n = _report(offload_fraction=0.5, bucket_size_mb=float(f"{hint:.3g}"))
    assert n >= 4 and 0.5 <= closer["offload_fraction"] <= 0.6
    assert "offload_fraction_asked" not in closer


def test_a_placement_close_to_the_ask_says_nothing_more():
    report, _ = _report(offload_fraction=1.0)
    assert "offload_fraction_asked" not in report
    report, _ = _report(offload_fraction=0.0)
    assert report["offload_fraction"] == 0.0 and "offload_fraction_asked" not in report
