#!/usr/bin/env python
"""Benchmark of the one-pass CPU-Adam against its references, in one run.

Rows per (size, threads):
  ceiling            measured memory ceiling for Adam's traffic: the fastest in each round of
                     the "ceiling pass" rows, compiled passes with the kernel's flags and
                     chunking that move the 28 B/param of one Adam pass and do no math, each
                     another way: five read 4 fp32 arrays and write 3 in place (a += d; b +=
                     d; c += d; torch's shape): a plain loop, unrolled 4 times, with software
                     prefetch 512 or 2048 elements ahead, with streaming (non-temporal)
                     stores; one has the engine's shape, three fp32 arrays and one 16-bit
                     array each read and written in place (14 B read where those read 16: on
                     a core short of reads in flight it is the fastest)
  torch fused fp32   torch.optim.AdamW(fused=True), fp32 grads (28 B/param)
  torch composed     the offload path in torch: 16-bit grad copy_ into a preallocated fp32 grad,
                     fused AdamW step, copy_ of the param to 16 bit (40 B/param)
  deepspeed fp32     DeepSpeedCPUAdam, fp32 grads (only when deepspeed imports)
  deepspeed composed the same three steps around DeepSpeedCPUAdam (40 B/param)
  ours fp32          hf_zoffload adam_update, fp32 grads (28 B/param)
  ours 16-bit        hf_zoffload adam_update, 16-bit grads in, 16-bit params out (28 B/param)
  ours ... over grads  the engine's call: the new 16-bit params written over the 16-bit grads
                     just read, moments by state_dtype: fp32 (28 B/param moved), bf16 (20),
                     int8 (16 + 8 B per block of scales; one row per --qblocks block size),
                     int4 (14 + 8 B per block of 128: two code nibbles per param); with a
                     bf16 master (master_dtype bf16, stochastic rounding) and fp32 / bf16 /
                     int8 / int4 moments: 24 / 16 / 12 / 10 B (+ scales), the master read and
                     written in 2 B; a second table gives each bf16-master row against the
                     fp32-master row of the same moments, timed in the same rounds
  ours undo          the overlapped schedule's correction (ops.adam_undo): one fp32-state step
                     undone from its 16-bit grads, in place (26 B/param: the step's 28 less
                     the 16-bit output), on buffers of its own; "vs fp32 state" is the
                     engine's step of the same size against it, timed in the same rounds
  int8 ceiling       the memory ceiling of that int8 call: a compiled pass that reads and
                     writes in place the fp32 params, the 16-bit grads and the two code bytes
                     (16 B/param, no math); its "vs fp32 state" is the most bytes allow int8

The rows of one (size, threads) block are timed in rounds (scripts/bench/_interleave.py): each
of the --repeats rounds times every row once, the order rotating, so a drift in memory bandwidth
within the run falls on every row alike. ms/step is a row's median over rounds; GB/s counts
the nominal bytes above at that median; every ratio is the median over rounds of the ratio of
two calls made in the same round: "of ceiling" the row's GB/s over the ceiling's (the fraction
of the measured memory bandwidth it uses), "vs torch fused", "vs torch composed", "vs
DeepSpeed" (DeepSpeedCPUAdam fp32, a column only when deepspeed imports) and "vs fp32 state"
that reference row's ms over the row's (above 1: the row is faster).
A third table times CPUAdam, the torch.optim drop-in, against torch's fused AdamW over a
Llama's param list (TinyLlama-1.1B's 201 tensors, every width over --llama_div), in rounds too.
Usage: python scripts/bench/bench_cpu_adam.py [--sizes 10M,50M,100M] [--threads 1,2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run with runpy (the tests) rather than as a script
    sys.path.insert(0, HERE)

import _interleave as il  # noqa: E402
import _placement as pl  # noqa: E402

import hf_zoffload  # noqa: E402
from hf_zoffload.commands.env import cpu_name  # noqa: E402
from hf_zoffload.ops import adam_kernels as ca  # noqa: E402
from hf_zoffload.ops import adam_undo as au  # noqa: E402
from hf_zoffload.ops import moments as mo  # noqa: E402
from hf_zoffload.optim.cpu_adam import CPUAdam  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CEILING = "ceiling (28 B): the fastest pass below, per round"
CEILING_PASS = "ceiling pass,"
ENGINE_SHAPE = f"{CEILING_PASS} the engine's shape (fp32 x3 and 16-bit, read and written)"
TORCH_FUSED = "torch AdamW(fused) fp32"
TORCH_COMPOSED = "torch composed 16-bit"
DS_FP32 = "DeepSpeedCPUAdam fp32"
FP32_STATE = "ours fp32 state, out over grads"
UNDO = "ours undo of an fp32-state step, from 16-bit grads"
INT4_STATE = f"ours int4 state (block {mo.Q4BLOCK}), out over grads"
M16_INT4 = f"ours bf16 master + int4 state (block {mo.Q4BLOCK}), out over grads"
# (state_dtype, fp32-master row, bf16-master row): the second table compares each pair
MASTER_PAIRS = [
    ("fp32", FP32_STATE, "ours bf16 master + fp32 state, out over grads"),
    ("bf16", "ours bf16 state, out over grads", "ours bf16 master + bf16 state, out over grads"),
    ("int8", f"ours int8 state (block {mo.QBLOCK}), out over grads",
     "ours bf16 master + int8 state, out over grads"),
    ("int4", INT4_STATE, M16_INT4)]
LLAMA_OURS = "CPUAdam"
LLAMA_TORCH = "torch AdamW(fused)"
# (column, reference row): each row's "vs" column is the reference's ms over the row's
REFERENCES = [("vs torch fused", TORCH_FUSED), ("vs torch composed", TORCH_COMPOSED),
              ("vs DeepSpeed", DS_FP32), ("vs fp32 state", FP32_STATE)]


def cpu_id() -> str:
    """The CPU's model name with its family and model numbers from /proc/cpuinfo (a VM's model
    name may be only "AMD EPYC"; family 25 model 1 is Zen 3, family 25 model 17 Zen 4)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's block is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    ids = [f"{k} {fields[f]}" for k, f in (("family", "cpu family"), ("model", "model"))
           if f in fields]
    return cpu_name() + (f" ({', '.join(ids)})" if ids else "")


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def _deepspeed():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its JIT build failed
        return None
    return DeepSpeedCPUAdam


