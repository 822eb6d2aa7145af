"""`hf-zoffload env` and `hf-zoffload estimate`."""

import json
import os
import sys

import pytest
import yaml

from hf_zoffload.commands.estimate import parse_count, parse_size
from hf_zoffload.commands.main import main

MIB = 2**20
TINY_GPT2 = "n_layer=2,n_embd=64,n_head=2,vocab_size=1000,n_positions=128"


@pytest.fixture(autouse=True)
def no_zoffload_env(monkeypatch, tmp_path):
    for key in [k for k in os.environ if k.startswith("HF_ZOFFLOAD_")]:
        monkeypatch.delenv(key)
    # env and estimate look for a sidecar beside accelerate's default config: not this
    # machine's.
    import accelerate.commands.config.config_args as config_args

    monkeypatch.setattr(config_args, "default_config_file",
                        str(tmp_path / "accelerate" / "default_config.yaml"))


def _json(capsys, *argv):
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------- env
def test_env_names_versions_simd_kernel_and_config(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name in ("hf_zoffload version", "torch version", "transformers version",
                 "accelerate version", "triton version", "Python version"):
        assert f"- {name}: " in out
    simd = next(line for line in out.splitlines() if line.startswith("- CPU SIMD:"))
    for feature in ("AVX2", "AVX-512F", "F16C", "AVX512-BF16"):
        assert f"{feature} yes" in simd or f"{feature} no" in simd
    assert "- CPU-Adam kernel: " in out and ("OpenMP" in out or "MISSING" in out)
    # the effective config: nothing set, so the compute dtype follows each path's precision
    assert "compute_dtype: not set: the Trainer follows --fp16/--bf16" in out
    assert "bucket_size_mb: 32.0 (default)" in out


def test_env_finds_the_sidecar_launch_uses(tmp_path, monkeypatch, capsys):
    """Right after `config --default`, env shows the sidecar it wrote beside accelerate's
    default config (it used to say there was none), as `launch` would use it."""
    import accelerate.commands.config.config_args as config_args

    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "default_config.yaml"))
    assert main(["config", "--default"]) == 0
    side = tmp_path / "default_config_zoffload.yaml"
    side.write_text("zero_offload: true\nzoffload: {cpu_threads: 3}\n")
    capsys.readouterr()
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"- ZeRO-Offload config: {side}\n" in out
    assert ("    on/off under `hf-zoffload launch` (it exports HF_ZOFFLOAD_ENABLED=true, from "
            f"zero_offload: True in {side})") in out
    assert "    cpu_threads: 3\n" in out  # chosen: no "(default)"
    from hf_zoffload.commands.launch import find_sidecar

    assert find_sidecar(zoffload_config=None, config_file=None, environ={}) == str(side)


def test_version(capsys):
    import hf_zoffload

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf-zoffload {hf_zoffload.__version__}"


def test_env_still_reports_without_the_kernel_and_with_a_bad_setting(monkeypatch, capsys):
    import hf_zoffload.ops
    from hf_zoffload.ops import adam_kernels

    monkeypatch.setitem(sys.modules, "hf_zoffload.ops._cpu_adam", None)  # not built
    monkeypatch.delattr(hf_zoffload.ops, "_cpu_adam", raising=False)
    adam_kernels._ext.cache_clear()
    monkeypatch.setenv("HF_ZOFFLOAD_BUCKET_SIZE_MB", "-3")
    try:
        assert main(["env"]) == 0
        out = capsys.readouterr().out
        assert "- CPU-Adam kernel: MISSING: compiled CPU-Adam not available" in out
        monkeypatch.setitem(sys.modules, "hf_zoffload.ops.adam_kernels", None)  # broken install
        monkeypatch.delattr(hf_zoffload.ops, "adam_kernels", raising=False)
        assert main(["env"]) == 0
        out = capsys.readouterr().out
        assert "- CPU-Adam kernel: MISSING: hf_zoffload.ops.adam_kernels does not import" in out
    finally:
        adam_kernels._ext.cache_clear()
    assert "AVX-512F" in out  # from /proc/cpuinfo instead
    assert "- ZeRO-Offload config: unavailable (ValueError:" in out and "bucket_size_mb" in out
    assert "- accelerate version: " in out


