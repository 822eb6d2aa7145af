"""`hf-zoffload config`: accelerate's own questions, then the ZeRO-Offload ones.

Accelerate's yaml is written by accelerate's config classes, unchanged (its loader rejects
unknown top-level keys); our settings go to a sidecar beside it, named by `sidecar_path`.

Reused accelerate internals (module functions, not documented API; pinned by
tests/commands/test_config.py::test_accelerate_wizard_internals):
``accelerate.commands.config.config.get_user_input``,
``accelerate.commands.config.config_utils._ask_field`` and
``accelerate.commands.config.default.write_basic_config``.
"""

from __future__ import annotations

import os

from hf_zoffload.config import ZeroOffloadPlugin

from .models import count_params, fsdp2_groups, model_config, parse_count

description = (
    "Ask accelerate's configuration questions, then the ZeRO-Offload ones; write accelerate's "
    "yaml unchanged and our settings to a sidecar yaml beside it (<name>_zoffload.yaml)."
)

SIDECAR_SUFFIX = "_zoffload.yaml"


def sidecar_path(accelerate_config: str) -> str:
    """``/x/default_config.yaml`` -> ``/x/default_config_zoffload.yaml``.

    Named after accelerate's file so that several accelerate configs in one folder each keep
    their own offload settings, and `hf-zoffload launch --config_file X` finds X's."""
    root, _ = os.path.splitext(os.path.abspath(os.path.expanduser(accelerate_config)))
    return root + SIDECAR_SUFFIX


def default_accelerate_config() -> str:
    """Where `accelerate config` / `accelerate launch` look when no --config_file is given."""
    from accelerate.commands.config.config_args import default_config_file

    return default_config_file


def add_parser(subparsers):
    p = subparsers.add_parser("config", help=description, description=description)
    p.add_argument("--config_file", default=None,
                   help="accelerate's yaml to write (default: accelerate's default config file); "
                        "the sidecar goes beside it.")
    p.add_argument("--default", action="store_true",
                   help="ask nothing: write accelerate's basic config (as `accelerate config "
                        "default`) and the offload defaults. Existing files are kept.")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                   help="with --default: accelerate's mixed_precision (default: no); the offload "
                        "compute dtype follows it (no: fp32).")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    if args.mixed_precision is not None and not args.default:
        raise ValueError("--mixed_precision only applies with --default (the interactive "
                         "questions ask for it)")
    path = os.path.abspath(os.path.expanduser(args.config_file or default_accelerate_config()))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sidecar = sidecar_path(path)
    if args.default:
        return _write_defaults(path, sidecar, mixed_precision=args.mixed_precision or "no")

    from accelerate.commands.config.config import get_user_input

    acc = get_user_input()
    fsdp = accelerate_fsdp(acc)
    enabled, plugin, chosen, fsdp2 = ask_offload(
        mixed_precision=str(getattr(acc, "mixed_precision", "no")),
        on_gpu=not getattr(acc, "use_cpu", False), fsdp=fsdp)
    if fsdp2 and fsdp is None:  # proposed and taken: accelerate's FSDP plugin does it
        from accelerate.utils import DistributedType

        acc.distributed_type = DistributedType.FSDP
        acc.fsdp_config = dict(FSDP2_OFFLOAD)
    # Same writer as `accelerate config`: json when the name says so, else yaml.
    if path.endswith(".json"):
        acc.to_json_file(path)
    else:
        acc.to_yaml_file(path)
    print(f"accelerate configuration saved at {path}")
    plugin.save_yaml(sidecar, enabled=enabled, names=chosen)
    print(f"ZeRO-Offload configuration saved at {sidecar}")
    if fsdp2:
        print(f"FSDP2 parameter offload: `hf-zoffload launch --config_file {path} "
              "your_script.py` runs it through accelerate's FSDP plugin; with the Trainer "
              f"pass {TRAINER_FLAGS}; `hf-zoffload estimate --config_file {path} MODEL` "
              "counts it (fsdp2_offload)")
    return 0


