"""scripts/gpu_check.sh and the HF_ZOFFLOAD_REQUIRE_GPU switch of tests/conftest.py, checked
where there is no GPU: the script must fail fast there, never pass having tested nothing, and
under the switch a `gpu` test that does not run is a failure, not a skip. The stage machinery
(figures, logs, timeouts, the budget) runs against a fake interpreter that plays each stage.

CUDA_VISIBLE_DEVICES="" hides any GPU from the subprocesses, so this holds on a GPU machine too.
"""

import importlib
import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests._env import cpu_only_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
# A module whose only gpu test is test_gpu_scale_tensors_refresh_without_sync; cheap to collect.
GPU_TEST_FILE = "tests/optim/test_loss_scaler.py"


def _run_script(tmp_path, python):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path,
                          env=cpu_only_env(OUT=str(out), PYTHON=python), capture_output=True,
                          text=True, timeout=60)
    return proc, out


@pytest.mark.slow
def test_gpu_check_fails_fast_without_cuda(tmp_path):
    proc, out = _run_script(tmp_path, sys.executable)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said
    assert "no CUDA device available" in said
    summary = (out / "summary.md").read_text()
    assert "# gpu_check: FAIL" in summary and "no CUDA device available" in summary
    assert "| env | pass |" in summary and "| cuda | fail (exit 1) |" in summary
    assert "no CUDA device available" in (out / "cuda.log").read_text()
    # nothing is built or run once the CUDA check failed
    assert sorted(p.name for p in out.iterdir()) == ["cuda.log", "env.log", "summary.md"]


def test_gpu_check_fails_without_a_python(tmp_path):
    proc, out = _run_script(tmp_path, str(tmp_path / "no-such-python"))
    assert proc.returncode != 0
    assert "no CUDA device available" in proc.stdout + proc.stderr
    assert "| cuda | fail (exit 127) |" in (out / "summary.md").read_text()


def _pytest(tmp_path, args, **env):
    xml = tmp_path / f"report{len(list(tmp_path.glob('report*.xml')))}.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={xml}",
         *args], cwd=ROOT, env=cpu_only_env(**env), capture_output=True, text=True, timeout=120)
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        skipped = case.find("skipped")
        if skipped is not None and skipped.get("type") == "pytest.xfail":
            kinds = ["xfailed"]
        outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    return proc, outcomes


@pytest.mark.slow
def test_require_gpu_turns_the_no_cuda_skip_into_a_failure(tmp_path):
    """A gpu test elsewhere in the suite and the tests/gpu/ checks the stages run, as they run
    them: skipped without CUDA, failures under the switch."""
    nodes = _stage_tests()
    args = [GPU_TEST_FILE, *nodes, "-m", "gpu"]
    proc, outcomes = _pytest(tmp_path, args)
    assert proc.returncode == 0, proc.stdout
    assert outcomes and set(outcomes.values()) == {"skipped"}, outcomes
    assert {n.split("::")[1] for n in nodes} < set(outcomes)

    proc, outcomes = _pytest(tmp_path, args, HF_ZOFFLOAD_REQUIRE_GPU="1")
    assert proc.returncode == 1, proc.stdout
    assert outcomes and set(outcomes.values()) == {"error"}, outcomes  # fails in setup
    assert "HF_ZOFFLOAD_REQUIRE_GPU=1 and no CUDA device is available" in proc.stdout


