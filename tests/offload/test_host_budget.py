"""The host-memory check before the engine allocates: what it needs, what this process can
get (MemAvailable, the cgroup limit, processes per node), and one clear error."""

from types import SimpleNamespace

import pytest
import torch

from hf_zoffload.offload.layout import Slot, build_layouts
from hf_zoffload.offload.memory import check_host_memory, host_available, host_needed

GIB = 2**30


def _layouts(n_params=10_000_000, bucket=2_000_000, world=1, align=1):
    slots = [Slot(None, i, 0, 0, 1_000_000) for i in range(n_params // 1_000_000)]
    return build_layouts(slots, bucket_numel=bucket, world=world, align=align)


def _plugin(state="fp32", limit=0, delayed=False, master="fp32"):
    return SimpleNamespace(state_dtype=state, host_memory_limit_bytes=limit,
                           delayed_update=delayed, master_dtype=master)


@pytest.mark.parametrize("state,per_param,master", [
    ("fp32", 14, "fp32"), ("bf16", 10, "fp32"), ("int8", 8 + 1 / 32, "fp32"),
    ("int4", 7 + 1 / 16, "fp32"), ("int8", 6 + 1 / 32, "bf16"), ("int4", 5 + 1 / 16, "bf16")])
def test_needed_bytes_per_mode(state, per_param, master):
    align = {"int8": 256, "int4": 128}.get(state, 1)
    need = host_needed(_layouts(align=align), param_dtype=torch.bfloat16, state_dtype=state,
                       delayed_update=False, pinned=False, master_dtype=master)
    total = sum(need.values())  # scales included: 2 x 4 B per block of 256 / 128
    assert per_param * 10_000_000 <= total <= per_param * 10_000_000 * 1.001
    delayed = host_needed(_layouts(), param_dtype=torch.bfloat16, state_dtype="fp32",
                          delayed_update=True, pinned=False)
    assert delayed["grad_staging"] == 2 * 2 * 10_000_000  # the second set of landing buffers


def _fake_system(tmp_path, *, avail_kib, limit=None, used=None):
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    proc.mkdir(parents=True)
    cg.mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {avail_kib} kB\n")
    if limit is not None:
        (cg / "memory.max").write_text(f"{limit}\n")
        (cg / "memory.current").write_text(f"{used}\n")
    return dict(proc=str(proc), cgroup=str(cg))


def test_available_takes_the_smaller_of_meminfo_and_cgroup_per_process(tmp_path):
    paths = _fake_system(tmp_path, avail_kib=64 * 2**20, limit=40 * GIB, used=8 * GIB)
    have, why = host_available(environ={"LOCAL_WORLD_SIZE": "2"}, **paths)
    assert have == 16 * GIB and "cgroup limit 40.00 GiB" in why and "2 process" in why
    paths = _fake_system(tmp_path / "b", avail_kib=8 * 2**20, limit="max", used=1)
    assert host_available(environ={}, **paths)[0] == 8 * GIB  # no cgroup limit: "max"


def test_too_little_memory_is_one_error_naming_bytes_and_what_fits():
    lay = _layouts(align=256)
    with pytest.raises(MemoryError) as err:
        check_host_memory(lay, param_dtype=torch.bfloat16, plugin=_plugin("fp32"), pinned=False,
                          world=1, available=(110_000_000, "test"))
    text = str(err.value)
    assert "needs 133.54 MiB" in text and "104.90 MiB is available (test)" in text
    assert "state_dtype=int8" in text and "state_dtype=bf16" in text  # both fit
    assert "about 2 data-parallel ranks" in text and "Nothing was allocated" in text
    # an explicit limit wins over what is detected
    with pytest.raises(MemoryError, match=r"available \(host_memory_limit\)"):
        check_host_memory(lay, param_dtype=torch.bfloat16, plugin=_plugin(limit=GIB // 16),
                          pinned=False, world=1, available=(100 * GIB, "test"))
    need = check_host_memory(lay, param_dtype=torch.bfloat16, plugin=_plugin("int8"),
                             pinned=False, world=1, available=(110_000_000, "test"))
    assert sum(need.values()) <= 110_000_000


def test_a_passing_check_logs_one_line_with_its_figures(caplog):
    lay = _layouts(align=256)
    caplog.set_level("INFO", logger="hf_zoffload.offload.memory")
    check_host_memory(lay, param_dtype=torch.bfloat16, plugin=_plugin("fp32"), pinned=False,
                      world=1, available=(200_000_000, "MemAvailable 190.73 MiB"))
    check_host_memory(lay, param_dtype=torch.bfloat16, plugin=_plugin("fp32", limit=GIB),
                      pinned=False, world=1, available=(100 * GIB, "MemAvailable 100.00 GiB"))
    check_host_memory(lay, param_dtype=torch.bfloat16, plugin=_plugin("fp32"), pinned=False,
                      world=1, available=(None, "no /proc/meminfo or cgroup limit to read"))
    assert [r.getMessage() for r in caplog.records] == [
        "ZeRO-Offload host memory check passed: 133.54 MiB needed on this rank, 190.73 MiB "
        "available (MemAvailable 190.73 MiB), no host_memory_limit set",
        "ZeRO-Offload host memory check passed: 133.54 MiB needed on this rank, 100.00 GiB "
        "available (MemAvailable 100.00 GiB), limit host_memory_limit=1.00 GiB",
        "ZeRO-Offload host memory check skipped: 133.54 MiB needed on this rank, unknown "
        "available (no /proc/meminfo or cgroup limit to read), no host_memory_limit set"]


def test_engine_refuses_before_touching_the_params():
    from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin

    model = torch.nn.Linear(1000, 1000)
    before = model.weight.detach().clone()
    with pytest.raises(MemoryError, match=r"needs 13.36 MiB .* 1.00 MiB is available "
                                          r"\(host_memory_limit\)"):
        ZeroOffloadOptimizer(model.parameters(), plugin=ZeroOffloadPlugin(
            compute_dtype="bf16", host_memory_limit="1MiB"))
    assert model.weight.dtype == torch.float32 and torch.equal(model.weight, before)
    with pytest.raises(ValueError, match="host_memory_limit.*expected a number with a unit"):
        ZeroOffloadPlugin(host_memory_limit="48")
    assert ZeroOffloadPlugin(host_memory_limit="48GiB").host_memory_limit_bytes == 48 * GIB
    assert ZeroOffloadPlugin().host_memory_limit_bytes == 0
    env = {"HF_ZOFFLOAD_HOST_MEMORY_LIMIT": "64GB"}  # one name end to end
    assert ZeroOffloadPlugin.from_sources(environ=env).host_memory_limit_bytes == 64 * 10**9
