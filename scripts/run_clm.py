#!/usr/bin/env python
"""Train or fine-tune a causal language model with the Hugging Face Trainer; add
--zero_offload to keep the fp32 master weights and Adam state in host memory.

Runs offline on local files. With no model, config or data given it trains a small GPT-2
from scratch on the Python standard library's own sources, with a tokenizer built from them.
Reports train loss, eval loss and perplexity, and saves the model to --output_dir.
With --tp_size N (and --zero_offload) the model is tensor parallel over N ranks of the
launch (torchrun, accelerate launch), data parallel over the rest.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field

# Runnable from a checkout without installing: scripts/.. is the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_zoffload.commands.errors import TRACEBACK_ENV, run_command  # noqa: E402
from hf_zoffload.integrations import defaults, parallel  # noqa: E402
from hf_zoffload.integrations.trainer import (  # noqa: E402
    ZeroOffloadTrainer,
    ZeroOffloadTrainingArguments,
    check_argv,
)

logger = logging.getLogger("run_clm")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Local directory of a pretrained model to fine-tune. Unset: train from scratch."})
    config_name: str | None = field(default=None, metadata={
        "help": "Local config (directory or config.json) to train from scratch."})
    model_type: str | None = field(default=None, metadata={
        "help": "Model type to train from scratch with its default config, e.g. gpt2, llama."})
    config_overrides: str | None = field(default=None, metadata={
        "help": "Comma-separated config changes for training from scratch, e.g. "
                "'n_layer=2,n_embd=64'."})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "Local tokenizer directory. Unset: the model's, or one trained on the data."})
    vocab_size: int = field(default=2048, metadata={
        "help": "Vocabulary size of a tokenizer trained on the data."})
    tp_size: int = field(default=1, metadata={
        "help": "Tensor-parallel ranks (needs --zero_offload and a model with a transformers "
                "tensor-parallel plan, e.g. llama); the launch's other ranks are data "
                "parallel. A pretrained model is loaded sharded when every rank is tensor "
                "parallel, else whole on every rank; one trained from scratch is built whole "
                "with the same seed on every rank. The Trainer shards what is whole."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={
        "help": "A local dataset directory or script for datasets.load_dataset."})
    dataset_config_name: str | None = field(default=None, metadata={
        "help": "The dataset configuration name."})
    train_file: str | None = field(default=None, metadata={
        "help": "Training data: a local .txt, .json/.jsonl (text column) or .csv file."})
    validation_file: str | None = field(default=None, metadata={
        "help": "Evaluation data, same formats. Unset: a split of the training data. Alone "
                "(no --train_file) it is enough for an evaluation-only run (--do_eval)."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    block_size: int | None = field(default=None, metadata={
        "help": "Tokens per training example, at most the model's positions. Default: 64 "
                "for the built-in model, else the smallest of 1024, the tokenizer's limit and "
                "the model's positions."})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Keep at most this many training blocks (for quick runs)."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Keep at most this many evaluation blocks."})
    validation_split_percentage: int = field(default=5, metadata={
        "help": "Percent of the training data held out for evaluation when no validation "
                "file is given."})
    corpus_mb: float = field(default=1.0, metadata={
        "help": "Size of the built-in standard-library corpus in MB."})


def check_sources(margs: ModelArguments, data: DataArguments, *, do_train: bool = True) -> None:
    """Options that would be ignored next to another one raise, before any work."""
    clashes = [
        (data.dataset_name and (data.train_file or data.validation_file),
         "--dataset_name with --train_file/--validation_file: give one data source"),
        (do_train and data.validation_file and not data.train_file,
         "--do_train with --validation_file needs --train_file (an evaluation-only run, "
         "--do_eval without --do_train, needs only --validation_file)"),
        (margs.model_name_or_path and (margs.config_name or margs.model_type
                                       or margs.config_overrides),
         "--model_name_or_path with --config_name/--model_type/--config_overrides: a "
         "pretrained model brings its own config"),
        (margs.config_name and margs.model_type,
         "--config_name with --model_type: give one"),
    ]
    for bad, message in clashes:
        if bad:
            raise ValueError(message)


DATA_KINDS = {"txt": "text", "json": "json", "jsonl": "json", "csv": "csv"}


def _hub_id(value: str) -> bool:
    """Whether ``value`` can be a hub repository id ('name' or 'org/name')."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def check_paths(margs: ModelArguments, data: DataArguments) -> None:
    """Local paths exist and are what their option reads, and data files are of a kind
    load_texts reads, before anything loads: a missing or mistyped path would otherwise go to
    the hub (34-53 s of retries offline, then a connection error). A value that is no local
    path and can be a hub id ('gpt2', 'org/name') is left to the hub."""
    dirs = [("--model_name_or_path", margs.model_name_or_path, "config.json"),
            ("--tokenizer_name", margs.tokenizer_name, None),
            ("--config_name", margs.config_name, "config.json"),
            ("--dataset_name", data.dataset_name, None)]
    for option, value, needs in dirs:
        if value is None:
            continue
        if os.path.exists(value):
            if option == "--config_name" and os.path.isfile(value) and value.endswith(".json"):
                continue
            if not os.path.isdir(value) and option != "--dataset_name":  # a loading script
                raise NotADirectoryError(f"{option} {value}: a file; expected a directory")
            if needs and not os.path.isfile(os.path.join(value, needs)):
                raise FileNotFoundError(f"{option} {value}: no {needs} in that directory")
            continue
        local = not _hub_id(value) or value.endswith((".json", ".py")) or \
            value.startswith((".", "~", os.sep))
        if local:
            raise FileNotFoundError(
                f"{option} {value}: no such file or directory (a local path must exist; a "
                "hub id is 'name' or 'org/name')")
    files = [(o, v) for o, v in (("--train_file", data.train_file),
                                 ("--validation_file", data.validation_file)) if v]
    kinds = set()
    for option, value in files:
        ext = value.rsplit(".", 1)[-1].lower() if "." in os.path.basename(value) else ""
        if ext not in DATA_KINDS:
            raise ValueError(f"{option} {value}: unsupported extension "
                             f"{'.' + ext if ext else '(none)'}; allowed: "
                             f"{', '.join('.' + k for k in DATA_KINDS)}")
        if not os.path.isfile(value):
            raise FileNotFoundError(f"{option} {value}: no such file")
        kinds.add(DATA_KINDS[ext])
    if len(kinds) > 1:
        raise ValueError(f"--train_file and --validation_file of different kinds "
                         f"({', '.join(v for _, v in files)}): give both as one of "
                         f"{', '.join('.' + k for k in DATA_KINDS)}")