# -------------------------------------------------------------------- estimate
def test_estimate_7b_bf16_by_hand(capsys, monkeypatch):
    monkeypatch.setenv("HF_ZOFFLOAD_PIN_MEMORY", "false")  # exact bytes; pinned: below
    r = _json(capsys, "--params", "7B", "--compute_dtype", "bf16", "--gpu_memory", "24GiB",
              "--host_memory", "128GB")
    n = 7_000_000_000
    rep = r["report"]
    # device: bf16 params, plus two 32 MiB buckets of 16-bit grads in flight
    assert rep["device"] == {"params": 2 * n, "grad_buckets": 2 * 32 * MIB}
    # host: fp32 master + two moments (12 B/param), bf16 grads (2), which the new params
    # overwrite on their way back: no param staging buffer
    assert rep["host_total"] == 14 * n
    assert rep["plain_adamw_device_total"] == 16 * n
    gpu, plain, host = (r["fits"][k] for k in ("gpu_zero_offload", "gpu_plain_adamw",
                                                "host_zero_offload"))
    assert gpu == {"need": 2 * n + 64 * MIB, "have": 24 * 2**30, "fits": True,
                   "headroom": 24 * 2**30 - 2 * n - 64 * MIB}
    assert plain["fits"] is False and plain["headroom"] == 24 * 2**30 - 16 * n
    assert host == {"need": 14 * n, "have": 128 * 10**9, "fits": True, "headroom": 30 * 10**9}
    assert main(["estimate", "--params", "7B", "--compute_dtype", "bf16", "--gpu_memory",
                 "24GiB"]) == 0
    text = capsys.readouterr().out
    assert "13.10 GiB" in text  # 14_067_108_864 B
    assert "plain AMP AdamW would need 104.31 GiB on the device" in text
    assert "DOES NOT FIT" in text