@pytest.mark.slow
def test_require_gpu_fails_a_gpu_test_that_skips_itself(tmp_path):
    """With CUDA reported present, a skip inside a gpu test (pytest.skip, a skip mark) fails;
    xfail and the skips of tests not marked gpu are left as they are. (Without the switch
    these skips stay skips: the test above.)"""
    (tmp_path / "fake_cuda.py").write_text(
        "import torch\ntorch.cuda.is_available = lambda: True\n")
    probe = tmp_path / "test_probe.py"
    probe.write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.gpu
        def test_gpu_runs():
            pass

        @pytest.mark.gpu
        def test_gpu_skips_itself():
            pytest.skip("no luck")

        @pytest.mark.gpu
        @pytest.mark.skip(reason="marked")
        def test_gpu_skip_mark():
            pass

        @pytest.mark.gpu
        @pytest.mark.xfail(reason="known")
        def test_gpu_xfail():
            assert False

        def test_cpu_skips_itself():
            pytest.skip("fine")
    """))
    # The repo's conftest as a plugin, after the fake (-p loads in order), with its config.
    args = ["-c", "pyproject.toml", "--rootdir", str(ROOT), "-p", "fake_cuda",
            "-p", "tests.conftest", str(probe)]
    pythonpath = os.pathsep.join([str(tmp_path), str(ROOT)])
    proc, outcomes = _pytest(tmp_path, args, HF_ZOFFLOAD_REQUIRE_GPU="1", PYTHONPATH=pythonpath)
    assert proc.returncode == 1, proc.stdout
    assert outcomes == {"test_gpu_runs": "passed", "test_gpu_skips_itself": "failure",
                        "test_gpu_skip_mark": "error", "test_gpu_xfail": "xfailed",
                        "test_cpu_skips_itself": "skipped"}, outcomes
    assert "this gpu test skipped (Skipped: no luck" in proc.stdout


@pytest.mark.slow
def test_gpu_test_figures_are_whole_summary_lines_after_the_report(tmp_path):
    """tests/gpu/conftest.py's ``figures``, as a stage's pytest prints them (-q, captured or
    -s): each line whole, after pytest's progress, those of a failing test too."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(textwrap.dedent("""
        import pytest

        def test_one(figures):
            print("progress", end="")
            figures.extend(["| a | b |", "|---|---|"])

        def test_two(figures):
            figures.append("**went wrong**")
            pytest.fail("no")
    """))
    args = ["-c", "pyproject.toml", "--rootdir", str(ROOT), "-p", "tests.gpu.conftest",
            str(probe)]
    for extra in ([], ["-s"]):
        proc, outcomes = _pytest(tmp_path, [*extra, *args])
        assert outcomes == {"test_one": "passed", "test_two": "failure"}, proc.stdout
        lines = proc.stdout.splitlines()
        figures = [x for x in lines if x.startswith("summary: ")]
        assert figures == ["summary: | a | b |", "summary: |---|---|",
                           "summary: **went wrong**"], proc.stdout
        failures = next(i for i, x in enumerate(lines) if " FAILURES " in x)  # after progress
        assert lines.index(figures[0]) > failures, proc.stdout


# ------------------------------------------------------------- the stage machinery
FAKE_PYTHON = """\
#!/usr/bin/env bash
# Plays each stage of gpu_check.sh without a GPU; FAKE_CALLS: a file that lists every call.
[ -z "${FAKE_CALLS:-}" ] || echo "$*" >>"$FAKE_CALLS"
t="-m pytest -m gpu -q -p no:cacheprovider --basetemp "  # gpu_check.sh's gpu_test
case "$*" in
  -) cat >/dev/null; echo "info gpu: Fake GPU"; echo "info torch: fake";;
  "- "*) cat >/dev/null; echo "summary: $2: variants here generic, native; auto runs native";;
  *setup.py*) echo built;;
  *"-m pytest tests/ops/"*) [ -f tests/ops/test_adam_kernels.py ] || exit 4
    [[ "$*" == *" tests/ops/test_masters.py "* ]] || exit 7  # the bf16 master's kernels too
    [[ "$*" == *" tests/ops/test_adam_undo.py "* ]] || exit 7  # and the undo pass
    echo "298 passed in 6.00s";;
  *"tests/gpu/test_race.py::test_race_under_the_cuda_sanitizer")
    [[ "$*" == *"$t"*"/pytest -s "* ]] || exit 6
    [ -n "${TORCH_CUDA_SANITIZER:-}" ] || exit 3
    [ -z "${FAKE_CSAN:-}" ] || echo "CSAN detected a possible data race on tensor" >&2
    echo "summary: | config | sanitized |";;
  *"$t"*"/pytest tests/gpu/test_race.py::test_race_stress")
    [ -z "${TORCH_CUDA_SANITIZER:-}" ] || exit 3
    echo "."; echo "summary: | config | vs CPU engine |"; echo "summary: | fp16 | equal |"
    echo "1 passed in 9.00s";;
  *"$t"*"/pytest tests/gpu/test_nccl_one_rank.py::"*)
    echo "summary: 7/7 nccl";;
  *"$t"*"/pytest tests/gpu/test_host_memory.py::"*)
    echo "summary: host figures"; echo "host went wrong" >&2; exit 1;;
  *"$t"*"/pytest tests/gpu/test_clm_compare.py::"*)
    echo "summary: clm figures";;
  *"-m pytest tests -m gpu --ignore=tests/gpu "*) echo ".."; echo "24 passed in 51.20s";;
  *bench/gpu_size.py*) echo "summary: size figures, limit ${GPU_CHECK_STAGE_S:-unset} s";;
  *bench/gpu_practicality.py*--json*) echo "summary: practicality figures";;
  *bench/gpu_peers.py*--wheels*--against*) echo "summary: peers figures";;
  *bench_scaling.py*) echo "## bench"; echo "| method | GB/s |"; echo "| ours | 3000 |";;
  *bench_cpu_adam.py*"--sizes 2M "*"--threads 1,2 "*) echo "CPU: fake"; echo "| 2M | 1 | ours |";;
  *bench_cpu_adam.py*"--threads 1,"[0-9]*) echo "CPU: fake"; echo "| path | of ceiling |";;
  *) echo "unexpected: $*" >&2; exit 9;;
