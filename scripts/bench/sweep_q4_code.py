#!/usr/bin/env python
"""The 4-bit moment code and block size, swept on a torch reference of the int4 update (not
the compiled kernel): which levels for exp_avg and for sqrt(exp_avg_sq), and how many elements
share one fp32 scale, measured against fp32 Adam.

A candidate is (m code, u code, block): exp_avg is stored as sign + 3 bits of |m| / scale, the
square root u of exp_avg_sq as 4 bits of u / scale, the scale being the block's largest
magnitude (so the top level is exactly 1.0 and code 0 is zero, as in hf_zoffload's formats).
A code's levels are a small float with ``mbits`` mantissa bits (the kernel's family: the same
bit-level round to nearest, ties away, and flush below the lowest level) or linear (k / top).
The update is the int4 kernel's: m' = b1 m + (1-b1) g, v' = b2 v + (1-b2) g^2 from the stored
(quantized) moments, the step from m', v' with the ratio cap (docs/design.md, "Compact
moments"), then both stored quantized. Every param starts on a block, as in the engine.
`quantize` of the current code (pow2 / e3m1 of 14 levels, block 128) is bitwise
`moments.decode_reference4(encode_reference4(...))`, of the 8-bit code that of the 8-bit
reference (tests/scripts/test_sweep_q4_code.py).

Three measurements, each printed as a markdown table:
- shadow: a small Llama (2 layers, width 128, the quickstart's corpus and tokenizer, 8 x 64
  tokens a step, fp32 compute) trained ``--steps`` with torch's AdamW; every step, each
  candidate's shadow state is fed the same gradients, and its update direction
  m' / (max(sqrt(v'), |m'| / R) / sqrt(bc2) + eps) is compared with AdamW's own
  m / (sqrt(v) / sqrt(bc2) + eps): relative L2 error over all params (mean over the steps
  after the warm-up, and at the last step) and the share of elements whose update changes
  sign. Cheap: one training run for every candidate.
- train (``--train``): a training run of ``--train_steps`` per listed candidate with the
  reference optimizer, same seed and data: mean loss of the last 20 steps against AdamW's.
- speed (``--speed``): the compiled int4 update (the current code; its block size is an
  argument of the kernel) timed at each block size, ``--speed_elements`` elements, one
  thread, rounds interleaved (scripts/bench/_interleave.py). The code's own cost cannot be
  timed without a kernel per code: see docs/measurements.md.
Usage: python scripts/bench/sweep_q4_code.py [--steps 200] [--train a,b,...] [--speed]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run with runpy (the tests) rather than as a script
    sys.path.insert(0, HERE)

import _interleave as il  # noqa: E402

BETAS, EPS, LR, WD, WARMUP = (0.9, 0.999), 1e-8, 2e-3, 0.01, 30
# exact Adam's own bound |m| <= R sqrt(v) at these betas (ops.moments.ratio_cap)
R = (1 - BETAS[0]) / math.sqrt((1 - BETAS[1]) * (1 - BETAS[0] ** 2 / BETAS[1]))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64)


def _float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


@dataclass(frozen=True)
class Code:
    """The levels of |x| / scale in [0, 1]: 0 and ``top`` nonzero levels, the highest 1.0.
    ``mbits`` None: linear, level k is k / top; else a small float with ``mbits`` mantissa
    bits whose codes count up from the lowest level (the kernel's encode: an add on the
    float's bits and a shift, ties away from zero; below the lowest level it flushes to 0)."""

    name: str
    mbits: int | None
    top: int

    @property
    def bias(self) -> int:
        return (127 << self.mbits) - self.top  # code top is the float 1.0

    def lowest(self) -> float:
        """The smallest nonzero level."""
        if self.mbits is None:
            return 1.0 / self.top
        return float(_float(torch.tensor([(1 + self.bias) << (23 - self.mbits)]))[0])

    def round(self, y: torch.Tensor) -> torch.Tensor:
        """y in [0, 1] (fp32) -> the level it is stored as."""
        if self.mbits is None:
            k = torch.floor(y * self.top + 0.5).clamp(0, self.top)
            return k / self.top
        sh = 23 - self.mbits
        k = (((_bits(y) + (1 << (sh - 1))) >> sh) - self.bias).clamp(0, self.top)
        return torch.where(k > 0, _float((k + self.bias) << sh), 0.0)


# exp_avg: sign + 3 bits. pow2 is the kernel's (2^-6 .. 1); e2m1 is fp4's E2M1 shape
# (1/8 .. 1 in steps of half a binade); linear the uniform 4-bit grid's magnitudes.
M_CODES = {c.name: c for c in (Code("pow2", 0, 7), Code("e2m1", 1, 7), Code("lin", None, 7),
                                Code("e4m3", 3, 120))}  # e4m3: the 8-bit code's, 7 bits
# sqrt(exp_avg_sq): 4 bits. e3m1 (14 levels, 1.5 x 2^-7 .. 1) is the kernel's; e3m1f uses
# the 16th code too (2^-7 .. 1); e4m0 spans 15 binades, e2m2 4.
U_CODES = {c.name: c for c in (Code("e4m0", 0, 15), Code("e3m1", 1, 14), Code("e3m1f", 1, 15),
                                Code("e2m2", 2, 15), Code("lin", None, 15),
                                Code("e4m4", 4, 240))}  # e4m4: the 8-bit code's, 8 bits


@dataclass(frozen=True)
class Candidate:
    m: Code
    u: Code
    block: int

    @property
    def name(self) -> str:
        return f"{self.m.name}/{self.u.name}/{self.block}"

    def bytes_per_param(self) -> float:
        """Host bytes of both moments per element: codes + two fp32 scales per block."""
        bits = 4 if self.m.top <= 7 else 8
        return 2 * bits / 8 + 8 / self.block


def parse(name: str) -> Candidate:
    """'pow2/e3m1/128' -> the candidate; one clear error for anything else."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] not in M_CODES or parts[1] not in U_CODES or \
            not parts[2].isdigit() or int(parts[2]) < 2 or int(parts[2]) % 2:
        raise ValueError(f"a candidate is m/u/block with m one of {', '.join(M_CODES)}, u one "
                         f"of {', '.join(U_CODES)} and an even block >= 2; got {name!r}")
    return Candidate(M_CODES[parts[0]], U_CODES[parts[1]], int(parts[2]))


CURRENT = "pow2/e3m1/128"  # the kernel's (ops/moments.py, Q4BLOCK)
INT8 = "e4m3/e4m4/256"  # the 8-bit format, as a yardstick
SHADOW = [f"{m}/{u}/128" for m in ("pow2", "e2m1", "lin")
          for u in ("e4m0", "e3m1", "e3m1f", "e2m2", "lin")] + \
         [f"pow2/e3m1/{b}" for b in (32, 64, 256)] + \
         [f"lin/e3m1/{b}" for b in (32, 64, 256)] + [INT8]


def quantize(x: torch.Tensor, code: Code, block: int) -> torch.Tensor:
    """Flat fp32 ``x`` as stored: per block of ``block`` elements (the first starting at
    element 0) the scale is its largest magnitude (0 if that is subnormal, as the kernel)
    and each |x| / scale is rounded to ``code``'s levels, the sign kept (zero unsigned)."""
    n = x.numel()
    xp = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)
    s = xp.abs().amax(dim=1, keepdim=True)
    s = torch.where(s < 2.0**-126, 0.0, s)
    inv = torch.where(s == 0, 0.0, 1.0 / s)
    q = code.round(xp.abs() * inv) * s
    return torch.where((xp < 0) & (q > 0), -q, q).reshape(-1)[:n]


