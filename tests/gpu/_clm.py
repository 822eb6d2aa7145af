"""scripts/run_clm.py --bf16 with --zero_offload against the stock Trainer: the runs and their
comparison, for tests/gpu/test_clm_compare.py.

`run_pair` runs the same command once with and once without ``--zero_offload``, each in its
own process (one after the other, or both at once with ``parallel``) and with the same seed:
``python -m tests.gpu._clm --child RESULT [--no_datasets] -- RUN_CLM_ARGS`` runs run_clm's
``main`` in that process and writes its losses, parameter count, peak device memory
(``torch.cuda.max_memory_allocated()``) and seconds to RESULT (JSON). `compare_runs` passes
when the final logged loss (the mean of the last logging_steps steps) of the two runs is
within ``max_rel`` and both runs' loss fell.

The stock Trainer keeps fp32 weights under bf16 autocast; ZeRO-Offload keeps bf16 weights on
the device and fp32 master weights on the host. The runs therefore differ by bf16 roundings
only, not bitwise.

run_clm.py prepares its data with the ``datasets`` library. Where that is not installed (the
GPU machines of this project), each run replaces run_clm's two data functions, ``load_texts``
and ``tokenize_blocks``, by list-based stand-ins that produce the same blocks for the built-in
corpus (test_clm_compare.py compares them with the real ones); the model, the Trainer and the
engine are run_clm's own. The figures say which path ran.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_zoffload.offload.memory import human
from tests.gpu import _common as common

ROOT = Path(__file__).resolve().parents[2]
RUN_CLM = ROOT / "scripts" / "run_clm.py"
# 12 x (4 x 768^2 attention + 3 x 768 x 2432 MLP) + 2 x 2048 x 768 embeddings and head:
# 98.7M params with run_clm's 2048-entry tokenizer. head_dim is given: LlamaConfig() fixes it
# at 128 from its own defaults, and update_from_string does not recompute it (127M then).
LLAMA_100M = ("hidden_size=768,intermediate_size=2432,num_hidden_layers=12,"
              "num_attention_heads=12,num_key_value_heads=12,head_dim=64,"
              "max_position_embeddings=512")
GROUP_ROWS = 1000  # datasets' Dataset.map(batched=True) default batch size


# ------------------------------------------------------------ data without `datasets`
class Rows(torch.utils.data.Dataset):
    """What run_clm and the Trainer use of a ``datasets.Dataset``: ``len``, rows as dicts,
    a column by name, ``column_names`` and ``select``."""

    def __init__(self, columns: dict[str, list]):
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.columns[key]
        return {name: values[key] for name, values in self.columns.items()}

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    def select(self, indices) -> Rows:
        idx = list(indices)
        return Rows({name: [values[i] for i in idx] for name, values in self.columns.items()})


def load_texts_without_datasets(data) -> dict:
    """run_clm.load_texts for the built-in corpus: the same train / validation split as
    ``train_test_split(test_size=pct / 100, shuffle=False)`` (the test share rounded up)."""
    if data.dataset_name or data.train_file:
        raise SystemExit("--dataset_name / --train_file need the datasets library, "
                         "which is not installed; only the built-in corpus works without it")
    from hf_zoffload.integrations import defaults  # transformers: not for a run without CUDA

    pct = data.validation_split_percentage
    if not 0 < pct < 100:
        raise ValueError(f"--validation_split_percentage must be in 1..99, got {pct}")
    docs = defaults.stdlib_corpus(max_mb=data.corpus_mb)
    n_train = len(docs) - math.ceil(len(docs) * pct / 100)
    return {"train": Rows({data.text_column: docs[:n_train]}),
            "validation": Rows({data.text_column: docs[n_train:]})}


def tokenize_blocks_without_datasets(raw, tokenizer, *, column: str, block_size: int, args):
    """run_clm.tokenize_blocks on `Rows`: documents end with EOS, are joined end to end per
    batch of 1000 documents (as its batched map does) and cut into ``block_size`` blocks."""
    eos = tokenizer.eos_token_id
    out = {}
    for split, rows in raw.items():
        texts = rows[column]
        ids = []
        for i in range(0, len(texts), GROUP_ROWS):
            batch = tokenizer(texts[i:i + GROUP_ROWS], verbose=False)["input_ids"]
            ids += [x + [eos] if eos is not None else x for x in batch]
        blocks = []
        for i in range(0, len(ids), GROUP_ROWS):
            flat = [t for x in ids[i:i + GROUP_ROWS] for t in x]
            n = len(flat) // block_size * block_size
            blocks += [flat[j:j + block_size] for j in range(0, n, block_size)]
        out[split] = Rows({"input_ids": blocks, "labels": [list(b) for b in blocks]})
    return out


def load_run_clm():
    """scripts/run_clm.py as the module ``run_clm`` (loaded from its file once; registered in
    sys.modules first, as an import does: its dataclasses look their module up there).
    Loaded on use: it imports transformers, which the gpu test's own process need not."""
    if "run_clm" not in sys.modules:
        spec = importlib.util.spec_from_file_location("run_clm", RUN_CLM)
        module = importlib.util.module_from_spec(spec)
        sys.modules["run_clm"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["run_clm"]
            raise
    return sys.modules["run_clm"]


def have_datasets() -> bool:
    return importlib.util.find_spec("datasets") is not None


# ------------------------------------------------------------------------ one run
def child(result_path: str, argv: list[str], *, use_datasets: bool) -> None:
    """Run run_clm.main(argv) in this process; write its losses, parameter count, peak
    device memory and seconds to ``result_path`` (JSON). run_clm's functions replaced for
    the run are put back after it (a test runs this in the suite's own process)."""
    run_clm = load_run_clm()
    saved = {name: getattr(run_clm, name)
             for name in ("load_texts", "tokenize_blocks", "build_model")}
    info = {}

    def counting_build_model(*args, **kwargs):
        model = saved["build_model"](*args, **kwargs)
        info["n_params"] = model.num_parameters()
        return model

    if not use_datasets:
        run_clm.load_texts = load_texts_without_datasets
        run_clm.tokenize_blocks = tokenize_blocks_without_datasets
    run_clm.build_model = counting_build_model
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        results = run_clm.main(argv)
    finally:
        for name, fn in saved.items():
            setattr(run_clm, name, fn)
    seconds = time.perf_counter() - t0
    output_dir = argv[argv.index("--output_dir") + 1]
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    with open(result_path, "w") as f:
        json.dump({"losses": [[e["step"], e["loss"]] for e in history if "loss" in e],
                   "train_loss": results.get("train_loss"), "n_params": info.get("n_params"),
                   "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                   "seconds": seconds, "datasets": use_datasets}, f)


def run_clm_args(output_dir: str, *, offload: bool, steps: int, overrides: str,
                 block_size: int, batch: int, lr: float, seed: int, logging_steps: int,
                 bf16: bool = True, extra=()) -> list[str]:
    args = ["--model_type", "llama", "--config_overrides", overrides, "--do_train",
            "--max_steps", str(steps), "--per_device_train_batch_size", str(batch),
            "--block_size", str(block_size), "--learning_rate", str(lr),
            "--warmup_steps", str(max(1, steps // 10)), "--logging_steps", str(logging_steps),
            "--save_strategy", "no", "--report_to", "none", "--seed", str(seed),
            "--dataloader_num_workers", "0", "--disable_tqdm", "true",
            "--output_dir", output_dir, *extra]
    if bf16:
        args.append("--bf16")
    if offload:
        args.append("--zero_offload")
    return args


def child_command(name: str, result: str, *, use_datasets: bool, **kwargs) -> list[str]:
    """The command line of one run (this module with --child)."""
    return [sys.executable, "-m", __name__, "--child", result,
            *(["--no_datasets"] if not use_datasets else []), "--",
            *run_clm_args(os.path.join(os.path.dirname(result), name),
                          offload=name == "zero_offload", **kwargs)]


def child_env() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH: the child imports this module
    (``-m tests.gpu._clm``) and the package from there."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), path]))}


def run_pair(work: str, *, use_datasets: bool, timeout: float, parallel: bool = False,
             **kwargs) -> tuple[dict, list]:
    """Both runs, each in a process of its own (its own peak memory): one after the other, or
    with ``parallel`` both at once, their output then kept in work/NAME.log and printed after
    both ended. Returns ({"stock": result, "zero_offload": result}, failures)."""
    results, failures, started = {}, [], []
    for name in ("stock", "zero_offload"):
        res = os.path.join(work, f"{name}.json")
        cmd = child_command(name, res, use_datasets=use_datasets, **kwargs)
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        log = open(os.path.join(work, f"{name}.log"), "w") if parallel else None
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None,
                                cwd=ROOT, env=child_env())
        started.append((name, proc, res, log, time.monotonic() + timeout))
        if not parallel:
            _finish_run(*started[-1], results, failures)
    if parallel:
        for run in started:
            _finish_run(*run, results, failures)
    return results, failures


def _finish_run(name, proc, res, log, deadline, results, failures) -> None:
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    if log is not None:
        log.close()
        with open(log.name) as f:
            print(f"== {name}'s output\n{f.read()}", flush=True)
    if rc is None:
        failures.append(f"{name}: still running after its timeout")
    elif rc != 0 or not os.path.exists(res):
        failures.append(f"{name}: run_clm exited {rc}")
    else:
        with open(res) as f:
            results[name] = json.load(f)


def compare_runs(stock: dict, offload: dict, *, max_rel: float) -> tuple[list[str], list[str]]:
    """(summary lines, failures): final losses within ``max_rel``, both having fallen."""
    failures = []
    runs = (("stock Trainer --bf16", stock), ("--zero_offload --bf16", offload))
    for name, r in runs:
        if len(r.get("losses") or []) < 2:
            failures.append(f"{name}: fewer than 2 logged losses")
        elif not r["losses"][-1][1] < r["losses"][0][1]:
            failures.append(f"{name}: the loss did not fall ({r['losses'][0][1]:.4f} -> "
                            f"{r['losses'][-1][1]:.4f})")
    if failures:
        return [], failures
    (s_step, s_loss), (o_step, o_loss) = stock["losses"][-1], offload["losses"][-1]
    rel = abs(o_loss - s_loss) / abs(s_loss)
    if s_step != o_step:
        failures.append(f"the runs logged their last loss at steps {s_step} and {o_step}")
    if not rel <= max_rel:
        failures.append(f"final losses {s_loss:.4f} (stock) and {o_loss:.4f} (zero_offload) "
                        f"differ by {rel:.2%}, more than {max_rel:.0%}")

    def mem(r):
        return human(r["peak_bytes"]) if r.get("peak_bytes") is not None else "n/a"

    rows = [[name, f"{(r.get('n_params') or 0) / 1e6:.1f}M", f"{r['losses'][0][1]:.4f}",
             f"{r['losses'][-1][1]:.4f} (step {r['losses'][-1][0]})",
             f"{r['train_loss']:.4f}" if r.get("train_loss") is not None else "n/a",
             mem(r), f"{r['seconds']:.0f}"] for name, r in runs]
    lines = common.md_table(["run", "params", "first logged loss", "final loss",
                             "mean train loss", "peak device memory", "s"], rows)
    ratio = ""
    if stock.get("peak_bytes") and offload.get("peak_bytes"):
        ratio = (f"; peak device memory: zero_offload "
                 f"{offload['peak_bytes'] / stock['peak_bytes']:.2f}x the stock run's")
    data = "datasets" if stock.get("datasets") else "the list-based stand-in (no datasets)"
    lines += ["", f"final losses differ by {rel:.2%} (limit {max_rel:.0%}){ratio}; data "
                  f"prepared by {data}"]
    return lines, failures


def parse_args(argv=None):
    """The child's command line: ``--child RESULT [--no_datasets] -- RUN_CLM_ARGS``."""
    p = argparse.ArgumentParser(prog="python -m tests.gpu._clm",
                                description="one run_clm.py run in this process, its figures "
                                            "written to RESULT_JSON (run_pair starts it)")
    p.add_argument("--child", metavar="RESULT_JSON", required=True)
    p.add_argument("--no_datasets", action="store_true",
                   help="use the stand-in data functions even where datasets is installed")
    p.add_argument("run_clm_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rest = args.run_clm_args[1:] if args.run_clm_args[:1] == ["--"] else args.run_clm_args
    child(args.child, rest, use_datasets=have_datasets() and not args.no_datasets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
