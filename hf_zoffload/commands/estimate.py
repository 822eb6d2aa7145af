"""`hf-zoffload estimate`: model-state memory with and without ZeRO-Offload, and whether it fits.

The figures come from `hf_zoffload.offload.memory.estimate` and print with its
`format_report`, the same code behind the engine's run-time `memory_report()`.
"""

from __future__ import annotations

import json
import os

from ..config import MASTER_DTYPES, STATE_DTYPES, parse_size
from .config import accelerate_fsdp, check_fsdp, default_accelerate_config
from .launch import SIDECAR_HELP, find_sidecar
from .models import count_params, fsdp2_groups, model_config, parse_count, split_params

description = (
    "Estimate model-state memory (GPU and host) with ZeRO-Offload and with plain AMP AdamW "
    "(16 B/param on the GPU), and whether it fits. Activations are not counted."
)

def add_parser(subparsers):
    p = subparsers.add_parser("estimate", help=description, description=description)
    src = p.add_mutually_exclusive_group(required=True)
    # The positional is --model under another name (dest model_path: sharing --model's dest,
    # an absent positional would overwrite a given --model with None).
    src.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="the same as --model: a local model folder with config.json, a "
                          "config file, or a cached hub name")
    src.add_argument("--params", help="trainable parameter count: 7B, 124M, 1.5e9, ...")
    src.add_argument("--model", help="a local config.json or model folder, or a hub name "
                                     "already in the local cache (no network is used)")
    src.add_argument("--model_type", help="a transformers model type (gpt2, llama, ...) with "
                                          "its default config, changed by --config_overrides")
    p.add_argument("--config_overrides", default=None,
                   help="comma-separated config changes, e.g. n_layer=2,n_embd=64")
    p.add_argument("--frozen_params", default="0", help="frozen parameters (kept on the GPU)")
    p.add_argument("--num_gpus", type=int, default=1, help="processes, one per GPU (default 1)")
    p.add_argument("--gpu_memory", default=None,
                   help="memory of one GPU, with a unit (24GiB, 80GB, ...): with it the "
                        "figures say whether they fit")
    p.add_argument("--host_memory", default=None,
                   help="host memory of the machine, with a unit (256GiB, ...): with it "
                        "the figures say whether they fit")
    p.add_argument("--compute_dtype", default=None, choices=["fp16", "bf16", "fp32"],
                   help="default: the effective ZeRO-Offload config")
    p.add_argument("--bucket_size_mb", type=float, default=None,
                   help="default: the effective ZeRO-Offload config")
    p.add_argument("--delayed_update", action="store_true", default=None,
                   help="count the delayed update's second gradient staging buffer")
    p.add_argument("--overlap_step", action="store_true", default=None,
                   help="count the overlapped step's second gradient staging buffer (the "
                        "gradients kept for a correction while the early updates' new "
                        "params wait)")
    p.add_argument("--state_dtype", default=None, choices=STATE_DTYPES,
                   help="how the Adam moments are stored on the host (default: the effective "
                        "ZeRO-Offload config); the host verdict is printed for every mode")
    p.add_argument("--master_dtype", default=None, choices=MASTER_DTYPES,
                   help="how the master weights are stored on the host (default: the effective "
                        "ZeRO-Offload config); bf16 needs compute_dtype bf16, and its host "
                        "rows are printed when the compute dtype is bf16")
    p.add_argument("--offload_fraction", default=None,
                   help="share of the optimizer state kept on the host, 0 to 1, or auto "
                        "(default: the effective ZeRO-Offload config); the rest is counted "
                        "on the GPU. auto: what it would pick for --gpu_memory (or "
                        "device_memory_limit) with the model states counted here")
    p.add_argument("--tp_size", type=int, default=1,
                   help="tensor-parallel size: the params the model's tp plan shards count "
                        "1/tp per rank (needs MODEL, --model or --model_type); --num_gpus / "
                        "tp_size ranks share each shard as data parallel")
    p.add_argument("--fsdp2_offload", action="store_true",
                   help="FSDP2 parameter offload (fully_shard with CPUOffloadPolicy, the "
                        "Trainer's --fsdp \"full_shard offload\", accelerate's FSDP plugin "
                        "with fsdp_version 2 and cpu_offload): the params live on the host "
                        "too and FSDP2 streams them to the GPU group by group, one group per "
                        "layer of the model's _no_split_modules (needs MODEL, --model or "
                        "--model_type); --num_gpus ranks shard them. Also on when "
                        "accelerate's config (--config_file) chooses that FSDP plugin")
    p.add_argument("--grad_accumulation", action="store_true",
                   help="count the buffers of micro-step accumulation (one process: an "
                        "fp32 sum per grad set; N ranks: whole unreduced buckets too)")
    p.add_argument("--json", action="store_true", help="print the figures as json, in bytes")
    p.add_argument("--config_file", default=None,
                   help="accelerate's config, to find the sidecar beside it as `hf-zoffload "
                        "launch` and `env` do (default: accelerate's default config file)")
    p.add_argument("--zoffload_config", default=None, help=SIDECAR_HELP)
    p.set_defaults(func=run)
    return p