# accelerate's FSDP2 plugin with parameter offload, as integrations/fsdp2.py trains it: wrap
# each of the model's _no_split_modules and reshard after forward (accelerate's wizard's
# default answers), whole-tensor checkpoints (the engine's format; FSDP2's default is
# sharded) and every rank loading the model (no CPU-RAM-efficient loading), no activation
# checkpointing by the plugin.
FSDP2_OFFLOAD = {"fsdp_version": 2, "fsdp_offload_params": True,
                 "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                 "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "FULL_STATE_DICT",
                 "fsdp_cpu_ram_efficient_loading": False, "fsdp_activation_checkpointing": False}
TRAINER_FLAGS = '--fsdp --fsdp_config \'{"version": 2, "cpu_offload": true}\' --zero_offload'


def accelerate_fsdp(acc) -> dict | None:
    """accelerate's answers' FSDP config, or None when they chose no FSDP."""
    kind = getattr(acc, "distributed_type", None)
    return (acc.fsdp_config or {}) if str(getattr(kind, "value", kind)) == "FSDP" else None


def check_fsdp(fsdp: dict, *, where: str = "accelerate's answers") -> None:
    """The FSDP that ZeRO-Offload trains with is FSDP2 with parameter offload (its sharded
    params on the host, where the CPU-Adam writes them: offload/modes/fsdp2_offload.py); any
    other FSDP of accelerate's config (``where``) is refused in one line."""
    version, offload = int(fsdp.get("fsdp_version", 1)), bool(fsdp.get("fsdp_offload_params"))
    if version != 2 or not offload:
        raise ValueError(
            f"{where}: FSDP version {version} {'with' if offload else 'without'} "
            "parameter offload; ZeRO-Offload trains with FSDP only as FSDP2 parameter offload "
            "(fsdp_version 2, fsdp_offload_params true: `hf-zoffload config` asks for them); "
            "allowed: that, or no FSDP")
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    from hf_zoffload.integrations.fsdp2 import unsupported_option

    # The plugin accelerate launch builds from these answers (accelerate 1.15's defaults
    # where a key is absent: no activation checkpointing or CPU-RAM-efficient loading,
    # FSDP2's sharded checkpoints), checked by the rule the integrations apply.
    answers = type("Answers", (), {
        "activation_checkpointing": bool(fsdp.get("fsdp_activation_checkpointing")),
        "cpu_ram_efficient_loading": bool(fsdp.get("fsdp_cpu_ram_efficient_loading")),
        "ignored_modules": fsdp.get("fsdp_ignored_modules"),
        "state_dict_type": StateDictType[
            str(fsdp.get("fsdp_state_dict_type", "SHARDED_STATE_DICT")).upper()]})()
    why = unsupported_option(answers)
    if why:
        raise ValueError(f"{where}: FSDP2 with {why}")


def _accelerate_dtype(mixed_precision: str) -> str | None:
    """accelerate's mixed_precision as a compute dtype when it is fp16 or bf16, else None."""
    mp = mixed_precision.lower().rsplit(".", 1)[-1]
    return mp if mp in ("fp16", "bf16") else None


def _write_defaults(path: str, sidecar: str, *, mixed_precision: str) -> int:
    from accelerate.commands.config.default import write_basic_config

    if write_basic_config(mixed_precision, path):  # prints and keeps an existing file
        print(f"accelerate configuration saved at {path}")
    if os.path.exists(sidecar):
        print(f"ZeRO-Offload configuration already exists at {sidecar}, will not override. "
              "Run `hf-zoffload config` to change it.")
    else:
        # Only the switch: every setting keeps its default and the compute dtype follows
        # accelerate's mixed_precision at run time (a written default would pin it).
        ZeroOffloadPlugin().save_yaml(sidecar, names=[])
        print(f"ZeRO-Offload configuration saved at {sidecar}")
    return 0