def test_estimate_tiny_gpt2_fp16_two_gpus_delayed_by_hand(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ZOFFLOAD_PIN_MEMORY", "false")  # exact bytes; pinned: below
    # wte 1000*64 + wpe 128*64 + 2 layers * (2 ln 2*64*2 + c_attn 64*192+192 + attn c_proj
    # 64*64+64 + c_fc 64*256+256 + mlp c_proj 256*64+64) + ln_f 2*64; lm_head tied
    n = 64_000 + 8_192 + 2 * (256 + 12_480 + 4_160 + 16_640 + 16_448) + 128
    assert n == 172_288
    r = _json(capsys, "--model_type", "gpt2", "--config_overrides", TINY_GPT2,
              "--compute_dtype", "fp16", "--num_gpus", "2", "--delayed_update")
    rep, shard = r["report"], n // 2
    assert rep["n_params"] == n
    # the buckets cap at the model's own 16-bit size
    assert rep["device"] == {"params": 2 * n, "grad_buckets": 2 * n}
    assert rep["host"] == {"master": 4 * shard, "exp_avg": 4 * shard, "exp_avg_sq": 4 * shard,
                           "grad_staging": 2 * 2 * shard,  # doubled by the delayed update
                           "grad_accumulation": 0}
    assert rep["host_total"] == 16 * shard == 1_378_304
    assert r["host_total_all_ranks"] == 2_756_608
    assert rep["plain_adamw_device_total"] == 16 * n
    # the same model from a local config.json counts the same
    from transformers import GPT2Config

    cfg = GPT2Config()
    cfg.update_from_string(TINY_GPT2)
    cfg.save_pretrained(tmp_path)
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        assert _json(capsys, "--model", model)["report"]["n_params"] == n


def test_estimate_counts_pinned_staging_as_the_pool_holds_it(capsys, monkeypatch):
    """Pinned (the default), the staging buffers are power-of-two blocks of whole buckets
    (offload/host.py): what torch's pinned allocator really holds."""
    from hf_zoffload.offload.host import plan_blocks

    monkeypatch.setenv("HF_ZOFFLOAD_PIN_MEMORY", "true")
    n = 7_000_000_000
    rep = _json(capsys, "--params", "7B", "--compute_dtype", "bf16")["report"]
    per = 32 * MIB // 2  # params per 32 MiB bucket of 16-bit grads
    sizes = [2 * min(per, n - i) for i in range(0, n, per)]
    held = sum(cap for cap, _ in plan_blocks(sizes, pinned=True))
    assert rep["host"]["grad_staging"] == held and "param_staging" not in rep["host"]
    assert 2 * n <= held < 1.02 * 2 * n
    tiny = _json(capsys, "--params", "1000", "--compute_dtype", "bf16")["report"]
    assert tiny["host"]["grad_staging"] == 2048  # 2000 B, 64-aligned, in a 2 KiB block


def test_estimate_says_which_state_dtype_fits(capsys, monkeypatch):
    """7B on a 24 GiB GPU and 64 GiB of host memory: only 8-bit moments fit (14 / 10 / about
    8 B/param on the host)."""
    monkeypatch.setenv("HF_ZOFFLOAD_PIN_MEMORY", "false")
    assert main(["estimate", "--params", "7B", "--gpu_memory", "24GiB", "--host_memory",
                 "64GiB"]) == 0
    text = capsys.readouterr().out
    rows = {line.split(" needs")[0].strip(): line for line in text.splitlines()
            if line.startswith("  master_dtype=")}
    assert list(rows) == [f"master_dtype={ma} state_dtype={st}" for ma in ("fp32", "bf16")
                          for st in ("fp32", "bf16", "int8", "int4")]  # bf16 compute: all 8
    assert "needs   91.27 GiB: DOES NOT FIT" in rows["master_dtype=fp32 state_dtype=fp32"]
    assert "needs   65.19 GiB: DOES NOT FIT" in rows["master_dtype=fp32 state_dtype=bf16"]
    assert "needs   52.36 GiB: fits" in rows["master_dtype=fp32 state_dtype=int8"]
    assert "needs   46.04 GiB: fits" in rows["master_dtype=fp32 state_dtype=int4"]
    # 2 B/param less with a bf16 master: 5.06 B/param with int4 moments
    assert "needs   33.00 GiB: fits" in rows["master_dtype=bf16 state_dtype=int4"]
    # the most params each mode fits in 64 GiB: about 64 GiB / (14, ..., 7.06, ..., 5.06 B)
    assert rows["master_dtype=fp32 state_dtype=fp32"].endswith(
        "headroom -27.27 GiB; largest that fits: 4.91B params")
    assert rows["master_dtype=fp32 state_dtype=int4"].endswith("largest that fits: 9.73B params")
    assert rows["master_dtype=bf16 state_dtype=int4"].endswith("largest that fits: 13.57B params")
    fp16 = main(["estimate", "--params", "7B", "--compute_dtype", "fp16", "--host_memory",
                 "64GiB"])
    assert fp16 == 0 and "master_dtype=bf16" not in capsys.readouterr().out  # bf16 only
    r = _json(capsys, "--params", "7B", "--state_dtype", "int8", "--host_memory", "64GiB")
    assert r["report"]["state_dtype"] == "int8" and r["fits"]["host_zero_offload"]["fits"]
    n = 7 * 10**9
    assert r["report"]["host"]["exp_avg"] == int((1 + 4 / 256) * n)  # codes + block scales
    assert {m: v["fit"]["fits"] for m, v in r["host_by_state_dtype"].items()} == \
        {"fp32": False, "bf16": False, "int8": True, "int4": True}
    for v in r["host_by_mode"]:  # the largest fits, one more does not
        most, flags = v["largest_n_params"], ["--state_dtype", v["state_dtype"],
                                              "--master_dtype", v["master_dtype"]]
        need = [_json(capsys, "--params", str(k), *flags)["report"]["host_total"]
                for k in (most, most + 1)]
        assert need[0] <= 64 * 2**30 < need[1], v


def test_estimate_never_downloads(capsys):
    assert main(["estimate", "--model", "no-such-org/no-such-model-zz"]) == 2
    assert "never downloads" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [("7B", 7 * 10**9), ("124M", 124 * 10**6),
                                        ("1.5e9", 1_500_000_000), ("350k", 350_000),
                                        ("1_000", 1000)])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text,value", [("24GB", 24 * 10**9), ("80GiB", 80 * 2**30),
                                        ("80G", 80 * 2**30), ("512 MiB", 512 * MIB),
                                        ("1.5TB", 1_500_000_000_000), ("4096B", 4096)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["7 apples", "GB", "", "-1GB", "24"])