esac
"""


def _gpu_check(tmp_path, *args, **env):
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), *args], cwd=tmp_path,
                          env=cpu_only_env(OUT=str(out), PYTHON=str(fake), TMPDIR=str(tmp_path),
                                           **env),
                          capture_output=True, text=True, timeout=120)
    return proc, out


ROW = re.compile(r"^\| (\w+) \| ([^|]+) \| \d+ \| (\d+) \| ([\w.]+) \|$", re.M)


def test_gpu_check_stages_figures_and_at_most_five_files(tmp_path):
    proc, out = _gpu_check(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # host_memory failed
    assert sorted(p.name for p in out.iterdir()) == ["cuda.log", "env.log", "logs.txt",
                                                     "summary.md"]
    summary = (out / "summary.md").read_text()
    rows = ROW.findall(summary)
    assert [r[0] for r in rows] == list(_stage_timeouts())
    assert [r[0] for r in rows] == ["env", "cuda", "build", "kernel_tests", "gpu_tests", "race",
                                    "race_sanitizer", "nccl_one_rank", "host_memory",
                                    "run_clm", "size", "practicality", "peers",
                                    "bench_scaling", "bench_cpu_adam"]
    assert {r[0] for r in rows if r[1] != "pass"} == {"host_memory"}
    assert [r[3] for r in rows][:3] == ["env.log", "cuda.log", "logs.txt"]
    assert "## race\n\n| config | vs CPU engine |\n| fp16 | equal |\n" in summary
    assert "## gpu_tests\n\n24 passed in 51.20s\n" in summary
    # both builds' tests, each headed by the variants it ran (the portable copy's own tests)
    assert ("## kernel_tests\n\nnative build: variants here generic, native; auto runs native"
            "\nnative build: 298 passed in 6.00s\nportable build: variants here generic, "
            "native; auto runs native\nportable build: 298 passed in 6.00s\n"
            "| 2M | 1 | ours |\n") in summary  # the portable build's bench rows
    assert "## size\n\nsize figures, limit 34 s\n" in summary  # GPU_CHECK_STAGE_S
    assert "## practicality\n\npracticality figures\n" in summary
    assert "## peers\n\npeers figures\n" in summary
    assert "## bench_scaling\n\n| method | GB/s |\n| ours | 3000 |\n" in summary
    assert "## bench_cpu_adam\n\n| path | of ceiling |\n" in summary  # table lines only
    assert re.search(r"^- host CPU: .+; \d+ logical CPUs; ", summary, re.M)
    # the host's memory as the engine's host check reads it
    assert re.search(r"^- host memory: MemTotal \d+\.\d GiB, MemAvailable \d+\.\d GiB; "
                     r"(cgroup v[12] .+|no cgroup memory limit file)$", summary, re.M)
    assert "(--only)" not in summary
    assert "## host_memory: fail (exit 1) (last 40 lines of its log)" in summary
    assert "host went wrong" in summary
    logs = (out / "logs.txt").read_text()
    headers = re.findall(r"^===== (\w+): ", logs, re.M)
    assert headers == [r[0] for r in rows][2:]
    assert "===== host_memory: fail (exit 1), " in logs
    assert not list(tmp_path.glob("gpu_check.*"))  # the scratch folder is gone


def test_gpu_check_only_runs_env_cuda_and_the_chosen_stages(tmp_path):
    calls = tmp_path / "calls"
    proc, out = _gpu_check(tmp_path, "--only", "bench_cpu_adam,race", FAKE_CALLS=str(calls))
    assert proc.returncode == 0, proc.stdout + proc.stderr  # host_memory did not run
    summary = (out / "summary.md").read_text()
    assert [r[0] for r in ROW.findall(summary)] == ["env", "cuda", "race", "bench_cpu_adam"]
    assert "- stages: only env, cuda, race, bench_cpu_adam (--only)" in summary
    assert re.findall(r"^===== (\w+): ", (out / "logs.txt").read_text(), re.M) == [
        "race", "bench_cpu_adam"]
    ran = calls.read_text()
    assert "tests/gpu/test_race.py::test_race_stress" in ran and "setup.py" not in ran
    assert "--ignore=tests/gpu" not in ran and "tests/ops/" not in ran  # gpu_tests, kernel_tests
    # a failing chosen stage still fails the run
    proc, out = _gpu_check(tmp_path, "--only=host_memory")
    assert proc.returncode == 1
    assert [r[0] for r in ROW.findall((out / "summary.md").read_text())] == [
        "env", "cuda", "host_memory"]


@pytest.mark.parametrize("args, said", [
    (["--only", "race,nope,build,bogus"], "unknown stage(s) in --only: 'nope' 'bogus'"),
    (["--only", ","], "--only needs at least one stage name"),
    (["--only"], "--only needs a value"),
    (["--fast"], "unknown argument '--fast'"),
])
def test_gpu_check_refuses_bad_arguments_before_anything_runs(tmp_path, args, said):
    calls = tmp_path / "calls"
    proc, out = _gpu_check(tmp_path, *args, FAKE_CALLS=str(calls))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert said in proc.stderr and proc.stdout == ""
    if "unknown stage" in said:  # one error naming every stage
        assert proc.stderr.count("\n") == 1
        assert "the stages: " + ", ".join(_stage_timeouts()) in proc.stderr
    assert not out.exists() and not calls.exists()  # no output, no interpreter started


def test_gpu_check_fails_the_sanitizer_stage_on_a_report(tmp_path):
    proc, out = _gpu_check(tmp_path, FAKE_CSAN="1")
    summary = (out / "summary.md").read_text()
    assert "| race_sanitizer | fail (exit 1) |" in summary
    assert "**the CUDA stream sanitizer reported 1 possible data race(s)**" in summary


def _stage_tests() -> list[str]:
    """The tests of tests/gpu/ that gpu_check.sh's stages name, as pytest node ids."""
    text = (SCRIPTS / "gpu_check.sh").read_text()
    return re.findall(r"\btests/gpu/test_\w+\.py::\w+", text)