# ------------------------------------------------------------------ the questions
def _shown(default) -> str:
    if isinstance(default, bool):
        return "YES/no" if default else "yes/NO"
    return str(default)


class _Asker:
    """Asks one plugin setting at a time; every answer is checked by building a
    ZeroOffloadPlugin with the answers so far, so the wizard has no rules of its own.
    ``chosen``: the settings answered with something else than the default shown, the only
    ones the sidecar gets."""

    def __init__(self):
        from accelerate.commands.config.config_utils import _ask_field

        self._ask_field = _ask_field
        self.answers: dict = {}
        self.chosen: list[str] = []

    def __call__(self, name: str, question: str, default=None):
        default = getattr(ZeroOffloadPlugin(**self.answers), name) if default is None else default

        def convert(raw: str):
            if raw.strip() == "?":
                print(f"  {name}: {ZeroOffloadPlugin.help(name)}")
                raise ValueError("help shown")
            try:
                return getattr(ZeroOffloadPlugin(**{**self.answers, name: raw}), name)
            except ValueError as err:
                print(f"  {err}. Please answer again ('?' for help).")
                raise

        # _ask_field returns `default` as is on an empty answer, and re-asks while
        # `convert` raises; error_message=None because `convert` printed the reason.
        self.answers[name] = self._ask_field(f"{question} [{_shown(default)}]: ", convert,
                                             default=default)
        if self.answers[name] != default:
            self.chosen.append(name)
        return self.answers[name]


