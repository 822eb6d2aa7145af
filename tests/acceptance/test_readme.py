"""Every fenced snippet of README.md and of the docs/ pages it links runs here, as written
(issue 15: the snippets cannot drift). A new snippet fails `test_every_snippet_has_a_runner`
until it gets one."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from tests._env import fresh_accelerate_state
from tests._preloaded import Preloaded
from tests._tiny import VOCAB, TokenBlocks, tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def snippets() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [found for page in pages for found in FENCE.findall(page.read_text())]


def _find(lang: str, needle: str) -> str:
    found = [code for kind, code in snippets() if kind == lang and needle in code]
    assert len(found) == 1, f"docs: one {lang} snippet with {needle!r}, found {len(found)}"
    return found[0]


# (language, a text that identifies the snippet) -> the test that runs it
RUNNERS = {("bash", "bash scripts/quickstart.sh"): "test_setup_lines",
           ("bash", "pip install ."): "test_install_snippet",
           ("python", "ZeroOffloadTrainer("): "test_trainer_snippet",
           ("python", "zero_offload=True)\ntrainer = zero_offload_trainer"): "test_trl_snippets",
           ("python", "peft_config=lora"): "test_trl_snippets",
           ("bash", "scripts/run_clm.py"): "test_run_clm_snippet",
           ("diff", "prepare_zero_offload"): "test_accelerate_snippet",
           ("bash", "hf-zoffload config"): "test_commands_snippet",
           ("python", "model_fp32.pt"): "test_plain_loop_snippet",
           ("python", "parallelize_module("): "test_tensor_parallel_snippet",
           ("text", "--params 7B"): "test_estimate_snippet",
           ("text", "--tp_size 8"): "test_estimate_tp_snippet",
           ("text", "--offload_fraction 0.5"): "test_estimate_fraction_snippet",
           ("text", "--fsdp2_offload"): "test_estimate_fsdp2_snippet"}


def test_every_snippet_has_a_runner():
    for lang, code in snippets():
        owners = [t for (k, needle), t in RUNNERS.items() if k == lang and needle in code]
        assert len(owners) == 1, f"README snippet without exactly one runner:\n{code}"


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_ZOFFLOAD_")}
    bindir = os.path.dirname(sys.executable)  # hf-zoffload and python of this environment
    env.update(PATH=bindir + os.pathsep + env.get("PATH", ""), HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


def test_setup_lines():
    """Both lines name scripts the suite runs: quickstart.sh by test_quickstart.py (set-up
    skipped), test.sh being what runs this suite; the set-up says what it installs."""
    code = _find("bash", "bash scripts/quickstart.sh")
    for line in code.strip().splitlines():
        script = ROOT / line.split()[1]
        assert script.is_file(), line
    # the quick tier is named first (issue 35): the whole suite takes minutes more
    assert "bash scripts/test.sh --fast" in code
    setup = (ROOT / "scripts" / "_setup_env.sh").read_text().splitlines()
    installs = [i for i, line in enumerate(setup) if "pip install" in line]
    assert installs
    for i in installs:  # each quiet pip step is announced on the line before it
        assert setup[i - 1].lstrip().startswith('echo "[setup'), setup[i - 1]


@pytest.mark.slow
def test_install_snippet(tmp_path):
    """The install lines as written, in a new venv that sees this environment's packages
    (PYTHONPATH: torch and the dependencies are found, not downloaded again), on a copy of
    the repository: the package lands in the new venv, its kernel compiled, and imports from
    there."""
    import shutil
    import site

    code = _find("bash", "pip install .")
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "outputs", "*.so", "*.egg-info", "__pycache__", "wheels"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(site.getsitepackages()), PIP_NO_INPUT="1")
    for line in code.strip().splitlines():
        command = line.split("#")[0].strip()
        proc = subprocess.run(command, shell=True, cwd=repo, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import hf_zoffload.ops._native as n; n.ext(); "
         "print(n.__file__)"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    assert str(venv) in where.stdout, where.stdout  # the installed copy, not the checkout


@pytest.fixture
def fresh_accelerate(monkeypatch):
    with fresh_accelerate_state(monkeypatch):
        yield


def test_trainer_snippet(tmp_path, monkeypatch, fresh_accelerate):
    monkeypatch.chdir(tmp_path)
    scope = {"model": tiny_gpt2(), "train_ds": TokenBlocks(8, vocab=VOCAB, seq=16)}
    exec(_find("python", "ZeroOffloadTrainer("), scope)
    trainer = scope["trainer"]
    assert trainer.engine is not None and trainer.state.global_step == 3
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _trl_scope():
    pytest.importorskip("trl")
    from peft import LoraConfig

    from tests.integrations.test_trl import WORDS, llama, tokenizer

    datasets = pytest.importorskip("datasets")
    texts = [" ".join(WORDS[i:i + 6]) for i in range(8)]
    return {"model": llama(), "tokenizer": tokenizer(),
            "ds": datasets.Dataset.from_dict({"text": texts}),
            "lora": LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0)}


@pytest.mark.parametrize("needle", ["zero_offload=True)\ntrainer = zero_offload_trainer",
                                    "peft_config=lora"], ids=["readme", "usage"])
def test_trl_snippets(tmp_path, monkeypatch, fresh_accelerate, needle):
    """The README's and docs/usage.md's TRL lines, as written (trl's default bf16=True on a
    machine without a GPU: use_cpu added as the runner's own setting)."""
    monkeypatch.chdir(tmp_path)
    code = _find("python", needle).replace('output_dir="out",', 'output_dir="out", '
                                           'use_cpu=True, max_steps=2, report_to=[],')
    scope = _trl_scope()
    exec(code, scope)
    trainer = scope["trainer"]
    if "trainer.train()" not in code:
        trainer.train()
    assert trainer.engine is not None and trainer.state.global_step == 2


def test_plain_loop_snippet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    batches = [{"input_ids": b["input_ids"][None], "labels": b["labels"][None]}
               for b in TokenBlocks(3, vocab=VOCAB, seq=16)]
    scope = {"model": tiny_gpt2(), "loader": batches}
    exec(_find("python", "model_fp32.pt"), scope)
    saved = torch.load(tmp_path / "model_fp32.pt", weights_only=True)
    assert saved["transformer.wte.weight"].dtype == torch.float32
    assert scope["opt"].applied_steps == 3


def test_accelerate_snippet(fresh_accelerate):
    diff = _find("diff", "prepare_zero_offload")
    code = "\n".join(line[1:] for line in diff.splitlines() if not line.startswith("-"))
    data = TokenBlocks(8, vocab=VOCAB, seq=16)
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    scope = {"torch": torch, "model": tiny_gpt2(), "loader": loader}
    exec(code, scope)
    engine = scope["optimizer"].optimizer
    assert engine.plugin.compute_dtype == "fp32"  # accelerate's mixed_precision "no"
    assert engine.applied_steps == 2  # 4 batches, 2 per step


@pytest.mark.slow
def test_run_clm_snippet(tmp_path):
    """The two run_clm.py lines as printed (for a CPU machine; on a GPU with the README's
    change), with options that make them small and quick appended (later options win). Both
    fork from
    one server that imported run_clm (tests/_preloaded.py; `python scripts/run_clm.py` as a
    fresh process: tests/acceptance/test_run_clm.py)."""
    from hf_zoffload.integrations.defaults import stdlib_corpus

    docs = stdlib_corpus(max_mb=0.1)
    (tmp_path / "train.txt").write_text("\n".join(docs[:-2]))
    (tmp_path / "valid.txt").write_text("\n".join(docs[-2:]))
    code = _find("bash", "scripts/run_clm.py").replace("\\\n", " ")
    small = ["--block_size", "32", "--max_eval_samples", "8", "--report_to", "none",
             "--disable_tqdm", "true", "--vocab_size", "300"]
    lines = code.strip().splitlines()
    assert len(lines) == 2
    with Preloaded(ROOT / "scripts" / "run_clm.py", _env(tmp_path),
                   "import datasets; from transformers import GPT2LMHeadModel") as server:
        for i, line in enumerate(lines):
            argv = line.split()
            assert argv[:2] == ["python", "scripts/run_clm.py"]
            extra = small + (["--config_overrides", "n_layer=2,n_embd=32,n_head=2",
                              "--max_steps", "3", "--max_train_samples", "64",
                              "--save_strategy", "no"] if i == 0 else [])
            # as printed on a CPU machine (issue 35): no --bf16, a --max_steps, no pinning,
            # no tokenizer folder to have made first
            assert "--bf16" not in argv and "--tokenizer_name" not in argv
            assert " ".join(argv[-2:]) == "--dataloader_pin_memory false"
            assert i == 1 or "--max_steps" in argv
            if torch.cuda.is_available():
                argv = [*argv[:-2], "--bf16"]  # what the README says to change on a GPU
            log = tmp_path / f"line{i}.log"
            rc = server.start([*argv[2:], *extra], out=log, cwd=tmp_path).wait(timeout=400)
            assert rc == 0, log.read_text()[-5000:]
            assert "perplexity" in log.read_text()
    assert (tmp_path / "eval_out" / "eval_results.json").is_file()


@pytest.mark.slow
def test_commands_snippet(tmp_path):
    code = _find("bash", "hf-zoffload config")
    env = _env(tmp_path, CUDA_VISIBLE_DEVICES="")
    for line in code.strip().splitlines():
        command = line.split("#")[0].strip()
        proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=400)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-3000:])
        if command.startswith("hf-zoffload launch"):
            assert "ZeRO-Offload enabled; settings from" in proc.stderr
            assert '"zero_offload": true' in proc.stdout
        if command == "hf-zoffload env":
            assert "default_config_zoffload.yaml\n" in proc.stdout
            assert "on/off under `hf-zoffload launch` (it exports HF_ZOFFLOAD_ENABLED=true" \
                in proc.stdout