def _gpu_marked(fn) -> bool:
    return any(m.name == "gpu" for m in getattr(fn, "pytestmark", []))


def test_stages_name_gpu_tests_that_exist_and_every_one_runs():
    """Each test a stage names is a gpu test of tests/gpu/ (a typo would select none, which
    fails only on the GPU machine), and every gpu test there has its stage."""
    named = _stage_tests()
    assert len(named) == len(set(named)) == 5, named
    for node in named:
        path, name = node.split("::")
        module = importlib.import_module(path[:-len(".py")].replace("/", "."))
        fn = getattr(module, name, None)
        assert fn is not None and _gpu_marked(fn), node
    found = set()
    for path in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        module = importlib.import_module(f"tests.gpu.{path.stem}")
        found |= {f"tests/gpu/{path.name}::{name}" for name, fn in vars(module).items()
                  if name.startswith("test_") and _gpu_marked(fn)}
    assert found == set(named)


def _stage_timeouts() -> dict[str, int]:
    text = (SCRIPTS / "gpu_check.sh").read_text()
    return {m[0]: int(m[1]) for m in re.findall(r"^(?:if ! )?stage (\w+) (\d+) ", text, re.M)}


def test_stage_list_is_the_stage_lines():
    """--only checks names against STAGES before anything runs; it must be the stage lines."""
    text = (SCRIPTS / "gpu_check.sh").read_text()
    listed = re.search(r"^STAGES=\(([^)]*)\)", text, re.M)[1].split()
    assert listed == list(_stage_timeouts())


