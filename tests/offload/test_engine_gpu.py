"""The engine on CUDA: side stream, pinned buffers, Triton kernels (scripts/gpu_check.sh)."""

import copy

import pytest
import torch

from hf_zoffload import ZeroOffloadOptimizer, ZeroOffloadPlugin
from tests._tiny import batches, decay_groups, tiny_gpt2

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,module_waits", [("bf16", False), ("fp32", False),
                                                ("bf16", True)])
def test_cuda_matches_cpu_engine(dtype, module_waits):
    """``module_waits``: the GPU engine gets ``model=``, so each module's forward waits only
    for its own params' uploads (the host runs ahead of the device here, so a missing wait
    reads params still on their way)."""
    data = batches(4)
    cpu_model = tiny_gpt2()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    plugin = dict(compute_dtype=dtype, bucket_size_mb=0.01, max_grad_norm=0.5)
    cpu_opt = ZeroOffloadOptimizer(decay_groups(cpu_model), lr=3e-3,
                                   plugin=ZeroOffloadPlugin(**plugin))
    gpu_opt = ZeroOffloadOptimizer(decay_groups(gpu_model), lr=3e-3,
                                   plugin=ZeroOffloadPlugin(**plugin),
                                   model=gpu_model if module_waits else None)
    assert (gpu_opt.module_waits is not None) == module_waits
    assert gpu_opt.copier.streams.pinned and gpu_opt.buckets[0].state.grads.grad16.is_pinned()
    for step in range(6):
        for micro in range(2):
            ids = data[(2 * step + micro) % len(data)]
            cpu_opt.backward(cpu_model(input_ids=ids, labels=ids).loss)
            gpu_opt.backward(gpu_model(input_ids=ids.cuda(), labels=ids.cuda()).loss)
        cpu_opt.step()
        gpu_opt.step()
        # fp32: CUDA and CPU matmuls sum in other orders (~1e-6 relative per output); a
        # bucket missing from the norm would be off by >1%. bf16: every activation and grad
        # is rounded to 8 bits (2^-8 relative) by kernels that differ between devices.
        assert gpu_opt.grad_norm == pytest.approx(
            cpu_opt.grad_norm, rel=1e-4 if dtype == "fp32" else 3e-2)
    gpu_opt.flush()  # the device waits for the last uploads before the reads below
    # GPU matmuls differ from CPU ones at the compute dtype's rounding
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == "bf16" else dict(atol=1e-4, rtol=1e-3)
    for a, b in zip(cpu_model.parameters(), gpu_model.parameters()):
        torch.testing.assert_close(b.cpu(), a, **tol)


def test_fp16_overflow_on_cuda_skips():
    model = tiny_gpt2().cuda()
    opt = ZeroOffloadOptimizer(model.parameters(), plugin=ZeroOffloadPlugin(
        compute_dtype="fp16", hysteresis=1, init_scale=1024.0, bucket_size_mb=0.01))
    ids = batches(1)[0].cuda()
    w = model.transformer.h[0].mlp.c_fc.weight
    h = w.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=g.device), float("nan")))
    # Per param: the first step moves the host state into arrival order (reorder.py), so
    # the buckets' concatenated masters hold the same values in another order after it.
    params = list(model.parameters())
    before = [opt.host_views(p)["master"].clone() for p in params]
    opt.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    assert opt.last_step_skipped and opt.loss_scaler.loss_scale == 512.0
    assert opt.relayout_seconds is not None  # the state did move
    for p, b in zip(params, before):
        assert torch.equal(opt.host_views(p)["master"], b)
    h.remove()
    opt.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    assert not opt.last_step_skipped


def test_peak_device_memory_is_about_two_bytes_per_param():
    from transformers import GPT2Config, GPT2LMHeadModel

    # Bytes the tensors asked for: each param has its own storage, and memory_allocated()
    # also counts the slack of a large cached block the allocator hands out unsplit (up to
    # 1 MiB per param, depending on what was freed before, as with model.to(bf16)). All
    # figures are differences: earlier tests in the process hold memory of their own.
    def requested(kind):
        return torch.cuda.memory_stats()[f"requested_bytes.all.{kind}"]

    torch.cuda.synchronize()
    before = requested("current")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=512, n_layer=8, n_head=8, vocab_size=8192,
                                       n_positions=128)).cuda()
    n = sum(p.numel() for p in model.parameters())
    bucket_mb = 4.0
    opt = ZeroOffloadOptimizer(model.parameters(), plugin=ZeroOffloadPlugin(
        compute_dtype="bf16", bucket_size_mb=bucket_mb))
    torch.cuda.synchronize()
    # params alone: 2 B/param (the fp32 copy is gone)
    assert requested("current") - before <= 2 * n + 4096
    ids = torch.randint(0, 8192, (1, 8), device="cuda")
    # One step first: cuBLAS keeps a workspace per handle and stream for the process
    # (32 MiB each on sm_90, main and autograd threads), allocated by the first matmuls.
    opt.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = requested("current")
    for _ in range(2):
        opt.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
    torch.cuda.synchronize()
    # Activations of a batch of 8 tokens are < 1 MiB here; the rest is model states. A
    # leaked full gradient copy would add 2 B/param (~2x n bytes).
    states_peak = requested("peak") - base
    budget = 0.1 * n + 3 * bucket_mb * 2**20 + 8 * 2**20
    assert states_peak <= budget, (states_peak, budget)
