"""AdamW over fp32 state that lives on the params' device: torch's fused AdamW kernel, with the
engine's contract (that of `cpu_adam.adam_update`, over lists of tensors); its reference is
`cpu_adam.adam_update_reference`, which torch.optim.AdamW's single-tensor path writes op for op.

The buckets that ``offload_fraction`` keeps on the device run this instead of the CPU-Adam
(docs/design.md, "Device buckets"). ``torch._fused_adamw_`` takes fp32 grads of the params'
dtype, so each grad is widened and multiplied by ``grad_scale`` (the unscale and clip
coefficient, one fp32 multiply as in the CPU-Adam) first; one multi-tensor launch then updates
every master and both moments, and the new 16-bit params are the masters rounded (one foreach
copy, round to nearest even, what the CPU-Adam writes): four launches for a bucket's run on
CUDA whatever its param count. The same kernel runs on CPU tensors, which is how the test
suite exercises it; there its vector body and scalar tail may round an element differently,
so a result depends on how a run is split into tensors (the engine always splits per param).
"""

from __future__ import annotations

import torch

__all__ = ["adam_update_device"]


@torch.no_grad()
def adam_update_device(masters: list, grads: list, exp_avgs: list, exp_avg_sqs: list, *,
                       step: int, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, grad_scale: float = 1.0,
                       outs: list | None = None) -> None:
    """One decoupled-weight-decay Adam step of each flat fp32 ``masters[i]`` /
    ``exp_avgs[i]`` / ``exp_avg_sqs[i]`` (one device) from ``grads[i]`` (fp32, fp16 or bf16,
    the same device, the same length) times ``grad_scale``; ``step`` is the step count after
    this update (1 at the first). ``outs[i]`` (if given and not None) gets the new master
    rounded to its dtype. The grads are never written. Unchecked: the engine sized every
    buffer (a bad argument raises inside torch)."""
    keep = [i for i, m in enumerate(masters) if m.numel()]
    if not keep:
        return
    masters, exp_avgs, exp_avg_sqs = ([t[i] for i in keep] for t in (masters, exp_avgs,
                                                                       exp_avg_sqs))
    g32 = [grads[i] if grads[i].dtype == torch.float32 else grads[i].float() for i in keep]
    g32 = torch._foreach_mul(g32, float(grad_scale))  # new tensors: the grads stay as they are
    # The kernel reads the step count from tensors (it does not advance them on the CPU:
    # torch.optim.AdamW adds 1 before the call), fp32 as torch keeps it for fused steps.
    steps = [torch.full((), float(step), dtype=torch.float32, device=masters[0].device)
             ] * len(keep)
    torch._fused_adamw_(masters, g32, exp_avgs, exp_avg_sqs, [], steps, lr=float(lr),
                        beta1=float(beta1), beta2=float(beta2),
                        weight_decay=float(weight_decay), eps=float(eps), amsgrad=False,
                        maximize=False)
    if outs is not None:
        pairs = [(outs[i], m) for i, m in zip(keep, masters) if outs[i] is not None]
        if pairs:
            torch._foreach_copy_([o for o, _ in pairs], [m for _, m in pairs])