def store(c: Candidate, m: torch.Tensor, v: torch.Tensor):
    """fp32 moments -> the values the candidate keeps (exp_avg_sq through its square root,
    correctly rounded as the kernel's sqrtf)."""
    u = quantize(v.double().sqrt().float(), c.u, c.block)
    return quantize(m, c.m, c.block), u * u


def direction(m, v, step, capped: bool) -> torch.Tensor:
    """Adam's step per unit of lr (before weight decay) from the new moments."""
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    s = v.sqrt()
    if capped:
        s = torch.maximum(s, m.abs() / R)
    return m / (s / math.sqrt(bc2) + EPS) / bc1


class Q4Adam(torch.optim.Optimizer):
    """AdamW (decoupled decay) whose moments are stored as ``candidate`` says: the reference
    of the int4 update with the code and block as parameters."""

    def __init__(self, params, candidate: Candidate, lr=LR):
        super().__init__(params, dict(lr=lr))
        self.c = candidate

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"], st["m"], st["v"] = 0, torch.zeros(p.numel()), torch.zeros(p.numel())
                st["step"] += 1
                g = p.grad.reshape(-1).float()
                m = BETAS[0] * st["m"] + (1 - BETAS[0]) * g
                v = BETAS[1] * st["v"] + (1 - BETAS[1]) * g * g
                p.mul_(1 - group["lr"] * WD)
                p.add_(direction(m, v, st["step"], True).view_as(p), alpha=-group["lr"])
                st["m"], st["v"] = store(self.c, m, v)