def _model(args) -> tuple[str | None, str]:
    """(the model given, --model or the positional; the name to quote it by)."""
    if args.model_path is not None:
        return args.model_path, "MODEL"
    return args.model, "--model"


def _model_config(args):
    model, flag = _model(args)
    return model_config(model, flag=flag, model_type=args.model_type,
                        overrides=args.config_overrides)


def fsdp2_layout(args) -> tuple[bool, str]:
    """Whether the figures are FSDP2 parameter offload's, and who said so: ``--fsdp2_offload``,
    or accelerate's config (``--config_file``, else accelerate's default file, where `hf-zoffload
    config` writes it) choosing its FSDP plugin. An FSDP there that ZeRO-Offload cannot train
    is refused in one line, as the wizard refuses it (`config.check_fsdp`)."""
    if args.fsdp2_offload:
        return True, "--fsdp2_offload"
    path = args.config_file or default_accelerate_config()
    if not os.path.isfile(path):
        return False, "default"
    from accelerate.commands.config.config_args import load_config_from_file

    fsdp = accelerate_fsdp(load_config_from_file(path))
    if fsdp is None:
        return False, path
    check_fsdp(fsdp, where=f"accelerate's config {path}")
    return True, path


def check_fsdp2(plugin, *, tp: int, params_only: bool, named_by: str) -> None:
    """What the engine refuses with FSDP2 parameter offload (offload/modes/fsdp2_offload.py,
    engine.py), refused here in one line, before a model is built; ``named_by``: who chose
    the mode."""
    what = f"FSDP2 parameter offload ({named_by})"
    if params_only:
        raise ValueError(f"{what} needs MODEL, --model or --model_type: the GPU side comes "
                         "from the model's layers (FSDP2 streams one group per layer)")
    if tp > 1:
        raise ValueError(f"{what} with --tp_size {tp}: FSDP2 on a 2-D mesh is not supported "
                         "(only a 1-D shard mesh); allowed: --tp_size 1")
    if plugin.offload_fraction_value != 1.0:
        raise ValueError(f"{what} with offload_fraction {plugin.offload_fraction!r}: the "
                         "params live on the host, so all optimizer state does; allowed: 1")


def _fit(need: int, have: int | None) -> dict | None:
    if have is None:
        return None
    return {"need": need, "have": have, "fits": need <= have, "headroom": have - need}


# The settings the figures depend on, shown with where each came from.
SHOWN_SETTINGS = ("state_dtype", "master_dtype", "compute_dtype", "bucket_size_mb",
                  "delayed_update", "overlap_step", "pin_memory", "offload_fraction")
FLAGS = ("compute_dtype", "bucket_size_mb", "delayed_update", "overlap_step", "state_dtype",
         "master_dtype", "offload_fraction")


def effective_plugin(args, environ=None):
    """The ZeRO-Offload settings `env` calls effective (the sidecar found as `launch` finds
    it, then HF_ZOFFLOAD_* variables), under this command's explicit flags; and
    {setting: where its value came from} for SHOWN_SETTINGS."""
    from hf_zoffload.config import CONFIG_ENV, ZeroOffloadPlugin, env_values, read_yaml

    env = dict(os.environ if environ is None else environ)
    sidecar = find_sidecar(zoffload_config=args.zoffload_config, config_file=args.config_file,
                           environ=env)
    if sidecar:
        env[CONFIG_ENV] = sidecar
    overrides = {k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None}
    plugin = ZeroOffloadPlugin.from_sources(environ=env, **overrides)
    from_yaml = read_yaml(sidecar, named_by=CONFIG_ENV) if sidecar else {}
    from_env = env_values(env)
    where = {}
    for k in SHOWN_SETTINGS:  # highest precedence first, as from_sources merges them
        where[k] = ("--" + k if k in overrides else f"HF_ZOFFLOAD_{k.upper()}"
                    if k in from_env else sidecar if k in from_yaml else "default")
    return plugin, where