def test_tensor_parallel_snippet(tmp_path):
    """Run as written on a one-process gloo group, "cuda" read as "cpu" (no GPU here; the
    tensor-parallel runs themselves are tests/offload/test_tensor_parallel.py)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    code = _find("python", "parallelize_module(").replace('"cuda"', '"cpu"')
    from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        scope = dict(tp=1, model=model, plan={"0": ColwiseParallel(), "2": RowwiseParallel()},
                     init_device_mesh=init_device_mesh, parallelize_module=parallelize_module,
                     ZeroOffloadOptimizer=ZeroOffloadOptimizer,
                     ZeroOffloadPlugin=ZeroOffloadPlugin)
        exec(code, scope)
        opt = scope["opt"]
        assert isinstance(model[0].weight, DTensor) and model[0].weight.dtype == torch.bfloat16
        model(torch.randn(3, 8, dtype=torch.bfloat16)).float().square().mean().backward()
        before = model[2].weight.full_tensor().clone()
        opt.step()
        assert not torch.equal(model[2].weight.full_tensor(), before)
    finally:
        dist.destroy_process_group()


def test_estimate_snippet(tmp_path, monkeypatch, capsys):
    _run_estimate_snippet(tmp_path, monkeypatch, capsys, "--params 7B")


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.24"),
                    reason=f"transformers {transformers.__version__}: the snippet's figures are "
                           "5.24's; 5.17's Llama tp plan leaves lm_head replicated (1.05B more "
                           "params per rank)")
def test_estimate_tp_snippet(tmp_path, monkeypatch, capsys):
    _run_estimate_snippet(tmp_path, monkeypatch, capsys, "--tp_size 8")


def test_estimate_fraction_snippet(tmp_path, monkeypatch, capsys):
    _run_estimate_snippet(tmp_path, monkeypatch, capsys, "--offload_fraction 0.5")


def test_estimate_fsdp2_snippet(tmp_path, monkeypatch, capsys):
    _run_estimate_snippet(tmp_path, monkeypatch, capsys, "--fsdp2_offload")


def _run_estimate_snippet(tmp_path, monkeypatch, capsys, needle):
    """The command as shown, through the function the installed `hf-zoffload` runs, in this
    process (the executable itself: test_commands_snippet), with no accelerate config and no
    HF_ZOFFLOAD_* of the caller's; every line shown after "..." is in its output."""
    from importlib.metadata import entry_points

    from accelerate.commands.config import config_args

    code = _find("text", needle)
    command, shown = code.splitlines()[0].removeprefix("$ "), code.split("...\n", 1)[1]
    program, *argv = command.split()
    scripts = entry_points(group="console_scripts", name=program)
    assert len({ep.value for ep in scripts}) == 1, (program, scripts)  # one installed meaning
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "none.yaml"))
    assert next(iter(scripts)).load()(argv) == 0
    out = capsys.readouterr().out
    for line in shown.strip().splitlines():
        assert line in out.splitlines(), line
