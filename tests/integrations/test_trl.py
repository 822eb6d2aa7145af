"""TRL's trainers through `zero_offload_trainer` / `zero_offload_args`, each against its stock
self: SFT (plain, packing, completion-only loss, LoRA), DPO (its reference model outside the
engine), GRPO (generation with the model being trained, with and without the delayed
update), RLOO, the reward trainer and KTO; and every spelling a user may try, working or
refused in one line (issue 34's table). Tiny Llama models and word-level data made here, no hub.

fp32 tolerances: the CPU-Adam and torch's AdamW order their float ops differently (1e-7
relative per op), which is all that differs. Measured over these runs: losses equal or within
2e-7 relative, grad norms within 1.2e-7, weights within 2e-7 absolute (lr 1e-3).
"""

import copy
import dataclasses
import random

import pytest
import torch

trl = pytest.importorskip("trl")  # the test extras pin it (setup.cfg)

from datasets import Dataset  # noqa: E402
from peft import LoraConfig, PeftModel  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from trl import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
)

from hf_zoffload import (  # noqa: E402
    ZeroOffloadOptimizer,
    ZeroOffloadPlugin,
    ZeroOffloadTrainer,
    ZeroOffloadTrainingArguments,
    zero_offload_args,
    zero_offload_trainer,
)

WORDS = "the a cat dog sat ran on under mat rug big small red blue and then".split()
COMMON = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, logging_steps=1,
              report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0,
              disable_tqdm=True)


def tokenizer():
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def llama(dtype=torch.float32):
    """No attention biases: a key bias's exact gradient is zero (softmax ignores a per-row
    constant), so its Adam step would normalise rounding noise."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)).to(dtype)


@pytest.fixture(scope="module")
def data():
    r = random.Random(0)

    def words(lo, hi):
        return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))

    return {
        "text": Dataset.from_dict({"text": [words(4, 12) for _ in range(32)]}),
        "completion": Dataset.from_dict({"prompt": [words(2, 5) for _ in range(32)],
                                         "completion": [words(2, 6) for _ in range(32)]}),
        "preference": Dataset.from_dict({"prompt": [words(2, 4) for _ in range(16)],
                                         "chosen": [words(2, 5) for _ in range(16)],
                                         "rejected": [words(2, 5) for _ in range(16)]}),
        "prompt": Dataset.from_dict({"prompt": [words(2, 4) for _ in range(16)]}),
        "unpaired": Dataset.from_dict({"prompt": [words(2, 4) for _ in range(16)],
                                       "completion": [" " + words(2, 5) for _ in range(16)],
                                       "label": [i % 2 == 0 for i in range(16)]}),
        "pairs": Dataset.from_dict({"chosen": [words(3, 6) for _ in range(16)],
                                    "rejected": [words(3, 6) for _ in range(16)]}),
    }


def column(trainer, key):
    return [e[key] for e in trainer.state.log_history if key in e and "train_runtime" not in e]


def same_run(got, ref, *, params=None):
    """The offload run against the stock one, fp32 (module docstring)."""
    assert got.engine is not None and ref.optimizer.optimizer.__class__ is torch.optim.AdamW
    assert len(column(got, "loss")) == COMMON["max_steps"]
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-6, abs=1e-7)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-6)
    named = dict(ref.model.named_parameters())
    for name, p in got.model.named_parameters():
        if params is None or params(name):
            assert torch.allclose(p, named[name], rtol=0, atol=1e-6), name


def sft(data, *, offload, dataset="text", **kw):
    opts = dict(COMMON, output_dir=f"/tmp/unused-{offload}", max_length=16, **kw)
    trainer_kw = {k: opts.pop(k) for k in ("peft_config",) if k in opts}
    if offload:
        cls, args = zero_offload_trainer(SFTTrainer), zero_offload_args(SFTConfig)(
            zero_offload=True, **opts)
    else:
        cls, args = SFTTrainer, SFTConfig(**opts)
    trainer = cls(model=llama(), args=args, train_dataset=data[dataset],
                  processing_class=tokenizer(), **trainer_kw)
    trainer.train()
    return trainer


# ------------------------------------------------------------------------ SFT
@pytest.mark.parametrize("kind", ["plain", "packing", "completion_only"])
def test_sft_matches_stock(tmp_path, data, kind):
    kw = {"plain": {}, "packing": {"packing": True},
          "completion_only": {"dataset": "completion", "completion_only_loss": True}}[kind]
    got, ref = sft(data, offload=True, **kw), sft(data, offload=False, **kw)
    if kind == "packing":
        assert got.padding_free  # TRL's default packing (bfd) trains padding-free
    same_run(got, ref)


def test_sft_lora_trains_the_adapters_as_stock(data):
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    got = sft(data, offload=True, peft_config=LoraConfig(**lora))
    ref = sft(data, offload=False, peft_config=LoraConfig(**lora))
    assert isinstance(got.model, PeftModel)
    trained = {id(p) for g in got.engine.param_groups for p in g["params"]}
    named = dict(got.model.named_parameters())
    assert {n for n, p in named.items() if id(p) in trained} == {
        n for n, p in named.items() if p.requires_grad} and all("lora_" in n for n in named
                                                                 if named[n].requires_grad)
    same_run(got, ref)


def test_sft_bf16_within_the_trainer_tolerance(data):
    """The engine's bf16 params and fp32 masters against the stock Trainer's autocast over
    fp32 params. Measured over 3 steps: losses within 1.1e-4, grad norms within 1.8e-3; the
    bounds are the Trainer's (test_trainer.py, test_bf16_matches_plain_mixed_precision)."""
    got, ref = sft(data, offload=True, bf16=True), sft(data, offload=False, bf16=True)
    assert got.engine.plugin.compute_dtype == "bf16"
    assert next(got.model.parameters()).dtype == torch.bfloat16
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=5e-4)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=2e-3)


