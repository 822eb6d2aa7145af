"""TRL's SFT from the command line with ZeRO-Offload: `trl sft` (trl/scripts/sft.py) with the
three lines that add it.

    python scripts/sft_trl.py --model_name_or_path ./my-model --dataset_name ./my-data \
        --output_dir out --bf16 --zero_offload [--zero_offload_<setting> VALUE ...]
    hf-zoffload launch scripts/sft_trl.py --model_name_or_path ... --output_dir out

Every option of `trl sft` (SFTConfig's, ModelConfig's, ScriptArguments', a ``--config``
yaml) plus ``--zero_offload`` and ``--zero_offload_<setting>``; under ``hf-zoffload launch``
the sidecar's settings arrive as HF_ZOFFLOAD_*, and its ``zero_offload: true`` turns offload
on without the flag. What differs from TRL's script: the argument class is
``zero_offload_args(SFTConfig)``, the trainer ``zero_offload_trainer(SFTTrainer)``, and an
unknown option is an error (`trl sft` passes ``fail_with_unknown_args=False``, under which a
``--zero_offload`` it does not know would be dropped without a word).
"""

import sys

from datasets import load_dataset
from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser, get_peft_config

from hf_zoffload import zero_offload_args, zero_offload_trainer
from hf_zoffload.integrations.arguments import check_argv


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    check_argv(argv)  # a mistyped --zero_offload_<name>: the closest one named
    parser = TrlParser((ScriptArguments, zero_offload_args(SFTConfig), ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}),
                                       "dtype": model_args.dtype,
                                       "attn_implementation": model_args.attn_implementation}
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    trainer = zero_offload_trainer(SFTTrainer)(
        model=model_args.model_name_or_path, args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split]
        if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # the fp32 master weights


if __name__ == "__main__":
    main()