def test_parse_errors_name_the_units(text):
    # a bare number is refused: "--gpu_memory 24" used to read 24 bytes
    with pytest.raises(ValueError, match="expected a number with a unit, one of b, kb"):
        parse_size(text)


def test_gpu_memory_without_a_unit_is_refused(capsys):
    assert main(["estimate", "--params", "7B", "--gpu_memory", "24"]) == 2
    out = capsys.readouterr().err
    assert out.startswith("hf-zoffload estimate: error: ValueError: --gpu_memory '24': expected "
                          "a number with a unit") and "24GiB" in out
    assert len(out.strip().splitlines()) == 1


def test_estimate_tensor_parallel_counts_a_ranks_shards(capsys, monkeypatch):
    """A tiny Llama under its own tp plan: lm_head and every projection are sharded, and
    the embedding where the plan names it (transformers 5.21 on; 5.17's Llama plan leaves it
    whole), the norms replicated; each of tp ranks holds sharded / tp + replicated."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("HF_ZOFFLOAD_PIN_MEMORY", "false")
    tiny = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
            "num_key_value_heads=4,head_dim=16,vocab_size=1000")
    config = LlamaConfig()
    config.update_from_string(tiny)
    embed = 64_000 if "model.embed_tokens" in LlamaForCausalLM(config).tp_plan else 0
    # lm_head 1000*64 + 2 layers * (4 * 64*64 + 3 * 64*128), the embedding 1000*64 or not
    sharded = 64_000 + 2 * (4 * 4096 + 3 * 8192) + embed
    replicated = 2 * 2 * 64 + 64 + 64_000 - embed  # two norms per layer, the final norm
    r = _json(capsys, "--model_type", "llama", "--config_overrides", tiny, "--tp_size", "2",
              "--num_gpus", "4", "--compute_dtype", "bf16")
    per_rank = sharded // 2 + replicated
    assert r["tp_split"] == {"sharded": sharded, "replicated": replicated,
                             "per_rank": per_rank}
    assert r["report"]["device"]["params"] == 2 * per_rank
    assert r["report"]["host"]["master"] == 4 * per_rank // 2  # data parallel 2 shares it
    assert main(["estimate", "--params", "7B", "--tp_size", "2", "--num_gpus", "2"]) == 2
    assert "needs MODEL, --model or --model_type" in capsys.readouterr().err
    assert main(["estimate", "--model_type", "llama", "--tp_size", "3", "--num_gpus", "4"]) == 2
    assert "positive multiple of --tp_size" in capsys.readouterr().err


# ------------------------------------------------------------------ abbreviations
@pytest.mark.parametrize("argv,unknown", [
    (["estimate", "--model_type", "gpt2", "--config", "n_layer=2"],
     "--config"),  # was --config_overrides
    (["env", "--zoffload", "x.yaml"], "--zoffload"),  # was --zoffload_config
    (["config", "--mixed", "bf16"], "--mixed"),  # was --mixed_precision
    (["--vers", "env"], "--vers"),  # was --version
])
def test_abbreviated_options_are_errors_naming_them(argv, unknown, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: unrecognized arguments: {unknown}" in err


def test_launch_refuses_an_abbreviated_option(capsys):
    """`--zoffload x` would parse as --zoffload_config yet reach accelerate unstripped."""
    from hf_zoffload.commands.launch import _accelerate_parser

    with pytest.raises(SystemExit):
        _accelerate_parser().parse_args(["--zoffload", "x.yaml", "train.py"])
    assert "--zoffload" in capsys.readouterr().err
    args = _accelerate_parser().parse_args(["--zoffload_config", "x.yaml", "train.py"])
    assert args.zoffload_config == "x.yaml"


# ------------------------------------------------- estimate: the effective config, MODEL
def test_estimate_reads_the_sidecar_env_calls_effective(tmp_path, monkeypatch, capsys):
    """The sidecar beside accelerate's config (what env and launch use) sets int8 moments;
    HF_ZOFFLOAD_* variables win over it, and explicit flags over both."""
    import accelerate.commands.config.config_args as config_args

    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "default_config.yaml"))
    side = tmp_path / "default_config_zoffload.yaml"
    side.write_text("zero_offload: true\nzoffload: {state_dtype: int8, bucket_size_mb: 8}\n")
    assert main(["env"]) == 0
    assert "    state_dtype: int8\n" in capsys.readouterr().out
    r = _json(capsys, "--params", "7B")
    assert r["report"]["state_dtype"] == "int8"
    assert r["settings"]["state_dtype"] == {"value": "int8", "from": str(side)}
    assert r["settings"]["bucket_size_mb"] == {"value": 8.0, "from": str(side)}
    assert r["settings"]["compute_dtype"]["from"] == "default"
    monkeypatch.setenv("HF_ZOFFLOAD_STATE_DTYPE", "bf16")
    r = _json(capsys, "--params", "7B")
    assert r["settings"]["state_dtype"] == {"value": "bf16", "from": "HF_ZOFFLOAD_STATE_DTYPE"}
    r = _json(capsys, "--params", "7B", "--state_dtype", "fp32")
    assert r["report"]["state_dtype"] == "fp32"
    assert r["settings"]["state_dtype"]["from"] == "--state_dtype"
    assert r["settings"]["bucket_size_mb"]["from"] == str(side)  # the rest still from it
    # --zoffload_config names another sidecar; the text output says what it used
    other = tmp_path / "other.yaml"
    other.write_text("zoffload: {delayed_update: true}\n")
    monkeypatch.delenv("HF_ZOFFLOAD_STATE_DTYPE")
    assert main(["estimate", "--params", "7B", "--zoffload_config", str(other)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(
        f"settings: state_dtype=fp32 (default), master_dtype=fp32 (default), "
        f"compute_dtype=bf16 (default), "
        f"bucket_size_mb=32.0 (default), delayed_update=True ({other}), ")
    assert main(["estimate", "--params", "7B", "--zoffload_config", str(tmp_path / "no")]) == 2
    assert "--zoffload_config" in capsys.readouterr().err


def test_estimate_takes_the_model_as_a_positional(tmp_path, capsys):
    from transformers import GPT2Config

    cfg = GPT2Config()
    cfg.update_from_string(TINY_GPT2)
    cfg.save_pretrained(tmp_path)
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        by_flag = _json(capsys, "--model", model)
        assert _json(capsys, model) == by_flag and by_flag["report"]["n_params"] == 172_288
    assert main(["estimate", "no-such-org/no-such-model-zz"]) == 2
    assert "MODEL 'no-such-org/no-such-model-zz' is neither" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one source only
        main(["estimate", str(tmp_path), "--params", "7B"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_estimate_hints_the_smallest_tp_size_that_fits(capsys, monkeypatch):
    """GPU side short at tp 1: the hint is the smallest power-of-two tp dividing the GPU
    count whose per-rank figure (the same arithmetic as --tp_size) fits."""
    monkeypatch.setenv("HF_ZOFFLOAD_PIN_MEMORY", "false")
    tiny = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
            "num_key_value_heads=4,head_dim=16,vocab_size=1000")
    base = ["--model_type", "llama", "--config_overrides", tiny, "--num_gpus", "8",
            "--compute_dtype", "bf16", "--bucket_size_mb", "0.001"]
    need = {t: _json(capsys, *base, "--tp_size", str(t))["report"]["device_total"]
            for t in (1, 2, 4, 8)}
    assert need[1] > need[2] > need[4] > need[8]
    gpu = f"{need[4]}B"  # tp 4 fits exactly, tp 2 does not
    r = _json(capsys, *base, "--gpu_memory", gpu)
    assert r["fits"]["gpu_zero_offload"]["fits"] is False
    assert r["tp_hint"] == {"tp_size": 4, "need": need[4], "have": need[4]}
    assert main(["estimate", *base, "--gpu_memory", gpu]) == 0
    hints = [ln for ln in capsys.readouterr().out.splitlines() if "hint:" in ln]
    assert hints == [f"  hint: with --tp_size 4 (tensor parallel 4 x data parallel 2) the GPU "
                     f"side would fit: {need[4] / 1024:.2f} KiB per GPU"]
    # already at tp 2: still tp 4; nothing fits: said so, naming the largest tried
    assert _json(capsys, *base, "--tp_size", "2", "--gpu_memory", gpu)["tp_hint"]["tp_size"] == 4
    assert main(["estimate", *base, "--gpu_memory", f"{need[8] - 1}B"]) == 0
    assert "  hint: even --tp_size 8 leaves the GPU side short" in capsys.readouterr().out
    # no hint when it fits, for a model without a tp plan (opt), or with --params
    opt = _json(capsys, "--model_type", "opt", "--config_overrides",
                "hidden_size=64,ffn_dim=128,num_hidden_layers=2,num_attention_heads=4,"
                "vocab_size=1000,word_embed_proj_dim=64", "--num_gpus", "8",
                "--gpu_memory", "1KiB")
    assert opt["fits"]["gpu_zero_offload"]["fits"] is False and opt["tp_hint"] is None
    assert _json(capsys, *base, "--gpu_memory", f"{need[1]}B")["tp_hint"] is None
    assert _json(capsys, "--params", "7B", "--num_gpus", "8", "--gpu_memory", "1GiB"
                 )["tp_hint"] is None


# --------------------------------------------------------- env: the switch, sizes
def _switch(out: str) -> tuple[str, str]:
    launch, plain = [ln for ln in out.splitlines() if ln.startswith("    on/off under")]
    return launch, plain


def test_env_says_what_is_on_where(tmp_path, monkeypatch, capsys):
    """prepare_zero_offload defaults to on, the Trainer's --zero_offload to off; launch
    exports HF_ZOFFLOAD_ENABLED, which both follow; under plain python the sidecar beside
    accelerate's config is not read (only one HF_ZOFFLOAD_CONFIG names)."""
    assert main(["env"]) == 0  # nothing set anywhere
    launch, plain = _switch(capsys.readouterr().out)
    assert "exports HF_ZOFFLOAD_ENABLED=true, from the default" in launch
    assert launch.endswith("prepare_zero_offload on unless the script passes enabled=; "
                           "the Trainer on unless --zero_offload false")
    assert plain.endswith("(no HF_ZOFFLOAD_ENABLED, no HF_ZOFFLOAD_CONFIG): prepare_zero_offload"
                          " on unless the script passes enabled=; the Trainer only with "
                          "--zero_offload")
    side = tmp_path / "off.yaml"
    side.write_text("zero_offload: false\n")
    assert main(["env", "--zoffload_config", str(side)]) == 0
    launch, plain = _switch(capsys.readouterr().out)
    assert f"HF_ZOFFLOAD_ENABLED=false, from zero_offload: False in {side}" in launch
    assert "prepare_zero_offload off" in launch and "Trainer off unless --zero_offload" in launch
    assert "prepare_zero_offload on" in plain  # --zoffload_config is launch's, not python's
    monkeypatch.setenv("HF_ZOFFLOAD_CONFIG", str(side))
    assert main(["env"]) == 0
    launch, plain = _switch(capsys.readouterr().out)
    assert f"(zero_offload: False in {side})" in plain and "prepare_zero_offload off" in plain
    monkeypatch.setenv("HF_ZOFFLOAD_ENABLED", "true")  # the variable wins over the sidecar
    assert main(["env"]) == 0
    launch, plain = _switch(capsys.readouterr().out)
    assert plain.endswith("(HF_ZOFFLOAD_ENABLED=true): prepare_zero_offload on unless the "
                          "script passes enabled=; the Trainer on unless --zero_offload false")