def _yes(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("yes", "no", "y", "n"):
        print("  Please enter yes or no.")
        raise ValueError(raw)
    return value.startswith("y")


def ask_offload(*, mixed_precision: str = "no", on_gpu: bool = False,
                fsdp: dict | None = None) -> tuple[bool, ZeroOffloadPlugin, list[str], bool]:
    """The offload questions; returns (enabled, plugin, the settings the user chose, FSDP2
    parameter offload). ``on_gpu``: accelerate's answers train on GPUs, so the wizard asks
    for the model and the GPU's memory and proposes FSDP2 parameter offload where the
    16-bit weights do not fit with optimizer offload alone, and asks the GPU-only settings
    (offload_fraction, pin_memory, kernels); every other setting is asked too, the less
    common ones behind one yes/no, a bf16 master only with bf16 compute; ``fsdp``: the FSDP config
    accelerate's answers chose, if any (with ZeRO-Offload on, refused unless it is FSDP2
    parameter offload: `check_fsdp`)."""
    from accelerate.commands.config.config_utils import _ask_field

    enabled = _ask_field(
        "Do you want to use ZeRO-Offload (fp32 master weights and Adam states in host memory, "
        "updated by the CPU)? [YES/no]: ", _yes, default=True)
    if not enabled:
        return False, ZeroOffloadPlugin(), [], False
    fsdp2 = fsdp is not None
    if fsdp2:  # before any other question: one line, nothing written
        check_fsdp(fsdp)
    ask = _Asker()
    follows = _accelerate_dtype(mixed_precision)
    if follows:
        # prepare_zero_offload refuses a compute dtype that contradicts accelerate's
        # fp16/bf16: nothing to choose, and nothing written (it follows at run time).
        print(f"The parameters compute in {follows} on the device, as accelerate's "
              "mixed_precision says.")
        ask.answers["compute_dtype"] = follows
    else:
        ask("compute_dtype", "accelerate's mixed_precision is 'no'; which dtype should the "
            "parameters have on the device during forward/backward (fp32/bf16/fp16)?",
            default="fp32")
    if fsdp2:
        print("FSDP2 parameter offload, as accelerate's answers say: the parameters live on "
              "the host too, and FSDP2 brings them to the GPU one layer group at a time.")
    elif on_gpu:
        fsdp2 = ask_param_offload(_ask_field, ZeroOffloadPlugin(**ask.answers))
    # The common path: what decides the memory and the numbers. What cannot apply is not
    # asked: a bf16 master needs bf16 compute; the GPU placement and CUDA's pinned buffers
    # and Triton kernels have no meaning on CPU processes.
    ask("state_dtype", "In which dtype should the host keep the Adam moments "
        "(fp32/bf16/int8/int4)?")
    if ask.answers["compute_dtype"] == "bf16":
        ask("master_dtype", "In which dtype should the host keep the master weights (fp32; "
            "bf16: the bf16 params themselves with stochastic rounding, 2 B/param less)?")
    ask("host_memory_limit", "How much host memory may each process use for the optimizer "
        "state, with a unit (48GiB; 0: what the machine has available)?")
    if fsdp2:  # the engine refuses a fraction below 1 there (engine.py)
        print("offload_fraction stays 1: with FSDP2 parameter offload the parameters, and so "
              "all optimizer state, live on the host.")
    elif on_gpu and ask(
            "offload_fraction", "Which share of the optimizer state should stay on the host, "
            "from 0 to 1 (the first layers' state is kept and updated on the GPU; auto: as "
            "much on the GPU as the first step leaves free)?") == "auto":
        ask("device_memory_limit", "How much GPU memory may auto plan with, with a unit "
            "(40GiB; 0: the GPU's total)?")
    ask("save_dtype", "Which weights should the Trainer and Accelerate paths save as the "
                      "model's: the fp32 master weights or the compute-dtype copy "
                      "(fp32/compute)?")
    gpu_only = ", pinned buffers, kernels" if on_gpu else ""
    if _ask_field(f"Do you want to customize the advanced settings (buckets, threads{gpu_only}, "
                  "the delayed or overlapped update, clipping, the non-finite stop)? [yes/NO]: ",
                  _yes,
                  default=False):
        ask("bucket_size_mb", "Gradient bucket size in MiB (gradients are checked and copied "
            "to the host one bucket at a time)?")
        if on_gpu:
            ask("pin_memory", "Use pinned (page-locked) host buffers for the copies?")
        overlap = not fsdp2 and all(ask.answers.get(k, "fp32") == "fp32"
                                    for k in ("state_dtype", "master_dtype")) and ask(
            "overlap_step", "Start each bucket's CPU update during the step's last backward, "
            "as soon as its gradient is on the host (exact)?")
        if not overlap and ask("delayed_update", "Use the delayed parameter update (the CPU "
                               "step overlaps the next forward/backward, on parameters one "
                               "step stale)?"):
            ask("delayed_update_warmup_steps", "How many optimizer steps without delay first?")
        ask("cpu_threads", "How many CPU threads for the CPU-Adam (0: this process's cores / "
                           "processes per node)?")
        ask("bind_cores", "With several processes on a node, bind each to its share of the "
                          "physical cores?")
        if on_gpu:
            ask("kernels", "Which device kernels for the unscale, check and norm "
                           "(auto/triton/torch)?")
        ask("max_grad_norm", "Clip the global gradient norm to (0: no clipping; the Trainer "
                             "passes its own --max_grad_norm)?")
        ask("max_nonfinite_steps", "Stop the run after how many optimizer steps running with "
                                   "a non-finite loss or gradient norm (0: never)?")
    if ask.answers["compute_dtype"] == "fp16" and _ask_field(
        "Do you want to customize the fp16 dynamic loss scaler? [yes/NO]: ", _yes, default=False
    ):
        ask("init_scale", "Initial loss scale?")
        ask("growth_factor", "Loss scale growth factor (> 1)?")
        ask("backoff_factor", "Loss scale backoff factor, in (0, 1)?")
        ask("growth_interval", "Clean steps before the loss scale grows?")
        ask("hysteresis", "Overflowing steps before the loss scale backs off (hysteresis)?")
        ask("min_scale", "Smallest loss scale?")
    return True, ZeroOffloadPlugin(**ask.answers), ask.chosen, fsdp2


def gpu_needs(model: str, plugin: ZeroOffloadPlugin) -> dict:
    """GPU bytes of model states on one GPU for ``model`` (a parameter count such as 7B, a
    local config or folder, or a cached hub name): the 16-bit weights, optimizer offload's
    whole need (`memory.estimate`, what `hf-zoffload estimate` says), and FSDP2 parameter
    offload's (`memory.estimate_fsdp2`, from the model's groups; None for a bare count)."""
    from hf_zoffload.offload.memory import estimate, estimate_fsdp2

    kw = dict(compute_dtype=plugin.compute_dtype, bucket_size_mb=plugin.bucket_size_mb)
    try:
        n, cfg = parse_count(model), None
    except ValueError:  # not a count: a model
        cfg = model_config(model, flag="the model", advice="(nothing is downloaded)")
        n = count_params(cfg)
    fsdp2 = None
    if cfg is not None:
        g = fsdp2_groups(cfg)
        fsdp2 = estimate_fsdp2(n, root_params=g["root"], largest_group=g["largest"],
                               **kw)["device_total"]
    return {"n_params": n, "weights": n * plugin.torch_dtype.itemsize,
            "zero_offload": estimate(n, **kw)["device_total"], "fsdp2_offload": fsdp2}


def ask_param_offload(ask_field, plugin: ZeroOffloadPlugin) -> bool:
    """The model and the GPU's memory; where optimizer offload alone does not fit the GPU,
    the proposal of FSDP2 parameter offload (yes: the default). Empty answers skip it."""
    from hf_zoffload.config import parse_size
    from hf_zoffload.offload.memory import human

    def need(raw: str):
        if not raw.strip():
            return None
        try:
            return gpu_needs(raw.strip(), plugin)
        except ValueError as err:
            print(f"  {err}. Please answer again (empty: skip).")
            raise

    needs = ask_field("Which model will you train: a parameter count (7B), a local config or "
                      "model folder, or a cached hub name (empty: skip the GPU memory check)? "
                      "[skip]: ", need, default=None)
    if needs is None:
        return False

    def size(raw: str):
        try:
            return parse_size(raw.strip(), "the GPU's memory")
        except ValueError as err:
            print(f"  {err}. Please answer again.")
            raise

    gpu = ask_field("How much memory does one GPU have, with a unit (24GiB, 80GB)? ", size)
    if needs["zero_offload"] <= gpu:
        print(f"With optimizer offload alone the GPU holds {human(needs['zero_offload'])} of "
              f"model states ({needs['n_params']:,} params): that fits {human(gpu)} (leave "
              "room for the activations).")
        return False
    fsdp2 = needs["fsdp2_offload"]
    short = (f"The {plugin.compute_dtype} weights alone are {human(needs['weights'])}: with "
             f"optimizer offload alone the GPU would hold {human(needs['zero_offload'])}, more "
             f"than its {human(gpu)}.")
    if fsdp2 is not None and fsdp2 >= needs["zero_offload"]:  # a root group (embeddings,
        # head) that outweighs two layers: streaming the layers saves nothing
        print(f"{short} FSDP2 parameter offload would hold {human(fsdp2)} (the embeddings and "
              "head stay gathered): no gain, so it is not proposed.")
        return False
    then = "" if fsdp2 is None else f" (the GPU then holds {human(fsdp2)} of model states" + (
        ")." if fsdp2 <= gpu else ": that does not fit either).")
    print(f"{short} FSDP2 parameter offload keeps the weights on the host too and brings them "
          "to the GPU one layer group at a time"
          + (then or " (give the model's config to see what the GPU then holds)."))
    return ask_field("Use FSDP2 parameter offload (accelerate's FSDP plugin, version 2, "
                     f"parameters offloaded; the Trainer's {TRAINER_FLAGS})? [YES/no]: ",
                     _yes, default=True)