# ------------------------------------------------------------------------ DPO
def test_dpo_matches_stock_with_the_reference_outside_the_engine(data):
    runs = {}
    for offload in (True, False):
        opts = dict(COMMON, output_dir="/tmp/unused", max_length=16)
        if offload:
            cls, args = zero_offload_trainer(DPOTrainer), zero_offload_args(DPOConfig)(
                zero_offload=True, **opts)
        else:
            cls, args = DPOTrainer, DPOConfig(**opts)
        ref_model = llama()
        runs[offload] = cls(model=llama(), ref_model=ref_model, args=args,
                            train_dataset=data["preference"], processing_class=tokenizer())
        runs[offload].train()
    got, ref = runs[True], runs[False]
    same_run(got, ref)
    trained = {id(p) for g in got.engine.param_groups for p in g["params"]}
    assert not any(id(p) in trained for p in got.ref_model.parameters())
    for p, q in zip(got.ref_model.parameters(), llama().parameters()):  # untouched
        assert p.dtype == torch.float32 and torch.equal(p, q)


# ------------------------------------------------------------------------ GRPO
def reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


class SeenAtGeneration(TrainerCallback):
    """For every ``generate`` of the model being trained: whether a delayed update was still
    pending when it was called, and whether the params its first forward computed on were
    the engine's masters after the steps taken so far, rounded to the compute dtype."""

    def __init__(self):
        self.trainer, self.seen = None, []

    def on_train_begin(self, args, state, control, **kwargs):
        model, engine = self.trainer.model, self.trainer.engine
        generate = model.generate
        pending = []

        def recording_generate(*a, **k):
            pending[:] = [engine.update_in_flight]
            return generate(*a, **k)

        def check(module, inputs):  # registered after the integration's own hooks
            if torch.is_grad_enabled() or not pending:
                return
            same = all(torch.equal(p.detach().reshape(-1),
                                   engine.host_views(p)["master"].to(p.dtype))
                       for p in module.parameters())
            self.seen.append((engine.applied_steps, pending.pop(), same))

        model.generate = recording_generate
        model.register_forward_pre_hook(check)


def grpo(data, *, offload, callbacks=(), **kw):
    opts = dict(COMMON, output_dir="/tmp/unused", num_generations=2, max_completion_length=4,
                **kw)
    if offload:
        cls, args = zero_offload_trainer(GRPOTrainer), zero_offload_args(GRPOConfig)(
            zero_offload=True, **opts)
    else:
        cls, args = GRPOTrainer, GRPOConfig(**opts)
    trainer = cls(model=llama(), reward_funcs=reward_length, args=args,
                  train_dataset=data["prompt"], processing_class=tokenizer(),
                  callbacks=list(callbacks))
    for c in callbacks:
        c.trainer = trainer
    trainer.train()
    return trainer


def test_grpo_matches_stock(data):
    got, ref = grpo(data, offload=True), grpo(data, offload=False)
    assert column(got, "reward") == column(ref, "reward")  # the same completions sampled
    same_run(got, ref)