def bench(n: int, threads: int, rounds: int, grad16: torch.dtype, out16: torch.dtype,
          qblocks: list[int], variant: str = "auto") -> tuple[list[tuple[str, float]], il.Rounds]:
    """[(row, nominal B/param)] in table order, and their times over ``rounds`` rounds.

    The rows alternate, so every path's buffers live at once: 80 B/param with DeepSpeed, 72
    without (7.2 GB at 100M params; one path at a time peaked at 36), twice that for a moment
    while they are moved to memory touched in stripes (_placement.py: on a VM, buffers
    allocated one after another ran a pass 1.0-1.33x as slow). Each traffic pass gets scratch
    of its own, so its adds never reach a buffer an Adam row reads."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    g32 = torch.randn(n, generator=gen) * 1e-2
    g16 = g32.to(grad16)
    o16 = torch.empty(n, dtype=out16)  # written by rows, read by none
    ext = ca._ext()
    rows = []

    def add(name, fn, nbytes):
        rows.append((name, fn, nbytes))

    sa, sb, sc = torch.zeros(n), torch.zeros(n), torch.zeros(n)  # sums of g32: finite

    def traffic(kind):
        return lambda: ext.traffic_pass(sa.data_ptr(), sb.data_ptr(), sc.data_ptr(),
                                        g32.data_ptr(), n, threads, kind)

    for way, kind in ext.TRAFFIC_KINDS.items():  # CEILING: the fastest of them in each round
        add(f"{CEILING_PASS} {way}", traffic(kind), 28)
    # the engine's shape: three fp32 streams and o16 (read by no Adam row), read and written
    add(ENGINE_SHAPE, lambda: ext.traffic_pass16(sa.data_ptr(), sb.data_ptr(), sc.data_ptr(),
                                                 o16.data_ptr(), n, threads), 28)

    param = torch.nn.Parameter(p.clone())
    param.grad = g32.clone()
    opt = torch.optim.AdamW([param], lr=HP["lr"], weight_decay=HP["weight_decay"], fused=True)
    add(TORCH_FUSED, opt.step, 28)

    def composed(step):
        def run():
            param.grad.copy_(g16)
            step()
            o16.copy_(param.detach())
        return run

    add(TORCH_COMPOSED, composed(opt.step), 40)
    ds_cls = _deepspeed()
    if ds_cls is not None:  # steps the same param as torch, with moments of its own
        ds = ds_cls([param], lr=HP["lr"], weight_decay=HP["weight_decay"], adamw_mode=True)
        add(DS_FP32, ds.step, 28)
        add("DeepSpeedCPUAdam composed 16-bit", composed(ds.step), 40)

    step = [0]

    def ours(grad, out):
        def run():
            step[0] += 1
            ca._update(p, grad, m, v, step=step[0], out16=out, num_threads=threads,
                       variant=variant, **HP)
        return run

    add("ours fp32", ours(g32, None), 28)
    add("ours 16-bit grad in + 16-bit out", ours(g16, o16), 28)
    g = g16.to(out16)  # the engine's buffer: grads in, new params out, one dtype
    add(FP32_STATE, ours(g, g), 28)
    # The undo's own state (14 B/param): a state Adam could reach (|m| <= sqrt(v)) and grads
    # of 1e-2, so that undoing over and over stays finite and off the subnormals for
    # hundreds of rounds (m - g grows by 1 / beta1 a call, v drifts by 1e-7).
    pu, gu = p.clone(), g16.to(out16)
    mu = torch.randn(n, generator=gen) * 1e-3
    vu = mu * mu * 2 + 1e-6
    k_undo = au.undo_coefficients(10, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"],
                                  HP["weight_decay"], 1.0)
    add(UNDO, lambda: au.adam_undo_unchecked(pu, gu, mu, vu, k_undo, first=False,
                                             num_threads=threads, variant=variant), 26)
    mb, vb = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)

    def compact(mm, vv, scales=None, qblock=mo.QBLOCK, state_dtype=None):
        def run():
            step[0] += 1
            ca.adam_update_unchecked(p, g, mm, vv, step=step[0], out16=g, num_threads=threads,
                                     variant=variant, scales=scales, qblock=qblock,
                                     state_dtype=state_dtype, **HP)
        return run

    add("ours bf16 state, out over grads", compact(mb, vb), 20)
    mc, vc = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    all_scales = []
    for qb in qblocks:
        scales = (torch.zeros(-(-n // qb)), torch.zeros(-(-n // qb)))
        all_scales += scales
        add(f"ours int8 state (block {qb}), out over grads", compact(mc, vc, scales, qb),
            16 + 16 / qb)
    m4, v4 = (torch.zeros(mo.n_codes4(n), dtype=torch.uint8) for _ in range(2))
    s4 = (torch.zeros(mo.n_blocks(n, mo.Q4BLOCK)), torch.zeros(mo.n_blocks(n, mo.Q4BLOCK)))
    add(INT4_STATE, compact(m4, v4, s4, mo.Q4BLOCK, "int4"), 14 + 16 / mo.Q4BLOCK)
    p16 = p.to(torch.bfloat16)  # a bf16 master: the new params also go to the grad buffer
    g16b = g.to(torch.bfloat16)

    def master16(mm, vv, scales, state_dtype):
        def run():
            step[0] += 1
            ca.adam_update_unchecked(p16, g16b, mm, vv, step=step[0], out16=g16b, variant=variant,
                                     num_threads=threads, scales=scales,
                                     state_dtype=state_dtype, sr=(step[0], 0), **HP)
        return run

    add("ours bf16 master + fp32 state, out over grads", master16(m, v, None, "fp32"), 24)
    add("ours bf16 master + bf16 state, out over grads", master16(mb, vb, None, "bf16"), 16)
    sq = (torch.zeros(-(-n // mo.QBLOCK)), torch.zeros(-(-n // mo.QBLOCK)))
    add("ours bf16 master + int8 state, out over grads",
        master16(mc, vc, sq, "int8"), 12 + 16 / mo.QBLOCK)
    add(M16_INT4, master16(m4, v4, s4, "int4"), 10 + 16 / mo.Q4BLOCK)
    # Its fp32 "params" are the ceiling's first scratch array and its 16-bit "grads" o16, both
    # read by no Adam row, its codes two byte arrays of its own. It adds 1 to each: the scratch
    # grows by ~1 a round (and g32's ~0.01 from the ceiling), finite and never subnormal (a
    # subnormal operand can cost an add a microcode assist); the integers wrap.
    cm, cv = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    add("int8 ceiling (read 8, write 8)", lambda: ext.traffic_pass_q8(
        sa.data_ptr(), o16.data_ptr(), cm.data_ptr(), cv.data_ptr(), n, threads), 16)
    for _, fn, _ in rows:  # creates the optimizers' state, moved with the rest below
        fn()
    states = [t for o in ([opt, ds] if ds_cls is not None else [opt])
              for t in o.state[param].values() if isinstance(t, torch.Tensor)]
    pl.restripe([p, m, v, g32, g16, o16, sa, sb, sc, param, param.grad, *states, g, pu, gu,
                 mu, vu, mb, vb, mc, vc, *all_scales, m4, v4, *s4, p16, g16b, *sq, cm, cv])
    timed = il.interleave([(name, fn) for name, fn, _ in rows], rounds)
    ways = [name for name, _, _ in rows if name.startswith(CEILING_PASS)]
    best = [min(timed.seconds[w][r] for w in ways) for r in range(rounds)]
    timed = il.Rounds({CEILING: best, **timed.seconds}, timed.orders)
    return [(CEILING, 28)] + [(name, nbytes) for name, _, nbytes in rows], timed


def llama_shapes(div: int) -> list[tuple[int, ...]]:
    """TinyLlama-1.1B's 201 params (22 layers of two norms, q, k, v, o with 4 of 32 heads for k
    and v, gate, up, down; the embedding, the final norm, the head) with every width over
    ``div``: the same tensor count and proportions, 1.1G / div**2 params."""
    h, inter, kv, vocab = 2048 // div, 5632 // div, 256 // div, 32000 // div
    shapes = [(vocab, h)]
    for _ in range(22):
        shapes += [(h,), (h, h), (kv, h), (kv, h), (h, h), (h,), (inter, h), (inter, h),
                   (h, inter)]
    return shapes + [(h,), (vocab, h)]


def bench_llama(div: int, threads: int, rounds: int) -> tuple[int, int, il.Rounds]:
    """CPUAdam (the torch.optim drop-in) against torch's fused AdamW over llama_shapes(div),
    fp32 grads, each with params of its own: (tensors, params, timings)."""
    torch.set_num_threads(threads)
    shapes = llama_shapes(div)
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, theirs):
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
        q.grad = p.grad.clone()
    opts = {LLAMA_OURS: CPUAdam(ours, lr=HP["lr"], weight_decay=HP["weight_decay"]),
            LLAMA_TORCH: torch.optim.AdamW(theirs, lr=HP["lr"], weight_decay=HP["weight_decay"],
                                           fused=True)}
    for opt in opts.values():  # creates the state, moved with the params (_placement.py)
        opt.step()
    pl.restripe([t for opt in opts.values() for p, st in opt.state.items()
                 for t in (p, p.grad, *st.values()) if isinstance(t, torch.Tensor)])
    timed = il.interleave([(name, opt.step) for name, opt in opts.items()], rounds)
    return len(shapes), sum(p.numel() for p in ours), timed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10M,50M,100M", help="comma list, K/M/G suffixes")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--repeats", type=int, default=5,
                    help="rounds, each timing every row once in rotating order (medians)")
    ap.add_argument("--grad_dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--out_dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--qblocks", default=str(mo.QBLOCK),
                    help="comma list of int8 block sizes (powers of two, 16..4096) to time")
    ap.add_argument("--llama_div", type=int, default=8,
                    help="the CPUAdam table's param list: TinyLlama-1.1B's 201 tensors, every "
                         "width over this (8: 17M params; 0: no such table)")
    ap.add_argument("--variant", default="auto",
                    help="the compiled variant of our rows (auto, generic, native, avx2, "
                         "avx512bf16: what this build and CPU have)")
    args = ap.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    qblocks = [int(b) for b in args.qblocks.split(",")]
    if args.repeats < 1 or min(threads) < 1 or min(sizes) < 1:
        ap.error("--repeats, --threads and --sizes must be positive")
    if any(b < 16 or b > 4096 or b & (b - 1) for b in qblocks):
        ap.error(f"--qblocks: powers of two from 16 to 4096, got {args.qblocks}")

    ext = ca._ext()
    if args.variant not in ext.VARIANTS or not ext.variant_available(ext.VARIANTS[args.variant]):
        have = [v for v in ext.VARIANTS if ext.variant_available(ext.VARIANTS[v])]
        ap.error(f"--variant {args.variant}: not in this build or CPU; here: {', '.join(have)}")
    ds = _deepspeed()
    feats = ca.compiled_features()
    isa = ", ".join(k for k in ("avx2", "f16c", "avx512f", "avx512_bf16") if feats[k]) or "none"
    print(f"# CPU-Adam benchmark\n\nCPU: {cpu_id()}, {os.cpu_count()} logical CPUs, load "
          f"average {os.getloadavg()[0]:.1f} at the start; "
          f"Python {platform.python_version()}; torch {torch.__version__}; "
          f"hf_zoffload {hf_zoffload.__version__} (kernel "
          f"{ext.auto_variant() if args.variant == 'auto' else args.variant}"
          f"{': ' + isa if args.variant == 'auto' else ''}; "
          f"OpenMP {'on' if feats['openmp'] else 'off'}); deepspeed "
          f"{__import__('deepspeed').__version__ if ds else 'not installed'}.  "
          f"16-bit rows: {args.grad_dtype} grads, {args.out_dtype} params out.\n")
    refs = [(col, ref) for col, ref in REFERENCES if ds is not None or ref != DS_FP32]
    print(f"Rounds per block: {args.repeats}, each timing every row once, the order rotating; "
          "ms/step is a row's median over rounds, each ratio the median of its per-round "
          "ratios.\n")
    print("| params | threads | path | B/param | ms/step | Mparams/s | GB/s | of ceiling | "
          + " | ".join(col for col, _ in refs) + " |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(refs))
    pairs = []  # the second table's rows
    for n in sizes:
        for t in threads:
            rows, timed = bench(n, t, args.repeats, DTYPES[args.grad_dtype],
                                DTYPES[args.out_dtype], qblocks, args.variant)
            for name, nbytes in rows:
                ms = timed.median(name) * 1e3
                # GB/s over the ceiling's in each round: B/param over 28, times its ms over ours
                of_ceiling = nbytes / 28 * timed.ratio(CEILING, name)
                vs = " | ".join(f"{timed.ratio(ref, name):.2f}" for _, ref in refs)
                print(f"| {n / 1e6:g}M | {t} | {name} | {nbytes:g} | {ms:.2f} | "
                      f"{n / ms / 1e3:.0f} | {n * nbytes / ms / 1e6:.1f} | {of_ceiling:.2f} | "
                      f"{vs} |", flush=True)
            nbytes = dict(rows)
            pairs += [f"| {n / 1e6:g}M | {t} | {state} | {nbytes[f32]:g} / {nbytes[b16]:g} | "
                      f"{timed.ratio(f32, b16):.2f} |" for state, f32, b16 in MASTER_PAIRS
                      if f32 in nbytes]
    print("\nbf16 master against fp32 master over the same moments: the fp32-master row's ms "
          "over the bf16-master row's, the median of per-round ratios (above 1: the bf16 "
          "master is faster).\n\n| params | threads | state_dtype | B/param fp32 / bf16 "
          "master | vs fp32 master |\n|---:|---:|---|---:|---:|")
    print("\n".join(pairs))
    if args.llama_div > 0:
        if 2048 % args.llama_div or 5632 % args.llama_div or 256 % args.llama_div:
            ap.error("--llama_div must divide TinyLlama's widths 2048, 5632 and 256")
        print(f"\nCPUAdam over TinyLlama-1.1B's param list with every width over "
              f"{args.llama_div}, fp32 grads, against torch's fused AdamW, {args.repeats} "
              f"rounds: ms/step the median, \"vs torch fused\" the median of per-round ratios "
              f"of torch's ms over ours (above 1: ours is faster).\n\n| tensors | params | "
              f"threads | CPUAdam ms | torch fused ms | vs torch fused |\n|---:|---:|---:|---:|"
              f"---:|---:|")
        for t in threads:
            k, n, timed = bench_llama(args.llama_div, t, args.repeats)
            print(f"| {k} | {n / 1e6:.1f}M | {t} | {timed.median(LLAMA_OURS) * 1e3:.2f} | "
                  f"{timed.median(LLAMA_TORCH) * 1e3:.2f} | "
                  f"{timed.ratio(LLAMA_TORCH, LLAMA_OURS):.2f} |", flush=True)
    print(f"\nLoad average {os.getloadavg()[0]:.1f} at the end.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
