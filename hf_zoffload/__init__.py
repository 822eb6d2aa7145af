"""ZeRO-Offload for the Hugging Face stack.

fp32 master weights and Adam moments live in host memory and are updated there by a
compiled one-pass CPU-Adam; the GPU keeps 16-bit parameters and runs forward/backward.
"""

from importlib import import_module

__version__ = "0.1.0"

# Public names, resolved lazily so that `import hf_zoffload` does not import
# transformers or triton (about 3 s on 2 cores) for users of the bare optimizer.
# What users reach for: the three ways in (a Trainer, or any Trainer subclass through the two
# factories; Accelerate; a plain loop), the settings,
# the parallelism config the integrations take, and the memory estimator. Internals (the
# loss scaler, the exchanges) stay in their modules.
_EXPORTS = {
    "CPUAdam": "hf_zoffload.optim.cpu_adam",
    "ParallelismConfig": "hf_zoffload.integrations.parallel",
    "ZeroOffloadPlugin": "hf_zoffload.config",
    "ZeroOffloadOptimizer": "hf_zoffload.offload.engine",
    "ZeroOffloadTrainingArguments": "hf_zoffload.integrations.trainer",
    "ZeroOffloadTrainer": "hf_zoffload.integrations.trainer",
    "estimate": "hf_zoffload.offload.memory",
    "format_report": "hf_zoffload.offload.memory",
    "prepare_zero_offload": "hf_zoffload.integrations.accelerate",
    "zero_offload_args": "hf_zoffload.integrations.arguments",
    "zero_offload_trainer": "hf_zoffload.integrations.trainer",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hf_zoffload' has no attribute {name!r}")


def __dir__():
    return __all__