@pytest.mark.parametrize("dtype, delayed", [("fp32", False), ("fp32", True), ("bf16", True)])
def test_grpo_generates_with_the_params_of_the_last_step(data, dtype, delayed):
    """Each generation computes on the masters of every step taken before it. With the delayed
    update the last step's params are still on their way when generation starts: a forward
    without grad lands them first (core.prepare_models)."""
    seen = SeenAtGeneration()
    kw = dict(max_steps=4, bf16=dtype == "bf16")
    if delayed:
        kw.update(zero_offload_delayed_update=True, zero_offload_delayed_update_warmup_steps=0)
    trainer = grpo(data, offload=True, callbacks=[seen], **kw)
    assert trainer.engine.plugin.compute_dtype == dtype
    assert [steps for steps, _, _ in seen.seen] == [0, 1, 2, 3]  # one generation per step
    assert all(same for _, _, same in seen.seen), seen.seen
    # the delayed update starts once the buckets follow the first backward (step 2 on):
    # those generations were called with an update pending, which they waited for
    assert [pending for _, pending, _ in seen.seen] == [False, False, delayed, delayed]


# ------------------------------------------------------------------------ the others
def reward_model():
    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(**{**llama().config.to_dict(),
                                                         "num_labels": 1, "id2label": None,
                                                         "label2id": None}))


OTHERS = {  # trainer, its config, what it is built with beside args (made fresh per run)
    "rloo": (RLOOTrainer, RLOOConfig, lambda d: dict(
        model=llama(), reward_funcs=reward_length, train_dataset=d["prompt"]),
        dict(num_generations=2, max_completion_length=4, beta=0.0)),
    "reward": (RewardTrainer, RewardConfig, lambda d: dict(
        model=reward_model(), train_dataset=d["pairs"]), dict(max_length=16)),
    "kto": (KTOTrainer, KTOConfig, lambda d: dict(
        model=llama(), ref_model=llama(), train_dataset=d["unpaired"]), dict(max_length=16)),
}


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_the_other_trainers_on_the_path_match_stock(data, name):
    """RLOO (generation, as GRPO), the reward model trainer (a sequence-classification head)
    and KTO (a reference model outside the engine), fp32, against their stock selves."""
    trainer_cls, config_cls, given, extra = OTHERS[name]
    runs = {}
    for offload in (True, False):
        opts = dict(COMMON, output_dir="/tmp/unused", **extra)
        if offload:
            cls, args = zero_offload_trainer(trainer_cls), zero_offload_args(config_cls)(
                zero_offload=True, **opts)
        else:
            cls, args = trainer_cls, config_cls(**opts)
        runs[offload] = cls(args=args, processing_class=tokenizer(), **given(data))
        runs[offload].train()
    same_run(runs[True], runs[False])


# ------------------------------------------------------------------------ every spelling
@dataclasses.dataclass
class SftThenOffloadArgs(SFTConfig, ZeroOffloadTrainingArguments):
    pass


@dataclasses.dataclass
class OffloadThenSftArgs(ZeroOffloadTrainingArguments, SFTConfig):
    pass


class OffloadThenSft(ZeroOffloadTrainer, SFTTrainer):
    pass


class SftThenOffload(SFTTrainer, ZeroOffloadTrainer):
    pass


def _sft_args(cls=None, **kw):
    cls = cls or zero_offload_args(SFTConfig)
    return cls(**{**COMMON, "output_dir": "/tmp/unused", "max_length": 16, "max_steps": 2,
                  "zero_offload": True, **kw})


def _build(cls, data, args, model=None, **kw):
    return cls(model=model or llama(), args=args, train_dataset=data["text"],
               processing_class=tokenizer(), **kw)


def test_the_factories_make_one_class_each_and_keep_the_stock_names():
    assert zero_offload_trainer(Trainer) is ZeroOffloadTrainer
    assert zero_offload_args(TrainingArguments) is ZeroOffloadTrainingArguments
    assert zero_offload_trainer(SFTTrainer) is zero_offload_trainer(SFTTrainer)
    assert zero_offload_trainer(OffloadThenSft) is OffloadThenSft  # has the mixin already
    assert zero_offload_args(SftThenOffloadArgs) is SftThenOffloadArgs
    assert ZeroOffloadTrainer.__name__ == "ZeroOffloadTrainer"
    assert ZeroOffloadTrainingArguments.__module__ == "hf_zoffload.integrations.trainer"
    for bad, factory in ((SFTConfig, zero_offload_trainer), (SFTTrainer, zero_offload_args),
                         (object, zero_offload_trainer)):
        with pytest.raises(TypeError, match=rf"^{factory.__name__} takes "):
            factory(bad)