def corpus():
    from hf_zoffload.integrations.defaults import stdlib_corpus, train_tokenizer

    texts = stdlib_corpus(max_mb=1.0)
    tok = train_tokenizer(texts)
    return len(tok), torch.tensor(tok("\n".join(texts))["input_ids"])


def llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=False))


def lr_at(t: int, steps: int) -> float:
    """fidelity_master_dtype.py's schedule: linear warm-up, then cosine to 0."""
    warm = min(1.0, (t + 1) / WARMUP)
    return LR * warm * 0.5 * (1 + math.cos(math.pi * max(0, t + 1 - WARMUP)
                                           / max(1, steps - WARMUP)))


def batch(ids, t: int) -> torch.Tensor:
    return ids[t % (len(ids) // 512) * 512:][:512].view(8, 64)


def shadow(ids, vocab: int, names: list[str], steps: int) -> dict:
    """AdamW trains; each candidate's shadow moments follow the same gradients."""
    model = llama(vocab)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            foreach=False)
    cands = {n: parse(n) for n in names}
    state = {n: [(torch.zeros(p.numel()), torch.zeros(p.numel())) for p in params]
             for n in names}
    err = {n: [] for n in names}
    flip = {n: [] for n in names}
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(t, steps)
        model(input_ids=batch(ids, t), labels=batch(ids, t)).loss.backward()
        opt.step()
        exact = [direction(opt.state[p]["exp_avg"].reshape(-1),
                           opt.state[p]["exp_avg_sq"].reshape(-1), t + 1, False)
                 for p in params]
        norm2 = sum(float(d.square().sum()) for d in exact)
        for n, c in cands.items():
            e2 = flips = total = 0
            for i, p in enumerate(params):
                g = p.grad.reshape(-1)
                m0, v0 = state[n][i]
                m = BETAS[0] * m0 + (1 - BETAS[0]) * g
                v = BETAS[1] * v0 + (1 - BETAS[1]) * g * g
                d = direction(m, v, t + 1, True)
                e2 += float((d - exact[i]).square().sum())
                flips += int(((d > 0) != (exact[i] > 0)).sum())
                total += d.numel()
                state[n][i] = store(c, m, v)
            err[n].append(math.sqrt(e2 / norm2))
            flip[n].append(flips / total)
        opt.zero_grad(set_to_none=True)
    later = slice(WARMUP, None) if steps > WARMUP else slice(None)
    return {n: (statistics.mean(err[n][later]), err[n][-1], statistics.mean(flip[n][later]))
            for n in names}


def train(ids, vocab: int, name: str | None, steps: int) -> float:
    """Mean loss of the last 20 of ``steps`` with the candidate (None: torch's AdamW)."""
    model = llama(vocab)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            foreach=False) if name is None else Q4Adam(params, parse(name))
    losses = []
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(t, steps)
        loss = model(input_ids=batch(ids, t), labels=batch(ids, t)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return statistics.mean(losses[-20:])


def speed(n: int, blocks: list[int], rounds: int) -> dict:
    """ms per int4 update of ``n`` elements per block size: the compiled kernel, one thread
    (fp32 master, bf16 grads in, bf16 params out)."""
    from hf_zoffload.ops import adam_kernels as ca
    from hf_zoffload.ops import moments as mo

    torch.manual_seed(0)
    rows = []
    for b in blocks:
        master, grad = torch.randn(n), torch.randn(n).to(torch.bfloat16)
        m = torch.zeros(mo.n_codes4(n), dtype=torch.uint8)
        v = torch.zeros(mo.n_codes4(n), dtype=torch.uint8)
        scales = (torch.zeros(mo.n_blocks(n, b)), torch.zeros(mo.n_blocks(n, b)))
        out = torch.empty(n, dtype=torch.bfloat16)

        def call(master=master, grad=grad, m=m, v=v, scales=scales, out=out, b=b):
            ca.adam_update_unchecked(master, grad, m, v, step=10, lr=1e-3, beta1=BETAS[0],
                                     beta2=BETAS[1], eps=EPS, weight_decay=WD, out16=out,
                                     num_threads=1, scales=scales, qblock=b,
                                     state_dtype="int4")
        rows.append((str(b), call))
    timed = il.interleave(rows, rounds)
    return {int(k): (1e3 * timed.median(k), timed.ratio(k, "128") if "128" in timed.seconds
                     else float("nan")) for k in timed.seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="shadow run steps (0: none)")
    ap.add_argument("--candidates", default=",".join(SHADOW),
                    help="comma list of m/u/block candidates for the shadow run")
    ap.add_argument("--train", default="",
                    help="comma list of candidates to train with (empty: none)")
    ap.add_argument("--train_steps", type=int, default=200)
    ap.add_argument("--speed", action="store_true", help="time the compiled int4 update")
    ap.add_argument("--speed_elements", type=int, default=4 << 20)
    ap.add_argument("--speed_blocks", default="32,64,128,256")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    try:
        names = [n for n in args.candidates.split(",") if n]
        trained = [n for n in args.train.split(",") if n]
        for n in names + trained:
            parse(n)
        blocks = [int(b) for b in args.speed_blocks.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if args.steps < 0 or (trained and args.train_steps < 20):
        ap.error("--steps must be >= 0 and --train_steps >= 20 (the loss is the last 20's mean)")
    if any(b < 2 or b % 2 or b > 4096 for b in blocks) or args.speed_elements < 1 or \
            args.rounds < 1:
        ap.error("--speed_blocks: even sizes in [2, 4096]; --speed_elements, --rounds >= 1")
    torch.set_num_threads(1)
    if args.steps and names or trained:
        vocab, ids = corpus()
    if args.steps and names:
        res = shadow(ids, vocab, names, args.steps)
        print(f"\nshadow states, {args.steps} steps of fp32 AdamW (rel. error of the update "
              f"direction against AdamW's; mean over steps {WARMUP + 1}-{args.steps}, "
              f"last step; elements whose update changes sign)\n")
        print("| m code / u code / block | moment B/param | rel. error, mean | at the last "
              "step | sign flips |")
        print("|---|---:|---:|---:|---:|")
        for n in sorted(res, key=lambda k: res[k][0]):
            mean, last, flips = res[n]
            mark = " (current)" if n == CURRENT else " (int8)" if n == INT8 else ""
            print(f"| {n}{mark} | {parse(n).bytes_per_param():.3f} | {mean:.4f} | {last:.4f} "
                  f"| {flips:.2%} |")
    if trained:
        base = train(ids, vocab, None, args.train_steps)
        print(f"\ntraining runs, {args.train_steps} steps (mean loss of the last 20)\n")
        print("| optimizer | loss | vs fp32 AdamW |")
        print("|---|---:|---:|")
        print(f"| fp32 AdamW | {base:.4f} | |")
        for n in trained:
            loss = train(ids, vocab, n, args.train_steps)
            print(f"| {n} | {loss:.4f} | {(loss - base) / base:+.2%} |", flush=True)
    if args.speed:
        res = speed(args.speed_elements, blocks, args.rounds)
        print(f"\ncompiled int4 update, {args.speed_elements} elements, 1 thread, medians of "
              f"{args.rounds} interleaved rounds\n")
        print("| block | ms | vs block 128 |")
        print("|---:|---:|---:|")
        for b, (ms, ratio) in res.items():
            print(f"| {b} | {ms:.2f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
