"""The top-level names are what users reach for, each resolving to its object."""

import hf_zoffload


def test_top_level_exports_resolve_and_leave_internals_out():
    from hf_zoffload.integrations.parallel import ParallelismConfig
    from hf_zoffload.offload.memory import estimate, format_report

    assert hf_zoffload.ParallelismConfig is ParallelismConfig
    assert hf_zoffload.estimate is estimate and hf_zoffload.format_report is format_report
    assert "DynamicLossScaler" not in hf_zoffload.__all__
    for name in hf_zoffload.__all__:
        assert getattr(hf_zoffload, name) is not None
    report = hf_zoffload.estimate(n_params=1000, compute_dtype="bf16")
    assert report["host"]["master"] == 4000
    assert "model states for 1,000 trainable parameters" in hf_zoffload.format_report(report)