def check_fsdp(args) -> None:
    """``--fsdp`` outside a distributed launch: transformers refuses it when the Trainer is
    built, after the data was tokenized and the model built; refused here, before any work."""
    from transformers.training_args import ParallelMode

    if args.fsdp and args.parallel_mode != ParallelMode.DISTRIBUTED:
        raise ValueError("--fsdp needs a distributed launch (transformers refuses FSDP in a "
                         "process that is not one): torchrun --nproc_per_node N "
                         "scripts/run_clm.py ... (N = 1 works too), or accelerate launch")


def cpu_launch(argv, env, accelerator) -> bool:
    """True when this is a launched process (torchrun sets WORLD_SIZE and LOCAL_RANK) on a
    machine with no accelerator, without --use_cpu: accelerate then sets up no process group
    (it starts its multi-CPU one only when told cpu=True), so every rank would train the
    same batches alone and log and save each, and one launched process would not count as
    distributed (--fsdp refused). ``--use_cpu`` must then be added."""
    if accelerator is not None or "WORLD_SIZE" not in env or "LOCAL_RANK" not in env:
        return False
    if env.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return False  # accelerate launch --cpu: the Trainer reads it too
    return not any(a == "--use_cpu" or a.startswith("--use_cpu=") for a in argv)


def tensor_parallel(margs: ModelArguments, args) -> int:
    """Set ``args.parallelism_config`` for ``--tp_size`` (data parallel over the other
    ranks); returns the data-parallel size. Conflicting options raise."""
    from accelerate import ParallelismConfig

    tp = margs.tp_size
    if tp < 1:
        raise ValueError(f"--tp_size must be >= 1, got {tp}")
    if tp == 1:
        return 1  # not used: no sharded loading
    if not args.zero_offload:
        raise ValueError("--tp_size needs --zero_offload (the offload Trainer shards the model "
                         "and trains its shards)")
    if args.parallelism_config is not None:
        raise ValueError("--tp_size and --parallelism_config both set: give one")
    launched = os.environ.get("PARALLELISM_CONFIG_TP_SIZE")
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true" and \
            launched not in (None, str(tp)):
        raise ValueError(f"--tp_size {tp} conflicts with accelerate launch's "
                         f"--parallelism_config_tp_size {launched}: give one")
    world = args.world_size
    if world % tp:
        raise ValueError(f"--tp_size {tp} does not divide the {world} launched processes")
    args.parallelism_config = ParallelismConfig(tp_size=tp, dp_shard_size=world // tp)
    return world // tp


def load_texts(data: DataArguments):
    """A DatasetDict with 'train' and 'validation' splits of raw text."""
    from datasets import Dataset, DatasetDict, load_dataset

    if data.dataset_name:
        raw = load_dataset(data.dataset_name, data.dataset_config_name)
    elif data.train_file or data.validation_file:
        files = {"train": data.train_file} if data.train_file else {}
        if data.validation_file:
            files["validation"] = data.validation_file
        kind = DATA_KINDS[(data.train_file or data.validation_file).rsplit(".", 1)[-1].lower()]
        raw = load_dataset(kind, data_files=files, keep_linebreaks=True) if kind == "text" \
            else load_dataset(kind, data_files=files)
    else:
        raw = DatasetDict(train=Dataset.from_dict(
            {data.text_column: defaults.stdlib_corpus(max_mb=data.corpus_mb)}))
    if "train" not in raw:  # evaluation only (check_sources allowed it)
        names = ("validation",)
    elif "validation" not in raw:
        pct = data.validation_split_percentage
        if not 0 < pct < 100:
            raise ValueError(f"--validation_split_percentage must be in 1..99, got {pct}")
        split = raw["train"].train_test_split(test_size=pct / 100, shuffle=False)
        raw = DatasetDict(train=split["train"], validation=split["test"])
        names = ("train", "validation")
    else:
        names = ("train", "validation")
    for name in names:
        if data.text_column not in raw[name].column_names:
            raise ValueError(f"{name} data has no {data.text_column!r} column (columns: "
                             f"{raw[name].column_names}); set --text_column")
    return raw


def model_config(margs: ModelArguments):
    """The config a model from scratch gets (None: the built-in default), or a pretrained
    model's own, read without its weights; unknown types and overrides fail here."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if margs.model_name_or_path:
        return AutoConfig.from_pretrained(margs.model_name_or_path)
    if margs.config_name:
        config = AutoConfig.from_pretrained(margs.config_name)
    elif margs.model_type:
        if margs.model_type not in CONFIG_MAPPING:
            raise ValueError(f"unknown --model_type {margs.model_type!r}")
        config = CONFIG_MAPPING[margs.model_type]()
    else:
        return None
    if margs.config_overrides:
        config.update_from_string(margs.config_overrides)
    return config


def choose_block_size(requested: int | None, config, tokenizer_max: int) -> int:
    """``--block_size``, or 64 for the built-in model (config None), else the smallest of
    1024, the tokenizer's limit and the model's positions; a block longer than the model's
    positions raises (the position embedding would index past its end)."""
    if requested is not None and requested < 1:
        raise ValueError(f"--block_size must be >= 1, got {requested}")
    if config is None:
        return requested or 64
    n_pos = getattr(config, "n_positions", None) or \
        getattr(config, "max_position_embeddings", None)
    if requested is None:
        return min(1024, tokenizer_max, n_pos or 1024)
    if n_pos and requested > n_pos:
        raise ValueError(f"--block_size {requested} exceeds the model's {n_pos} positions: "
                         f"give --block_size {n_pos} or less")
    return requested


def build_model(margs: ModelArguments, config, tokenizer, block_size: int, *, dp: int = 1):
    from transformers import AutoModelForCausalLM, DistributedConfig

    if margs.model_name_or_path:
        # every rank tensor parallel: each reads its shards (transformers' sharded loading);
        # with data-parallel ranks too that would need FSDP, so the model loads whole and
        # the Trainer shards it
        kw = {"distributed_config": DistributedConfig(tp_size=margs.tp_size)} \
            if margs.tp_size > 1 and dp == 1 else {}
        return _causal_loss(AutoModelForCausalLM.from_pretrained(margs.model_name_or_path, **kw))
    if config is None:
        config = defaults.default_config(vocab_size=len(tokenizer), block_size=block_size,
                                         eos_token_id=tokenizer.eos_token_id)
    config.vocab_size = len(tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tokenizer, name, None) is not None:
            setattr(config, name, getattr(tokenizer, name))
    logger.info("training a new %s model from scratch", config.model_type)
    return _causal_loss(AutoModelForCausalLM.from_config(config))


def _causal_loss(model):
    # transformers infers loss_type from the class name, so GPT2LMHeadModel gets None: it then
    # warns and falls back to the causal-LM loss anyway, but the Trainer counts the loss's
    # tokens over all labels instead of the shifted ones (64 instead of 63 per block). Naming
    # the loss it already uses fixes both.
    if getattr(model, "loss_type", "set") is None:
        model.loss_type = "ForCausalLM"
    return model


def tokenize_blocks(raw, tokenizer, *, column: str, block_size: int, args):
    """Tokenize, join each split end to end and cut it into ``block_size`` examples."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        # verbose=False: documents longer than the model are fine here, they are cut below
        ids = tokenizer(batch[column], verbose=False)["input_ids"]
        return {"input_ids": [x + [eos] if eos is not None else x for x in ids]}

    def group(batch):
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // block_size * block_size  # the tail shorter than a block is dropped
        blocks = [flat[i:i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    with args.main_process_first(desc="tokenizing"):
        columns = next(iter(raw.values())).column_names
        ids = raw.map(tokenize, batched=True, remove_columns=columns, desc="tokenizing")
        return ids.map(group, batched=True, batch_size=1000, desc=f"blocks of {block_size}")


def main(argv=None) -> dict:
    from transformers import AutoTokenizer, HfArgumentParser, default_data_collator, set_seed

    parser = HfArgumentParser((ModelArguments, DataArguments, ZeroOffloadTrainingArguments),
                              description=__doc__.split("\n\n")[0].replace("\n", " "),
                              epilog=f"A bad setting, missing file or unknown model type is "
                                     f"one line and exit status 2; {TRACEBACK_ENV}=1 shows its "
                                     f"traceback.")
    argv = sys.argv[1:] if argv is None else argv
    check_argv(argv)  # an unknown --zero_offload_<name>: one line naming the closest
    import torch

    from_file = len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml"))
    add_cpu = cpu_launch([] if from_file else argv, os.environ,
                         torch.accelerator.current_accelerator())
    if from_file:
        with open(argv[0]) as f:
            if argv[0].endswith(".json"):
                import json

                settings = json.load(f)
            else:
                import yaml

                settings = yaml.safe_load(f)
        if add_cpu and "use_cpu" in settings:
            add_cpu = False  # the file chose
        margs, data, args = parser.parse_dict(dict(settings, **({"use_cpu": True} if add_cpu
                                                                else {})))
    else:
        margs, data, args = parser.parse_args_into_dataclasses(
            args=[*argv, "--use_cpu"] if add_cpu else argv)

    check_sources(margs, data, do_train=args.do_train)
    check_paths(margs, data)  # before anything loads: nothing goes to the hub by mistake
    check_fsdp(args)
    config = model_config(margs)  # unknown types, bad overrides: before any data or model
    if data.block_size is not None:
        choose_block_size(data.block_size, config, data.block_size)  # too long: refused now
    dp = tensor_parallel(margs, args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", level=logging.WARNING, stream=sys.stdout)
    level = logging.INFO if args.should_log else logging.WARNING
    for name in ("run_clm", "hf_zoffload"):
        logging.getLogger(name).setLevel(level)
    if add_cpu:
        logger.info("%s launched processes and no GPU: added --use_cpu (without it accelerate "
                    "sets up no process group and each rank trains alone)",
                    os.environ["WORLD_SIZE"])
    set_seed(args.seed)

    raw = load_texts(data)
    if args.do_eval and not data.validation_file and not data.dataset_name:
        logger.info("--do_eval without --validation_file: evaluating on the last %d%% of %s, "
                    "held out of training", data.validation_split_percentage,
                    data.train_file or "the built-in standard-library corpus")
    tok_source = margs.tokenizer_name or margs.model_name_or_path
    if tok_source:
        tokenizer = AutoTokenizer.from_pretrained(tok_source)
    else:
        logger.info("training a byte-level BPE tokenizer (%d entries) on the training text",
                    margs.vocab_size)
        texts = raw["train" if "train" in raw else "validation"][data.text_column]
        tokenizer = defaults.train_tokenizer(texts, vocab_size=margs.vocab_size)
    block_size = choose_block_size(data.block_size, config, tokenizer.model_max_length)
    # every rank builds the same weights, whatever ran since the first seeding (a tensor-
    # parallel rank keeps its part of its own copy)
    set_seed(args.seed)
    model = build_model(margs, config, tokenizer, block_size, dp=dp)
    if margs.tp_size > 1 and parallel.model_tp_size(model) == 1:
        parallel.tp_plan(model, margs.tp_size)  # no plan, heads or ties that do not fit: now

    blocks = tokenize_blocks(raw, tokenizer, column=data.text_column, block_size=block_size,
                             args=args)
    train, valid = blocks.get("train"), blocks["validation"]
    if train is not None and data.max_train_samples is not None:
        train = train.select(range(min(len(train), data.max_train_samples)))
    if data.max_eval_samples is not None:
        valid = valid.select(range(min(len(valid), data.max_eval_samples)))
    logger.info("%d training and %d evaluation blocks of %d tokens; %.2f M parameters",
                len(train or ()), len(valid), block_size, model.num_parameters() / 1e6)

    trainer = ZeroOffloadTrainer(
        model=model, args=args, train_dataset=train if args.do_train else None,
        eval_dataset=valid if args.do_eval else None, processing_class=tokenizer,
        data_collator=default_data_collator)

    results = {}
    if args.do_train:
        resume = args.resume_from_checkpoint
        # TrainingArguments types it as a path; "true" means the newest checkpoint in
        # --output_dir, as trainer.train(resume_from_checkpoint=True) does
        if resume is not None and resume.strip().lower() == "true":
            resume = True
        out = trainer.train(resume_from_checkpoint=resume)
        trainer.save_model()
        metrics = dict(out.metrics, train_samples=len(train))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results.update(metrics)
    if args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(valid)
        metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 700.0))  # exp overflows past 709
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
    if args.do_train and trainer.is_world_process_zero():
        print(f"model saved to {os.path.abspath(args.output_dir)}")
    return results


def cli(argv=None) -> int:
    """``main`` as a command: a configuration or data error is one line on stderr and exit
    status 2, unless HF_ZOFFLOAD_TRACEBACK=1 asks for the traceback (commands/errors.py)."""
    return run_command("run_clm.py", lambda: main(argv))


if __name__ == "__main__":
    sys.exit(cli())