def auto_pick(n: int, world: int, *, peak: int, have: int, param_bytes: int,
              accumulates: bool, delayed: bool) -> dict:
    """What `offload_fraction: auto` would keep on the host: the engine's arithmetic
    (`fraction.auto_budget`) with ``peak`` the device bytes of everything on the host."""
    from hf_zoffload.offload.fraction import SAFETY_MARGIN, auto_budget, per_element

    shard = -(-n // world)
    per = per_element(param_bytes, accumulates=accumulates, delayed=delayed)
    budget = auto_budget(peak, have)
    on_device = min(shard, budget // per)
    return {"fraction": 1.0 - on_device / shard if shard else 1.0, "budget": budget,
            "have": have, "peak": peak, "bytes_per_element": per, "margin": SAFETY_MARGIN}


def compute(args) -> dict:
    from hf_zoffload.offload.memory import estimate_fsdp2
    from hf_zoffload.offload.memory import estimate_with_fraction as estimate

    # Sizes first: a typo there fails before a model is built from its config.
    gpu = parse_size(args.gpu_memory, "--gpu_memory") if args.gpu_memory else None
    host = parse_size(args.host_memory, "--host_memory") if args.host_memory else None
    plugin, where = effective_plugin(args)
    if args.num_gpus < 1 or args.tp_size < 1 or args.num_gpus % args.tp_size:
        raise ValueError(f"--num_gpus ({args.num_gpus}) must be a positive multiple of "
                         f"--tp_size ({args.tp_size})")
    tp = args.tp_size
    if tp > 1 and args.params:
        raise ValueError("--tp_size needs MODEL, --model or --model_type: which params are "
                         "sharded comes from the model's tensor-parallel plan")
    fsdp2, fsdp2_from = fsdp2_layout(args)
    if fsdp2:
        check_fsdp2(plugin, tp=tp, params_only=bool(args.params), named_by=fsdp2_from)
    cfg = None if args.params else _model_config(args)
    split = None
    if tp > 1:
        sharded, replicated = split_params(cfg)
        n = -(-sharded // tp) + replicated  # this rank's local elements
        split = {"sharded": sharded, "replicated": replicated, "per_rank": n}
    else:
        n = parse_count(args.params) if args.params else count_params(cfg)
    count, frozen = n, parse_count(args.frozen_params)
    # FSDP2's groups: for the mode, or for the hint that proposes it when the GPU is short
    groups = fsdp2_groups(cfg, args.num_gpus) if cfg is not None and tp == 1 and (
        fsdp2 or gpu is not None) else None

    fraction = plugin.offload_fraction_value  # None: auto, decided below
    common = dict(compute_dtype=plugin.compute_dtype, bucket_size_mb=plugin.bucket_size_mb,
                  n_frozen=frozen, grad_accumulation=args.grad_accumulation,
                  delayed_update=plugin.delayed_update)

    def fsdp2_for(state_dtype, n=n, master_dtype=plugin.master_dtype):
        # FSDP2's pinned shards (CPUOffloadPolicy's default, on a GPU machine), by param; for
        # another size (the largest that fits) each of the model's scaled to it
        shards = groups["shards"] if n == count else [-(-k * n // count)
                                                      for k in groups["shards"]]
        return estimate_fsdp2(n, root_params=groups["root"], largest_group=groups["largest"],
                              shard_numels=shards, pinned=True, world_size=args.num_gpus,
                              state_dtype=state_dtype, master_dtype=master_dtype, **common)

    def report_for(state_dtype, n=n, tp=tp, fraction=None, master_dtype=plugin.master_dtype):
        if fsdp2:
            return fsdp2_for(state_dtype, n, master_dtype)
        return estimate(n, world_size=args.num_gpus // tp, pinned=plugin.pin_memory,
                        state_dtype=state_dtype, master_dtype=master_dtype,
                        overlap_step=plugin.overlap_step,
                        offload_fraction=1.0 if fraction is None else fraction, **common)

    picked = None
    have = plugin.device_memory_limit_bytes or gpu
    if fraction is None and have:
        picked = auto_pick(n, args.num_gpus // tp,
                           peak=report_for(plugin.state_dtype)["device_total"], have=have,
                           param_bytes=plugin.torch_dtype.itemsize,
                           accumulates=args.grad_accumulation, delayed=plugin.delayed_update)
        picked["from"] = "device_memory_limit" if plugin.device_memory_limit_bytes \
            else "--gpu_memory"
        fraction = picked["fraction"]
    report = report_for(plugin.state_dtype, fraction=fraction)
    # Every rank keeps its own shard on the one host: the machine holds num_gpus of them.
    host_all = report["host_total"] * args.num_gpus
    # every (master_dtype, state_dtype) this compute dtype allows (a bf16 master: bf16 only)
    pairs = [(ma, st) for ma in MASTER_DTYPES for st in STATE_DTYPES
             if ma == "fp32" or plugin.compute_dtype == "bf16"]

    def all_ranks(ma, st, k=n):
        return report_for(st, k, fraction=fraction, master_dtype=ma)["host_total"] \
            * args.num_gpus

    # per-rank local elements are not a model size under tensor parallelism: no largest there
    by_mode = [{"master_dtype": ma, "state_dtype": st, "host_total_all_ranks": all_ranks(ma, st),
                "largest_n_params": _largest_fit(lambda k, ma=ma, st=st: all_ranks(ma, st, k),
                                                 host) if host is not None and tp == 1 else None}
               for ma, st in pairs]
    for row in by_mode:
        row["fit"] = _fit(row["host_total_all_ranks"], host)
    mine = [r for r in by_mode if r["master_dtype"] == plugin.master_dtype]
    settings = {k: {"value": getattr(plugin, k), "from": where[k]} for k in SHOWN_SETTINGS}
    settings["fsdp2_offload"] = {"value": fsdp2, "from": fsdp2_from}
    gpu_fit = _fit(report["device_total"], gpu)
    hint = fsdp2_hint = None
    if gpu_fit and not gpu_fit["fits"] and cfg is not None and not fsdp2:
        hint = _tp_hint(cfg, split, gpu, args.num_gpus, tp,
                        lambda n, t: report_for(plugin.state_dtype, n, t,
                                                fraction)["device_total"])
        need = None if groups is None else fsdp2_for(plugin.state_dtype)["device_total"]
        if need is not None and need < report["device_total"]:  # a smaller model's root can
            # outweigh its layers: then streaming them saves nothing, and there is no hint
            fsdp2_hint = {"need": need, "have": gpu, "fits": need <= gpu}
    return {
        "settings": settings, "report": report, "num_gpus": args.num_gpus, "tp_size": tp,
        "tp_split": split, "host_total_all_ranks": host_all,
        "fsdp2_offload": {k: v for k, v in groups.items() if k != "shards"} if fsdp2 else None,
        "fits": {"gpu_zero_offload": gpu_fit,
                 "gpu_plain_adamw": _fit(report["plain_adamw_device_total"], gpu),
                 "host_zero_offload": _fit(host_all, host)},
        "host_by_state_dtype": {r["state_dtype"]: {k: r[k] for k in (
            "host_total_all_ranks", "fit", "largest_n_params")} for r in mine},
        "host_by_mode": by_mode,
        "tp_hint": hint,
        "fsdp2_hint": fsdp2_hint,
        "auto": picked if plugin.offload_fraction == "auto" else None,
        "auto_unsized": plugin.offload_fraction == "auto" and picked is None,
    }


def _largest_fit(host_need, have: int) -> int:
    """The most trainable params whose host need (``host_need(n)``, non-decreasing in n)
    fits in ``have`` bytes: a bisection (every mode needs at least the 2 B/param gradient
    landing buffer, so ``have // 2`` is an upper bound)."""
    lo, hi = 0, have // 2 + 1  # host_need(lo) fits; host_need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if host_need(mid) <= have else (lo, mid)
    return lo


def format_count(n: int) -> str:
    """1_234_567_890 -> '1.23B' (parse_count's suffixes)."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _tp_hint(cfg, split, gpu: int, num_gpus: int, tp: int, device_total) -> dict | None:
    """The GPU side does not fit at ``tp``: the smallest larger tp size (a power of two that
    divides ``num_gpus``, as tp plans shard heads and widths evenly by those) with which it
    would, by the model's own tp plan; ``{"tp_size": None, ...}`` when even the largest does
    not, and None when the model has no tp plan (nothing to suggest)."""
    if split is None:
        try:
            sharded, replicated = split_params(cfg)
        except ValueError:  # no tp plan
            return None
    else:
        sharded, replicated = split["sharded"], split["replicated"]
    candidates = [t for t in (2 ** k for k in range(1, num_gpus.bit_length()))
                  if t > tp and num_gpus % t == 0]
    if not candidates:
        return None
    for t in candidates:
        need = device_total(-(-sharded // t) + replicated, t)
        if need <= gpu:
            return {"tp_size": t, "need": need, "have": gpu}
    return {"tp_size": None, "largest_tried": candidates[-1], "need": need, "have": gpu}


def format_settings(result: dict) -> str:
    """One line: each setting the figures used, and where it came from."""
    return "settings: " + ", ".join(f"{k}={s['value']} ({s['from']})"
                                    for k, s in result["settings"].items())


def format_fits(result: dict) -> str:
    from hf_zoffload.offload.memory import human

    n = result["num_gpus"]
    lines = [f"  host, all {n} processes together: {human(result['host_total_all_ranks'])}"] \
        if n > 1 else []
    split = result.get("tp_split")
    if split:
        lines.append(f"tensor parallel {result['tp_size']} x data parallel "
                     f"{n // result['tp_size']}: {split['sharded']:,} params sharded by the "
                     f"model's tp plan, {split['replicated']:,} replicated; each rank holds "
                     f"{split['per_rank']:,} (the figures above are per rank)")
    groups = result.get("fsdp2_offload")
    if groups:
        lines.append(f"FSDP2 parameter offload over {n} rank(s): {groups['groups']} fully_shard "
                     f"groups ({', '.join(groups['layers']) or 'none'}) of at most "
                     f"{groups['largest']:,} params, and the root's group of {groups['root']:,}")
        lines.append("  the GPU holds the root's params (kept gathered) and two groups' (the "
                     "one computing and the next, which torch 2.13 gathers ahead), with their "
                     f"grads; each rank's host holds its {groups['local']:,} elements of "
                     "FSDP2's padded shards")
    way = "ZeRO-Offload+FSDP2" if groups else "ZeRO-Offload"
    labels = {"gpu_zero_offload": f"GPU, {way}", "gpu_plain_adamw": "GPU, plain AMP AdamW",
              "host_zero_offload": f"host, {way}"}
    fits = {k: v for k, v in result["fits"].items() if v}
    if fits:
        lines.append("fits? (model states only: activations, CUDA context and allocator slack "
                     "need room too)")
    width = 1 + max(len(v) for v in labels.values())
    for key, f in fits.items():
        verdict = "fits" if f["fits"] else "DOES NOT FIT"
        lines.append(f"  {labels[key]:<{width}} needs {human(f['need']):>11} of "
                     f"{human(f['have'])}: {verdict}, headroom {human(f['headroom'])}")
    fsdp2 = result.get("fsdp2_hint")
    if fsdp2:
        lines.append(f"  hint: with --fsdp2_offload (FSDP2 parameter offload) the GPU side "
                     f"would need {human(fsdp2['need'])} per GPU: "
                     + ("fits" if fsdp2["fits"] else "DOES NOT FIT either"))
    hint = result.get("tp_hint")
    if hint and hint["tp_size"]:
        t = hint["tp_size"]
        lines.append(f"  hint: with --tp_size {t} (tensor parallel {t} x data parallel {n // t}) "
                     f"the GPU side would fit: {human(hint['need'])} per GPU")
    elif hint:
        lines.append(f"  hint: even --tp_size {hint['largest_tried']} leaves the GPU side short: "
                     f"{human(hint['need'])} per GPU")
    auto = result.get("auto")
    if auto:
        lines.append(f"offload_fraction auto would keep {auto['fraction']:.3f} of the "
                     f"optimizer state on the host: {human(auto['have'])} ({auto['from']}) "
                     f"less {auto['margin']:.0%} less the {human(auto['peak'])} above leaves "
                     f"{human(auto['budget'])} at {auto['bytes_per_element']} B/element "
                     "(a run measures its activations too, so it keeps more on the host)")
    elif result.get("auto_unsized"):
        lines.append("offload_fraction auto: counted as 1 (all on the host); give "
                     "--gpu_memory to see what it would pick")
    lines.append("host by mode (master weights and Adam moments" + (
        ", with FSDP2's sharded params):" if groups else "):"))
    for m in result["host_by_mode"]:
        f = m["fit"]
        verdict = "" if f is None else \
            f": {'fits' if f['fits'] else 'DOES NOT FIT'}, headroom {human(f['headroom'])}"
        most = "" if m["largest_n_params"] is None else \
            f"; largest that fits: {format_count(m['largest_n_params'])} params"
        lines.append(f"  master_dtype={m['master_dtype']:<4} state_dtype={m['state_dtype']:<4} "
                     f"needs {human(m['host_total_all_ranks']):>11}" + verdict + most)
    return "\n".join(lines)


def run(args) -> int:
    from hf_zoffload.offload.memory import format_report

    result = compute(args)  # a bad value: one line (commands/errors.py)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        text = format_fits(result)
        print(format_settings(result) + "\n" + format_report(result["report"])
              + ("\n" + text if text else ""))
    return 0
