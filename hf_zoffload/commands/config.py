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
    enabled, plugin, chosen = ask_offload(
        mixed_precision=str(getattr(acc, "mixed_precision", "no")))
    # Same writer as `accelerate config`: json when the name says so, else yaml.
    if path.endswith(".json"):
        acc.to_json_file(path)
    else:
        acc.to_yaml_file(path)
    print(f"accelerate configuration saved at {path}")
    plugin.save_yaml(sidecar, enabled=enabled, names=chosen)
    print(f"ZeRO-Offload configuration saved at {sidecar}")
    return 0


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


def ask_offload(*, mixed_precision: str = "no") -> tuple[bool, ZeroOffloadPlugin, list[str]]:
    """The offload questions; returns (enabled, plugin, the settings the user chose)."""
    from accelerate.commands.config.config_utils import _ask_field

    enabled = _ask_field(
        "Do you want to use ZeRO-Offload (fp32 master weights and Adam states in host memory, "
        "updated by the CPU)? [YES/no]: ", _yes, default=True)
    if not enabled:
        return False, ZeroOffloadPlugin(), []
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
    ask("bucket_size_mb", "Gradient bucket size in MiB (gradients are checked and copied to the "
        "host one bucket at a time)?")
    ask("pin_memory", "Use pinned (page-locked) host buffers for the copies (CUDA only)?")
    if ask("delayed_update", "Use the delayed parameter update (the CPU step overlaps the next "
           "forward/backward, on parameters one step stale)?"):
        ask("delayed_update_warmup_steps", "How many optimizer steps without delay first?")
    ask("cpu_threads", "How many CPU threads for the CPU-Adam (0: this process's cores / "
                       "processes per node)?")
    ask("state_dtype", "In which dtype should the host keep the Adam moments "
        "(fp32/bf16/int8/int4)?")
    ask("host_memory_limit", "How much host memory may each process use for the optimizer "
        "state, with a unit (48GiB; 0: what the machine has available)?")
    if ask("offload_fraction", "Which share of the optimizer state should stay on the host, "
           "from 0 to 1 (the first layers' state is kept and updated on the GPU; auto: as "
           "much on the GPU as the first step leaves free)?") == "auto":
        ask("device_memory_limit", "How much GPU memory may auto plan with, with a unit "
            "(40GiB; 0: the GPU's total)?")
    ask("save_dtype", "Which weights should the Trainer and Accelerate paths save as the "
                      "model's: the fp32 master weights or the compute-dtype copy "
                      "(fp32/compute)?")
    if ask.answers["compute_dtype"] == "fp16" and _ask_field(
        "Do you want to customize the fp16 dynamic loss scaler? [yes/NO]: ", _yes, default=False
    ):
        ask("init_scale", "Initial loss scale?")
        ask("growth_factor", "Loss scale growth factor (> 1)?")
        ask("backoff_factor", "Loss scale backoff factor, in (0, 1)?")
        ask("growth_interval", "Clean steps before the loss scale grows?")
        ask("hysteresis", "Overflowing steps before the loss scale backs off (hysteresis)?")
        ask("min_scale", "Smallest loss scale?")
    return True, ZeroOffloadPlugin(**ask.answers), ask.chosen