def test_timeouts_fit_the_budget_and_match_the_docs():
    text = (SCRIPTS / "gpu_check.sh").read_text()
    budget = int(re.search(r'^BUDGET_S="\$\{GPU_CHECK_BUDGET_S:-(\d+)\}"', text, re.M)[1])
    assert budget == 300  # a run, a fix and a second run in 15 minutes of device time
    stages = _stage_timeouts()
    total = sum(stages.values())
    assert total <= budget - 20, stages  # 20 s for the kill grace (5 s) and a slow start
    assert f"sum to {total} s of the {budget} s budget" in text.replace("\n# ", " ")
    gpu = (ROOT / "docs" / "gpu_check.md").read_text()
    table = dict(re.findall(r"^\| `(\w+)` \| (\d+) s \|", gpu, re.M))
    assert {k: int(v) for k, v in table.items()} == stages
    assert list(table) == list(stages)  # in the order they run
    flat = textwrap.dedent(gpu).replace("\n", " ")
    assert f"the timeouts add up to {total} s" in flat
    assert f"within {budget} s (`GPU_CHECK_BUDGET_S`" in flat


def test_kernel_tests_script_needs_its_interpreter_and_scratch(tmp_path):
    env = {k: v for k, v in cpu_only_env().items() if k not in ("PY", "SCRATCH")}
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_kernel_tests.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "PY: the interpreter" in proc.stderr
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu_kernel_tests.sh")], cwd=tmp_path,
                          env={**env, "PY": sys.executable}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "SCRATCH: a scratch folder" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing copied or built


def _stage_argv(name: str) -> list[str]:
    """The arguments a stage line gives its script (continuation lines joined), with the
    script's own variables as gpu_check.sh sets them."""
    text = (SCRIPTS / "gpu_check.sh").read_text().replace("\\\n", " ")
    line = re.search(rf"^stage {name} \d+ \"\$PY\" (\S+) (.*)$", text, re.M)
    return [a.strip('"').replace("$SCRATCH", "/scratch") for a in line[2].split()]


def test_measured_stages_run_fsdp2_offload_with_arguments_their_scripts_take():
    """The size and practicality stages include FSDP2 parameter offload (issue 26), and each
    stage's command line parses with its script's own parser (a typo would show only on the
    GPU machine)."""
    bench = str(SCRIPTS / "bench")
    sys.path.insert(0, bench)
    try:
        import gpu_practicality
        import gpu_size
    finally:
        sys.path.remove(bench)
    size = gpu_size.parse_args(_stage_argv("size"))
    assert size.fsdp2 and size.cap_gib == 9
    practicality = gpu_practicality.parse_args(_stage_argv("practicality"))
    assert practicality.fsdp2 and practicality.fractions == ["0", "0.5", "auto"]