@pytest.mark.parametrize("trainer_cls, args_cls", [
    (zero_offload_trainer(SFTTrainer), None),
    (OffloadThenSft, None),
    (OffloadThenSft, SftThenOffloadArgs),
    (SftThenOffload, SftThenOffloadArgs),
    (SftThenOffload, OffloadThenSftArgs),
], ids=["factory", "ours-first", "ours-first+own-args", "sft-first", "sft-first+other-args"])
def test_every_order_of_the_bases_trains_with_offload(data, trainer_cls, args_cls):
    """The subclass's own keywords (peft_config=) reach it; SFTConfig's own set-up runs
    (its defaults, bf16 among them, resolved) in either order of the argument bases."""
    args = _sft_args(args_cls, packing=True)
    trainer = _build(trainer_cls, data, args, peft_config=LoraConfig(
        r=4, target_modules=["q_proj"], lora_dropout=0.0))
    trainer.train()
    assert trainer.engine is not None and trainer.engine.applied_steps == 2
    assert isinstance(trainer.model, PeftModel) and trainer.padding_free
    assert args.bf16 is False and isinstance(args.pad_to_multiple_of, (int, type(None)))


# make_engine's defaults here (tests/_fixtures.py)
ENGINE_DEFAULTS = dict(compute_dtype="fp32")


def _plain_args(**kw):
    return ZeroOffloadTrainingArguments(output_dir="/tmp/unused", zero_offload=True, use_cpu=True,
                                        report_to=[], **kw)


