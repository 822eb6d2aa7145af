"""Model-state memory: the estimate before training and the report format shared with the engine.

`estimate()` (used by `hf-zoffload estimate`) and `ZeroOffloadOptimizer.memory_report()` return
the same structure, and `format_report()` prints either, so the two always agree on what is
counted: model states only (parameters, gradients, master weights, Adam moments, staging
buffers), never activations.
"""

from __future__ import annotations

from .host import plan_blocks

_MIB = 1024**2
_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}

# Plain mixed-precision AdamW keeps fp32 params, fp32 grads and two fp32 moments on the
# device: 4 + 4 + 8 = 16 B/param (torch AMP autocast; ZeRO paper's "16 bytes" with fp32
# grads). That is the number users compare against.
PLAIN_AMP_ADAMW_BYTES_PER_PARAM = 16


def estimate(
    n_params: int,
    *,
    compute_dtype: str = "bf16",
    bucket_size_mb: float = 32.0,
    world_size: int = 1,
    n_frozen: int = 0,
    grad_accumulation: bool = False,
    delayed_update: bool = False,
    pinned: bool = False,
) -> dict:
    """Bytes of model states with ZeRO-Offload for ``n_params`` trainable parameters.

    Device: the ``compute_dtype`` parameters (frozen ones too) plus up to two gradient
    buckets in flight. Host, per rank: fp32 master weights and both moments for this rank's
    ``1/world_size`` shard (12 B/param), the 16-bit gradient and parameter staging buffers,
    the fp32 accumulation buffer when gradients are accumulated over micro-steps, and a
    second gradient staging buffer for the delayed update. ``pinned``: the staging buffers
    are page-locked, held as the engine's pool holds them (host.py: power-of-two blocks of
    whole buckets), with buckets of ``bucket_size_mb`` each.
    """
    if n_params < 0 or n_frozen < 0:
        raise ValueError("n_params and n_frozen must be >= 0")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if compute_dtype not in _DTYPE_BYTES:
        raise ValueError(f"compute_dtype {compute_dtype!r}; allowed: fp16, bf16, fp32")
    w = _DTYPE_BYTES[compute_dtype]
    shard = -(-n_params // world_size)  # ceil: the largest shard
    bucket = int(bucket_size_mb * _MIB) // 2 * w  # bucket_size_mb counts 16-bit grads
    device = {
        "params": (n_params + n_frozen) * w,
        "grad_buckets": min(2 * bucket, n_params * w),
    }
    def staged(nbytes_per_param: int) -> int:  # one pool kind over every bucket's shard
        if not pinned or not shard:
            return nbytes_per_param * shard
        per = max(1, int(bucket_size_mb * _MIB) // 2)  # params per bucket
        sizes = [-(-min(per, n_params - i) // world_size) * nbytes_per_param
                 for i in range(0, n_params, per)]
        return sum(cap for cap, _ in plan_blocks(sizes, pinned=True))

    host = {
        "master": 4 * shard,
        "exp_avg": 4 * shard,
        "exp_avg_sq": 4 * shard,
        "grad_staging": staged(w) * (2 if delayed_update else 1),
        "param_staging": staged(w) if w != 4 else 0,
        "grad_accumulation": 4 * shard if grad_accumulation else 0,
    }
    return _finish(device, host, n_params=n_params, n_frozen=n_frozen, compute_dtype=w)


def _finish(device: dict, host: dict, *, n_params: int, n_frozen: int, compute_dtype: int):
    return {
        "n_params": n_params,
        "n_frozen": n_frozen,
        "device": device,
        "host": host,
        "device_total": sum(device.values()),
        "host_total": sum(host.values()),
        "plain_adamw_device_total": PLAIN_AMP_ADAMW_BYTES_PER_PARAM * n_params
        + compute_dtype * n_frozen,
    }


def make_report(device: dict, host: dict, *, n_params: int, n_frozen: int, param_bytes: int):
    """Wrap measured byte counts (from the engine) in the structure `estimate()` returns."""
    return _finish(device, host, n_params=n_params, n_frozen=n_frozen, compute_dtype=param_bytes)


_POOL_KINDS = {"grad16": "grad_staging", "grad32": "grad_staging", "staging": "param_staging",
               "unreduced16": "unreduced", "unreduced32": "grad_accumulation"}


def engine_report(opt) -> dict:
    """`ZeroOffloadOptimizer.memory_report()`: the bytes the engine holds, measured from its
    public facts (``buckets``' layouts and host states, ``host_pool``, ``n_frozen``,
    ``dtype``, ``device``). Pooled host buffers count as the blocks allocated for them (for
    pinned memory, the power-of-two blocks torch's allocator holds).

    With N ranks the host side is this rank's: its shards, about 1/N of the state, plus the
    full-bucket buffers of accumulation without a collective when that is used. On a
    CPU-only run the "device" is host memory too: the params and the full-bucket gradient
    buffers backward writes are counted under device, as on a GPU, so the host side
    compares across machines."""
    host = dict.fromkeys(("master", "exp_avg", "exp_avg_sq", "grad_staging", "param_staging",
                          "grad_accumulation"), 0)
    for b in opt.buckets:
        for kind, n in b.state.nbytes().items():
            host[kind] += n
    unreduced = 0
    for kind, n in opt.host_pool.held().items():
        name = _POOL_KINDS[kind[0]]
        if name == "unreduced":
            unreduced += n
        else:
            host[name] += n
    w = opt.dtype.itemsize
    on_cuda = opt.device.type == "cuda"
    largest = max(b.layout.padded for b in opt.buckets) * w
    # each trainable param has its own storage (no flat bucket buffer holds them)
    trained = sum(s.param.numel() * s.param.element_size() for b in opt.buckets
                  for s in b.layout.slots)
    # unreduced micro-steps: host memory behind device buffers on CUDA; on the CPU the very
    # buffers backward writes, so counted as the device's gradient buckets
    if on_cuda:
        host["grad_staging"] += unreduced
    device = {"params": trained + opt.n_frozen * w,
              "grad_buckets": min(2 * largest, trained) if on_cuda else unreduced}
    n = sum(b.layout.numel for b in opt.buckets)
    report = make_report(device, host, n_params=n, n_frozen=opt.n_frozen, param_bytes=w)
    pool = opt.host_pool
    report["host_pinning"] = ("pageable: " + pool.pageable_reason if pool.pageable_reason
                              else "pinned" if pool.pin else "not pinned")
    return report


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_report(report: dict) -> str:
    """Human-readable lines for a report from `estimate()` or `memory_report()`."""
    lines = [f"model states for {report['n_params']:,} trainable parameters"
             + (f" (+{report['n_frozen']:,} frozen)" if report["n_frozen"] else "")]
    for side in ("device", "host"):
        parts = ", ".join(f"{k} {human(v)}" for k, v in report[side].items() if v)
        lines.append(f"  {side:<6} {human(report[side + '_total']):>12}  ({parts})")
    lines.append(
        f"  plain AMP AdamW would need {human(report['plain_adamw_device_total'])} on the device"
    )
    if report.get("host_pinning", "").startswith("pageable"):
        lines.append(f"  host buffers are {report['host_pinning']}: copies do not overlap")
    return "\n".join(lines)