@pytest.mark.parametrize("typed,shown", [("16g", "16g (= 16.00 GiB)"),
                                         ("16GB", "16gb (= 14.90 GiB)"),  # lowercased by the plugin
                                         ("0", "0 (none set) (default)")])
def test_env_shows_sizes_in_gib_beside_what_was_typed(typed, shown, monkeypatch, capsys):
    if typed != "0":
        monkeypatch.setenv("HF_ZOFFLOAD_HOST_MEMORY_LIMIT", typed)
    assert main(["env"]) == 0
    assert f"    host_memory_limit: {shown}\n" in capsys.readouterr().out


# ------------------------------------------------------- estimate: FSDP2 parameter offload
# 999 rows of embedding and head shard unevenly over 2 ranks (500 + 499: FSDP2 pads)
FSDP2_LLAMA = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
               "num_key_value_heads=4,head_dim=16,vocab_size=999")


def test_estimate_fsdp2_offload_by_hand(capsys):
    """A tiny Llama in bf16 over 2 ranks: one fully_shard group per LlamaDecoderLayer, the
    root's group the embedding, the head and the final norm. Host per rank: FSDP2's padded
    shard (dim 0 rounded up) as the bf16 params (pinned), master 4, moments 8, landing 2;
    device: the root and two layers gathered, their grads and the root's, the larger
    reduce-scatter output's half."""
    root = 999 * 64 * 2 + 64
    layer = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    n = root + 2 * layer
    local = 2 * 500 * 64 + 32 + 2 * (4 * 32 * 64 + 2 * 64 * 64 + 32 * 128 + 2 * 32)
    assert local > n // 2  # the 999 rows' padding
    r = _json(capsys, "--model_type", "llama", "--config_overrides", FSDP2_LLAMA,
              "--compute_dtype", "bf16", "--num_gpus", "2", "--fsdp2_offload")
    assert r["fsdp2_offload"] == {"root": root, "largest": layer, "groups": 2,
                                  "layers": ["LlamaDecoderLayer"], "local": local}
    rep = r["report"]
    assert rep["n_params"] == n
    # FSDP2 pins each param's shard (CPUOffloadPolicy's default), in a power-of-two block:
    # the embedding's and the head's 500 x 64 bf16 rows (64,000 B) take 65,536
    pinned = 2 * 65_536 + 64 + 2 * (4 * 4096 + 3 * 8192 + 2 * 64)
    assert rep["host"] == {"master": 4 * local, "exp_avg": 4 * local, "exp_avg_sq": 4 * local,
                           "grad_staging": 2 * local, "grad_accumulation": 0,
                           "params": pinned}
    assert r["host_total_all_ranks"] == 2 * (14 * local + pinned)
    assert rep["device"] == {"params": 0, "gathered_root": 2 * root,
                             "gathered_groups": 2 * 2 * layer,
                             "unsharded_grads": 2 * (root + root),  # the root outweighs 2 layers
                             "reduced_grads": 2 * -(-root // 2)}
    # accumulation as the integrations run it: FSDP2 reduces every micro-step and the engine
    # sums in fp32 on the host (4 B per element of the shard); the device holds no more
    acc = _json(capsys, "--model_type", "llama", "--config_overrides", FSDP2_LLAMA,
                "--compute_dtype", "bf16", "--num_gpus", "2", "--fsdp2_offload",
                "--grad_accumulation")["report"]
    assert acc["host"]["grad_accumulation"] == 4 * local and acc["device"] == rep["device"]
    # the host rows by mode are this mode's: a bf16 master holds 2 B beside the 2 B params
    rows = {(m["master_dtype"], m["state_dtype"]): m["host_total_all_ranks"]
            for m in r["host_by_mode"]}
    assert rows[("bf16", "bf16")] == 2 * ((2 + 4 + 2) * local + pinned)
    assert main(["estimate", "--model_type", "llama", "--config_overrides", FSDP2_LLAMA,
                 "--fsdp2_offload", "--gpu_memory", "1GiB", "--host_memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert ("FSDP2 parameter offload over 1 rank(s): 2 fully_shard groups (LlamaDecoderLayer) "
            f"of at most {layer:,} params, and the root's group of {root:,}") in out
    assert "  GPU, ZeRO-Offload+FSDP2   needs" in out and "with FSDP2's sharded params):" in out


@pytest.mark.parametrize("argv, said", [
    (["--params", "7B"], "(--fsdp2_offload) needs MODEL, --model or --model_type"),
    (["--model_type", "llama", "--tp_size", "2", "--num_gpus", "2"],
     "(--fsdp2_offload) with --tp_size 2: FSDP2 on a 2-D mesh is not supported"),
    (["--model_type", "llama", "--offload_fraction", "0.5"],
     "(--fsdp2_offload) with offload_fraction '0.5': the params live on the host"),
    (["--model_type", "llama", "--offload_fraction", "auto", "--gpu_memory", "24GiB"],
     "(--fsdp2_offload) with offload_fraction 'auto'"),
])
def test_estimate_fsdp2_offload_refuses_what_the_engine_refuses(argv, said, capsys):
    assert main(["estimate", *argv, "--fsdp2_offload"]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_estimate_proposes_fsdp2_offload_when_the_gpu_is_short(capsys, monkeypatch):
    """Optimizer offload alone does not fit: the hint gives FSDP2 parameter offload's GPU
    figure (the same arithmetic as --fsdp2_offload); no hint where it fits, with --params
    (no layers to stream), or where the root outweighs the layers (nothing to gain)."""
    monkeypatch.setenv("HF_ZOFFLOAD_PIN_MEMORY", "false")
    deep = ["--model_type", "llama", "--config_overrides",
            FSDP2_LLAMA.replace("num_hidden_layers=2", "num_hidden_layers=16"),
            "--compute_dtype", "bf16"]
    zero2 = _json(capsys, *deep)["report"]["device_total"]
    fsdp2 = _json(capsys, *deep, "--fsdp2_offload")["report"]["device_total"]
    assert fsdp2 < zero2
    r = _json(capsys, *deep, "--gpu_memory", f"{fsdp2}B")
    assert r["fits"]["gpu_zero_offload"]["fits"] is False
    assert r["fsdp2_hint"] == {"need": fsdp2, "have": fsdp2, "fits": True}
    assert main(["estimate", *deep, "--gpu_memory", f"{fsdp2}B"]) == 0
    assert (f"  hint: with --fsdp2_offload (FSDP2 parameter offload) the GPU side would need "
            f"{fsdp2 / 2**20:.2f} MiB per GPU: fits") in capsys.readouterr().out
    assert _json(capsys, *deep, "--gpu_memory", f"{zero2}B")["fsdp2_hint"] is None
    assert _json(capsys, "--params", "7B", "--gpu_memory", "1GiB")["fsdp2_hint"] is None
    shallow = ["--model_type", "llama", "--config_overrides", FSDP2_LLAMA]
    assert _json(capsys, *shallow, "--gpu_memory", "1KiB")["fsdp2_hint"] is None


def test_estimate_takes_fsdp2_offload_from_accelerates_config(tmp_path, capsys):
    """The config the wizard writes (accelerate's FSDP plugin, version 2, parameters
    offloaded) turns the mode on, and the settings line says from where; another FSDP there
    is refused as the wizard refuses it; no FSDP leaves it off."""
    cfg = tmp_path / "acc.yaml"
    base = ["--model_type", "llama", "--config_overrides", FSDP2_LLAMA, "--config_file",
            str(cfg)]
    fsdp = {"fsdp_version": 2, "fsdp_offload_params": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT"}
    cfg.write_text(yaml.safe_dump({"distributed_type": "FSDP", "fsdp_config": fsdp}))
    r = _json(capsys, *base)
    assert r["settings"]["fsdp2_offload"] == {"value": True, "from": str(cfg)}
    assert r["fsdp2_offload"]["groups"] == 2 and r["report"]["host"]["params"] > 0
    assert main(["estimate", *base]) == 0
    assert f"fsdp2_offload=True ({cfg})" in capsys.readouterr().out.splitlines()[0]
    cfg.write_text(yaml.safe_dump({"distributed_type": "FSDP",
                                   "fsdp_config": {**fsdp, "fsdp_version": 1}}))
    assert main(["estimate", *base]) == 2
    assert f"accelerate's config {cfg}: FSDP version 1 with parameter offload" in \
        capsys.readouterr().err
    cfg.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU"}))
    r = _json(capsys, *base)
    assert r["settings"]["fsdp2_offload"] == {"value": False, "from": str(cfg)}
    assert r["fsdp2_offload"] is None
    assert _json(capsys, "--params", "7B")["settings"]["fsdp2_offload"] == {
        "value": False, "from": "default"}