# name: (build and train with a model and make_engine as e, the one line it stops with)
REFUSED = {
    "stock-trainer+our-args": (
        lambda d, m, e: _build(SFTTrainer, d, _sft_args(), model=m),
        r"^SFTTrainer was given ZeroOffloadSFTConfig with zero_offload=True, but SFTTrainer is "
        r"not a ZeRO-Offload trainer .* Use hf_zoffload\.zero_offload_trainer\(SFTTrainer\)"),
    "dpo+plain-args": (
        lambda d, m, e: zero_offload_trainer(DPOTrainer)(
            model=m, ref_model=llama(), args=_plain_args(), train_dataset=d["preference"],
            processing_class=tokenizer()),
        r"^ZeroOffloadDPOTrainer takes DPOConfig arguments, not ZeroOffloadTrainingArguments:"
        r" build them with hf_zoffload\.zero_offload_args\(DPOConfig\)\(\.\.\., "
        r"zero_offload=True\)$"),
    "sft-first+plain-args": (
        lambda d, m, e: _build(SftThenOffload, d, _plain_args(), model=m),
        r"^SftThenOffload takes SFTConfig arguments, not ZeroOffloadTrainingArguments"),
    "stock+optimizers=": (
        lambda d, m, e: _build(SFTTrainer, d, SFTConfig(**dict(COMMON, output_dir="/tmp/unused")),
                            model=m, optimizers=(e(m), None)).train(),
        r"^a ZeroOffloadOptimizer was passed to accelerator\.prepare, .* with a Trainer use "
        r"hf_zoffload\.zero_offload_trainer\(<the Trainer class>\) with zero_offload=True"),
    "stock+optimizer_cls_and_kwargs=": (
        lambda d, m, e: _build(SFTTrainer, d, SFTConfig(**dict(COMMON, output_dir="/tmp/unused")),
                            model=m, optimizer_cls_and_kwargs=(ZeroOffloadOptimizer, {
                                "plugin": ZeroOffloadPlugin(compute_dtype="fp32")})).train(),
        r"^a ZeroOffloadOptimizer was passed to accelerator\.prepare"),
    "transformers-Trainer+optimizers=": (
        lambda d, m, e: Trainer(model=m, args=TrainingArguments(**dict(
            COMMON, output_dir="/tmp/unused")), train_dataset=[{"input_ids": torch.ones(
                8, dtype=torch.long), "labels": torch.ones(8, dtype=torch.long)}] * 8,
            optimizers=(e(m), None)).train(),
        r"^a ZeroOffloadOptimizer was passed to accelerator\.prepare"),
    "offload-off+optimizers=": (
        lambda d, m, e: _build(zero_offload_trainer(SFTTrainer), d, _sft_args(zero_offload=False),
                            model=m, optimizers=(e(m), None)).train(),
        r"^a ZeroOffloadOptimizer was passed to accelerator\.prepare"),
    "ours+optimizers=": (
        lambda d, m, e: _build(zero_offload_trainer(SFTTrainer), d, _sft_args(), model=m,
                            optimizers=(torch.optim.AdamW(m.parameters()), None)),
        r"^zero_offload=True builds its own optimizer and scheduler: do not pass optimizers= "
        r"to ZeroOffloadSFTTrainer"),
    "ours+optimizer_cls_and_kwargs=": (
        lambda d, m, e: _build(OffloadThenSft, d, _sft_args(), model=m,
                            optimizer_cls_and_kwargs=(torch.optim.AdamW, {})),
        r"^zero_offload=True builds its own optimizer and scheduler: do not pass "
        r"optimizer_cls_and_kwargs= to OffloadThenSft"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_cannot_work_is_refused_in_one_line_before_any_step(data, name, make_engine):
    """Each stops with one line naming what works, and the model keeps its initial weights
    (a ZeroOffloadOptimizer built on it has cast them to its compute dtype, fp32 here)."""
    build, match = REFUSED[name]
    model = llama()
    with pytest.raises(ValueError, match=match) as err:
        build(data, model, make_engine)
    assert "\n" not in str(err.value)
    for p, q in zip(model.parameters(), llama().parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("positional", [False, True], ids=["args=", "positional"])
def test_plain_offload_arguments_are_rebuilt_as_sft_rebuilds_plain_ones(data, positional):
    """SFTTrainer takes any TrainingArguments and rebuilds them as an SFTConfig; with the
    mixin in front, ZeroOffloadTrainingArguments are rebuilt as zero_offload_args(SFTConfig),
    the offload settings with them (a trainer taking only its own class refuses them:
    REFUSED's dpo+plain-args; one whose own __init__ runs first: sft-first+plain-args)."""
    given = _plain_args(max_steps=2, zero_offload_bucket_size_mb=0.5, learning_rate=1e-3)
    cls = zero_offload_trainer(SFTTrainer)
    if positional:
        trainer = cls(llama(), given, train_dataset=data["text"], processing_class=tokenizer())
    else:
        trainer = _build(cls, data, given)
    assert type(trainer.args) is zero_offload_args(SFTConfig)
    assert trainer.args.learning_rate == 1e-3 and trainer.args.max_length == 1024  # SFT's
    trainer.train()
    assert trainer.engine.plugin.bucket_size_mb == 0.5 and trainer.engine.applied_steps == 2


def test_a_combined_argument_class_must_be_a_dataclass():
    class NotADataclass(ZeroOffloadTrainingArguments, SFTConfig):
        pass

    with pytest.raises(TypeError, match=r"^NotADataclass combines ZeRO-Offload's arguments with "
                                         r"SFTConfig.*decorate it with @dataclasses\.dataclass, "
                                         r"or use hf_zoffload\.zero_offload_args\(SFTConfig\)$"):
        NotADataclass(output_dir="/tmp/unused", packing=True)


def test_stock_sft_trainer_with_offload_arguments_stops_before_the_model(data):
    """SFTTrainer rebuilds arguments that are not an SFTConfig as SFTConfig(**args.to_dict())
    before any other code runs: TRL's own TypeError names the option, nothing is trained."""
    model = llama()
    with pytest.raises(TypeError, match="unexpected keyword argument 'zero_offload'"):
        SFTTrainer(model=model, args=ZeroOffloadTrainingArguments(
            output_dir="/tmp/unused", zero_offload=True, use_cpu=True, report_to=[]),
            train_dataset=data["text"], processing_class=tokenizer())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_the_combined_arguments_pickle_and_copy():
    import pickle

    args = _sft_args(packing=True, zero_offload_bucket_size_mb=0.5)
    for back in (pickle.loads(pickle.dumps(args)), copy.deepcopy(args)):
        assert type(back) is type(args) and back.packing and back.zero_offload
        assert back.zero_offload_plugin().bucket_size_mb == 0.5


def test_a_trl_config_parses_the_offload_options():
    """What `trl sft` does: HfArgumentParser over the config class; the combined one takes
    --zero_offload and --zero_offload_<setting> beside TRL's own options."""
    parser = HfArgumentParser(zero_offload_args(SFTConfig))
    (args,) = parser.parse_args_into_dataclasses(args=[
        "--output_dir", "/tmp/unused", "--use_cpu", "--bf16", "false", "--packing",
        "--zero_offload", "--zero_offload_bucket_size_mb", "0.5", "--max_length", "32"])
    assert args.zero_offload and args.packing and args.max_length == 32
    plugin = args.zero_offload_plugin()
    assert plugin.bucket_size_mb == 0.5 and plugin.compute_dtype == "fp32"
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['--zero_offload'"):
        HfArgumentParser(SFTConfig).parse_args_into_dataclasses(
            args=["--output_dir", "/tmp/unused", "--use_cpu", "--zero_offload"])


# ------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("dtype, lora", [(torch.bfloat16, False), (torch.float16, False),
                                         (torch.bfloat16, True)],
                         ids=["bf16", "fp16", "bf16-base+lora"])
def test_a_16bit_model_without_precision_flags_keeps_its_dtype(data, dtype, lora):
    """As in the stock Trainer: a model loaded in 16-bit, trained without --fp16/--bf16,
    stays in its dtype on the device (the engine computes in it, fp32 masters on the host).
    With LoRA over a 16-bit base (peft makes the adapters fp32) the base keeps its dtype too;
    the adapters' device copy joins it, their masters are fp32."""
    opts = dict(COMMON, output_dir="/tmp/unused", max_length=16, max_steps=2)
    extra = {"peft_config": LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0)} \
        if lora else {}
    stock = SFTTrainer(model=llama(dtype), args=SFTConfig(**opts), train_dataset=data["text"],
                       processing_class=tokenizer(), **extra)
    stock.train()
    got = zero_offload_trainer(SFTTrainer)(
        model=llama(dtype), args=zero_offload_args(SFTConfig)(zero_offload=True, **opts),
        train_dataset=data["text"], processing_class=tokenizer(), **extra)
    got.train()
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    assert got.engine.plugin.compute_dtype == names[dtype]

    def frozen(trainer):
        return {p.dtype for p in trainer.model.parameters() if not p.requires_grad}

    if lora:
        assert frozen(got) == frozen(stock) == {dtype}
        assert {p.dtype for p in stock.model.parameters() if p.requires_grad} == {torch.float32}
    else:
        assert {p.dtype for p in got.model.parameters()} == {p.dtype for p in
                                                             stock.model.parameters()} == {dtype}
    trained = [p for p in got.model.parameters() if p.requires_grad]
    assert {p.dtype for p in trained} == {dtype}
    assert got.engine.host_views(trained[0])["master"].dtype == torch.float32


# ------------------------------------------------------------------------ the command line
@pytest.mark.slow
def test_hf_zoffload_launch_runs_a_trl_script_with_the_sidecars_settings(tmp_path):
    """scripts/sft_trl.py (`trl sft` with zero_offload_args / zero_offload_trainer) under
    `hf-zoffload launch`: the sidecar's ``zero_offload: true`` turns offload on without
    --zero_offload, its bucket size reaches the engine, and the saved weights are the fp32
    masters."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from safetensors.torch import load_file

    from hf_zoffload.commands.main import main

    root = Path(__file__).resolve().parents[2]
    model_dir, data_dir, out = tmp_path / "model", tmp_path / "data", tmp_path / "out"
    llama().save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    data_dir.mkdir()
    r = random.Random(0)
    (data_dir / "train.jsonl").write_text("".join(json.dumps({"text": " ".join(
        r.choice(WORDS) for _ in range(8))}) + "\n" for _ in range(16)))
    cfg = tmp_path / "acc.yaml"
    assert main(["config", "--default", "--config_file", str(cfg)]) == 0
    (tmp_path / "acc_zoffload.yaml").write_text(yaml.safe_dump(
        {"zero_offload": True, "zoffload": {"bucket_size_mb": 0.01}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_ZOFFLOAD_")}
    env.update(PYTHONPATH=str(root), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hf_zoffload.commands.main", "launch", "--config_file",
           str(cfg), str(root / "scripts" / "sft_trl.py"), "--model_name_or_path",
           str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(out),
           "--max_steps", "2", "--per_device_train_batch_size", "4", "--max_length", "16",
           "--use_cpu", "--bf16", "false", "--report_to", "none", "--logging_steps", "1",
           "--save_strategy", "no", "--learning_rate", "1e-3"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO-Offload enabled; settings from" in proc.stderr
    assert "ZeRO-Offload memory (model states)" in proc.stderr  # the engine trained
    buckets = [int(line.rsplit(";", 1)[1].split()[0]) for line in proc.stderr.splitlines()
               if "gradient arrival order: done" in line]
    assert buckets and buckets[0] > 1  # 0.01 MB buckets: the default (25 MB) makes one
    saved = load_file(out / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
