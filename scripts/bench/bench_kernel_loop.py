#!/usr/bin/env python
"""Per-param compute of the CPU-Adam kernel, without Python in the loop.

Compiles a small C driver against cython_ext/adam_kernel.h with the extension's flags (cc,
-O3 -fno-math-errno -ffp-contract=off -march=native), then times the engine's call (bf16 grads
in, bf16 params written over them, weight decay on) on one thread over a buffer small enough to
stay in cache, for every (master_dtype, state_dtype) mode: an fp32 or a bf16 master (rounded
stochastically) with fp32, bf16, int8 or int4 moments. Each round times every mode --calls times
in turn, the order rotating from round to round as in scripts/bench/_interleave.py; a mode's
figure is its fastest call over all rounds, in ns per param. The rounds run in the C driver,
not through _interleave: the point is a loop without Python (a call over the 64K params is ~30
us), and in cache the memory drift that _interleave's medians guard against does not reach the
kernel, so the fastest call, the least disturbed one, is the figure (disturbances only add
time); with --elements past the caches (10M) the figure is a single thread's memory-bound time.
It prints no ratio between modes (the docs derive them from the figures).
With --instructions it counts instead of timing: instructions per param inside the kernel, from
valgrind's callgrind (the same under any load; blind to memory stalls). Valgrind runs no
AVX-512, so on a CPU with it the counts are of the driver built with -mno-avx512f (the AVX2
code, as on a CPU without it) and the table's header says so; the timing is the native code.
With --kinds as well it splits each count by kind (`kinds`): vector ALU work, the divider
(vsqrtps, vdivps), vector loads and stores, scalar instructions.
With --clock it also measures the core (`clock`): its clock under this load, from a chain of
dependent integer multiplies (three cycles each), and the throughput of vsqrtps and vdivps on 8 fp32
lanes (the two divider ops the update takes per 8 params), alone and interleaved, in cycles;
the timing table then gives cycles per param too.  A virtual machine seldom lets perf count
cycles, so this is how the docs turn ns into cycles.  Where the CPU has AVX-512 it also times
two 16-lane vsqrtps or vdivps, 16 independent vpsrld, and each pair interleaved: above the
slower of the two alone, the divider's ops hold a port the shifts need (port 0 on Intel).
With --ports (CPUs with AVX-512 only) it times instead each zmm op of the coded pass
(`port_ops`): 16 independent ones alone, then beside 16 vpsrld and beside 16 vpshufb, and
says from the pairs' cycles which of the two ops' ports it shares (on Intel's AVX-512 cores,
where zmm work has ports 0 and 5 alone, the shifts take port 0 and the shuffles port 5), or
that it goes to either, or takes from both.
Usage: python scripts/bench/bench_kernel_loop.py [--elements 65536] [--calls 3000] [--rounds 5]
       [--instructions [--kinds]] [--clock] [--ports]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# setup.py BASE_FLAGS and its native build (no OpenMP: the driver runs one thread)
FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-march=native"]
STATES = {"fp32": 0, "bf16": 2, "int8": 4, "int4": 5}  # adam_kernel.h's HZ_F32, .., HZ_Q4
QBLOCKS = {"int8": 256, "int4": 128}  # ops/moments.py's QBLOCK, Q4BLOCK
# (name, master_dtype, state_dtype), in the order the driver takes them
MODES = [(f"{master} master, {state} state", master, state)
         for master in ("fp32", "bf16") for state in STATES]

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "adam_kernel.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* argv: elements calls rounds, then per mode: state_kind qblock master_kind */
int main(int argc, char **argv) {
    size_t n = strtoull(argv[1], NULL, 10);
    int calls = atoi(argv[2]), rounds = atoi(argv[3]), modes = (argc - 4) / 3;
    hz_adam_args *a = calloc(modes, sizeof *a);
    double *best = malloc(modes * sizeof *best);
    hz_range_fn fn = hz_select(HZ_AUTO);
    srand(1);
    for (int s = 0; s < modes; ++s) {
        int kind = atoi(argv[4 + 3 * s]), qb = atoi(argv[5 + 3 * s]);
        int master = atoi(argv[6 + 3 * s]);
        float *p = aligned_alloc(64, n * 4);
        uint16_t *p16 = aligned_alloc(64, n * 2), *g = aligned_alloc(64, n * 2);
        void *m = aligned_alloc(64, n * 4), *v = aligned_alloc(64, n * 4);
        float *ms = calloc(n / qb + 1, 4), *vs = calloc(n / qb + 1, 4);
        memset(m, 0, n * 4);
        memset(v, 0, n * 4);
        for (size_t i = 0; i < n; ++i) {
            p[i] = rand() / (float)RAND_MAX - 0.5f;
            p16[i] = hz_float_to_bf16(p[i]);
            g[i] = hz_float_to_bf16((rand() / (float)RAND_MAX - 0.5f) * 1e-2f);
        }
        hz_adam_args x = {0};
        x.param = p; x.exp_avg = m; x.exp_avg_sq = v; x.m_scale = ms; x.v_scale = vs;
        x.grad = g; x.out16 = g; x.grad_kind = HZ_BF16; x.out_kind = HZ_BF16;
        x.state_kind = kind; x.qblock = qb; x.lerp_small = 1;
        x.grad_scale = 1.0f; x.decay = 1.0f - 1e-3f * 0.01f; x.lerp_coef = 0.1f;
        x.beta1 = 0.9f; x.one_minus_beta1 = 0.1f; x.beta2 = 0.999f;
        x.one_minus_beta2 = 0.001f; x.sqrt_beta2 = sqrtf(0.999f); x.inv_bc2_sqrt = 1.0f;
        x.eps = 1e-8f; x.neg_step = -1e-3f; x.inv_ratio_cap = 1.0f / 7.27f;
        x.master_kind = master; x.master16 = p16; x.sr_key = 12345u;
        a[s] = x;
        best[s] = 1e30;
    }
    for (int r = 0; r < rounds; ++r)
        for (int i = 0; i < modes; ++i) {
            int s = (r + i) % modes; /* round r starts at mode r mod modes */
            for (int c = 0; c < calls; ++c) {
                a[s].sr_key += 1u; /* a new Adam step's key, as the engine's */
                double t0 = now();
                fn(&a[s], 0, n);
                double dt = now() - t0;
                if (dt < best[s]) best[s] = dt;
            }
        }
    for (int s = 0; s < modes; ++s) printf("%d %.4f\n", s, best[s] / n * 1e9);
    return 0;
}
"""


# The probes' clock: this core's GHz under load.
CLOCK = r"""
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* 4 dependent imuls per iteration, 3 cycles each (Intel since Core 2, AMD Zen 1-4): 12 cycles.
 * A chain of add $1 is not a clock on every core: the Xeon of family 6 model 167 ran it at 16
 * "GHz" (the renamer folds immediate adds), where add reg, reg and this chain both gave 4.04
 * GHz. */
static double clock_ghz(void) {
    long n = 100000000, x = 1, y = 3;
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
        double t = now();
        for (long i = 0; i < n; ++i)
            __asm__ volatile("imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0"
                             : "+r"(x) : "r"(y));
        t = now() - t;
        if (t < best) best = t;
    }
    return 12.0 * n / best / 1e9;
}
"""


PROBE = CLOCK + r"""

static const float ONE_HALF[8] = {1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 1.5f};

/* Eight independent chains of the op on ymm0-7 per iteration (more chains than its latency
 * over its throughput, so the time per op is its throughput), written in asm so that no
 * compiler spills or reorders them.  sqrt of sqrt converges to 1 and 1.5 / x alternates
 * between x and 1.5 / x: no subnormal operand. */
#define SQRT8 "vsqrtps %%ymm0,%%ymm0\n vsqrtps %%ymm1,%%ymm1\n vsqrtps %%ymm2,%%ymm2\n" \
    "vsqrtps %%ymm3,%%ymm3\n vsqrtps %%ymm4,%%ymm4\n vsqrtps %%ymm5,%%ymm5\n"              \
    "vsqrtps %%ymm6,%%ymm6\n vsqrtps %%ymm7,%%ymm7\n"
#define DIV8 "vdivps %%ymm0,%%ymm8,%%ymm0\n vdivps %%ymm1,%%ymm8,%%ymm1\n"                \
    "vdivps %%ymm2,%%ymm8,%%ymm2\n vdivps %%ymm3,%%ymm8,%%ymm3\n"                          \
    "vdivps %%ymm4,%%ymm8,%%ymm4\n vdivps %%ymm5,%%ymm8,%%ymm5\n"                          \
    "vdivps %%ymm6,%%ymm8,%%ymm6\n vdivps %%ymm7,%%ymm8,%%ymm7\n"
#define INIT "vmovups (%1),%%ymm8\n vmovaps %%ymm8,%%ymm0\n vmovaps %%ymm8,%%ymm1\n"       \
    "vmovaps %%ymm8,%%ymm2\n vmovaps %%ymm8,%%ymm3\n vmovaps %%ymm8,%%ymm4\n"              \
    "vmovaps %%ymm8,%%ymm5\n vmovaps %%ymm8,%%ymm6\n vmovaps %%ymm8,%%ymm7\n"
/* The fastest of 3 runs of n iterations of body after init (data: its operand in memory). */
#define TIME_WITH(init, data, body, out)                                                  \
    for (int r = 0; r < 3; ++r) {                                                         \
        long i = n;                                                                       \
        double t = now();                                                                 \
        __asm__ volatile(init "1:\n" body "dec %0\n jnz 1b\n"                             \
                         : "+r"(i) : "r"(data)                                            \
                         : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", \
                           "xmm6", "xmm7", "xmm8");                                       \
        t = now() - t;                                                                    \
        if (t < out) out = t;                                                             \
    }
#define TIME(body, out) TIME_WITH(INIT, ONE_HALF, body, out)

#ifdef __AVX512F__
static const float ONE_HALF16[16] = {1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 1.5f,
                                     1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 1.5f, 1.5f};
#define ZSQRT2 "vsqrtps %%zmm0,%%zmm0\n vsqrtps %%zmm1,%%zmm1\n"
#define ZDIV2 "vdivps %%zmm0,%%zmm8,%%zmm0\n vdivps %%zmm1,%%zmm8,%%zmm1\n"
#define ZSRL4 "vpsrld $1,%%zmm2,%%zmm2\n vpsrld $1,%%zmm3,%%zmm3\n"                           \
    "vpsrld $1,%%zmm4,%%zmm4\n vpsrld $1,%%zmm5,%%zmm5\n"
#define ZSRL16 ZSRL4 ZSRL4 ZSRL4 ZSRL4
#define ZINIT "vmovups (%1),%%zmm8\n vmovaps %%zmm8,%%zmm0\n vmovaps %%zmm8,%%zmm1\n"       \
    "vpxord %%zmm2,%%zmm2,%%zmm2\n vpxord %%zmm3,%%zmm3,%%zmm3\n"                           \
    "vpxord %%zmm4,%%zmm4,%%zmm4\n vpxord %%zmm5,%%zmm5,%%zmm5\n"
#define TIMEZ(body, out) TIME_WITH(ZINIT, ONE_HALF16, body, out)
#endif

int main(void) {
    double ghz = clock_ghz(), sq = 1e30, dv = 1e30, both = 1e30;
    long n = 10000000;
    TIME(SQRT8, sq)
    TIME(DIV8, dv)
    TIME(SQRT8 DIV8, both)  /* one after the other: do they share a unit? */
    double per = 1e9 * ghz / (8.0 * n);  /* seconds -> cycles per op (8 ops an iteration) */
    printf("%.4f %.3f %.3f %.3f", ghz, sq * per, dv * per, both * per);
#ifdef __AVX512F__
    /* 16 lanes: two chains of the op an iteration, 16 independent vpsrld (4 chains), and
     * both: what the op leaves of the ports the shifts need (on Intel zmm shifts take port 0
     * only, where the divider sits) */
    double zs = 1e30, zd = 1e30, zr = 1e30, zsr = 1e30, zdr = 1e30;
    TIMEZ(ZSQRT2, zs)
    TIMEZ(ZDIV2, zd)
    TIMEZ(ZSRL16, zr)
    TIMEZ(ZSQRT2 ZSRL16, zsr)
    TIMEZ(ZDIV2 ZSRL16, zdr)
    per = 1e9 * ghz / n;  /* cycles per iteration */
    printf(" %.3f %.3f %.3f %.3f %.3f", zs * per, zd * per, zr * per, zsr * per, zdr * per);
#endif
    printf("\n");
    return 0;
}
"""


ZMM = ("2 vsqrtps", "2 vdivps", "16 vpsrld", "2 vsqrtps + 16 vpsrld", "2 vdivps + 16 vpsrld")


def clock() -> dict[str, float]:
    """{"ghz": this core's clock now, "sqrt": cycles per vsqrtps of 8 lanes, "div": per
    vdivps, "sqrt+div": per pair, the two interleaved (their sum where they share one unit)}
    (PROBE), and where -march=native has AVX-512, "zmm": {ZMM's names: cycles} of 16-lane ops:
    two vsqrtps or vdivps, 16 independent vpsrld, and each pair of them interleaved (above the
    slower alone: the two contend for a port); raises RuntimeError where it does not build (no
    C compiler, no AVX)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc, or $CC) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.c", Path(tmp) / "probe"
        src.write_text(PROBE)
        build = subprocess.run([cc, "-O2", "-march=native", str(src), "-o", str(exe)],
                               capture_output=True, text=True)
        if build.returncode:
            raise RuntimeError(f"the clock probe did not build (it needs AVX):\n{build.stderr}")
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    ghz, sq, div, both, *zmm = (float(x) for x in out.split())
    got = {"ghz": ghz, "sqrt": sq, "div": div, "sqrt+div": both}
    if zmm:
        got["zmm"] = dict(zip(ZMM, zmm, strict=True))
    return got


# (name, the AT&T template with {r} the op's own register (zmm0-15), the CPU flag it needs)
# zmm16 / zmm17 hold its other operands; k1 takes a mask result, k2 is all ones.
PORT_OPS = (
    ("vmulps", "vmulps %%zmm16,%%zmm{r},%%zmm{r}", "avx512f"),
    ("vfmadd231ps", "vfmadd231ps %%zmm16,%%zmm17,%%zmm{r}", "avx512f"),
    ("vmaxps", "vmaxps %%zmm16,%%zmm{r},%%zmm{r}", "avx512f"),
    ("vpaddd", "vpaddd %%zmm16,%%zmm{r},%%zmm{r}", "avx512f"),
    ("vpternlogd", "vpternlogd $0x96,%%zmm16,%%zmm17,%%zmm{r}", "avx512f"),
    ("vpord (masked)", "vpord %%zmm16,%%zmm{r},%%zmm{r}%{{%%k2%}}", "avx512f"),
    ("vpmulld", "vpmulld %%zmm16,%%zmm{r},%%zmm{r}", "avx512f"),
    ("vpmaddubsw", "vpmaddubsw %%zmm16,%%zmm{r},%%zmm{r}", "avx512bw"),
    ("vpsrld", "vpsrld $1,%%zmm{r},%%zmm{r}", "avx512f"),
    ("vpsrlvd", "vpsrlvd %%zmm16,%%zmm{r},%%zmm{r}", "avx512f"),
    ("vpmaxud", "vpmaxud %%zmm16,%%zmm{r},%%zmm{r}", "avx512f"),
    ("vpshufb", "vpshufb %%zmm16,%%zmm{r},%%zmm{r}", "avx512bw"),
    ("vpermps", "vpermps %%zmm{r},%%zmm16,%%zmm{r}", "avx512f"),
    ("vpermd", "vpermd %%zmm{r},%%zmm16,%%zmm{r}", "avx512f"),
    ("vpmultishiftqb", "vpmultishiftqb %%zmm{r},%%zmm16,%%zmm{r}", "avx512vbmi"),
    ("vpermt2w", "vpermt2w %%zmm17,%%zmm16,%%zmm{r}", "avx512bw"),
    ("vpackusdw", "vpackusdw %%zmm16,%%zmm{r},%%zmm{r}", "avx512bw"),
    ("vpmovzxwd", "vpmovzxwd %%ymm{r},%%zmm{r}", "avx512f"),
    ("vpmovwb", "vpmovwb %%zmm{r},%%ymm{r}", "avx512bw"),
    ("vptestmd", "vptestmd %%zmm16,%%zmm{r},%%k1", "avx512f"),
    ("vcmpunordps", "vcmpunordps %%zmm{r},%%zmm{r},%%k1", "avx512f"),
    ("vcvtneps2bf16", "vcvtneps2bf16 %%zmm{r},%%ymm{r}", "avx512_bf16"),
)
PORT_REFS = ("vpsrld", "vpshufb")  # port 0 alone and port 5 alone on Intel's AVX-512 cores
PORT_CLASSES = ("the shifts'", "the shuffles'", "either", "both")

PORTS_MAIN = CLOCK + r"""

static const float ONES[16] __attribute__((aligned(64))) = {
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

/* Sixteen chains (zmm0-15, from 1.0f: no subnormal operand; more chains than any op's latency
 * over its throughput) of a body run n times, its fastest of 5: seconds. */
#define PORTS_ONE(r) "vmovaps (%1),%%zmm" #r "\n"
#define PORTS_INIT PORTS_ONE(0) PORTS_ONE(1) PORTS_ONE(2) PORTS_ONE(3) PORTS_ONE(4)             \
    PORTS_ONE(5) PORTS_ONE(6) PORTS_ONE(7) PORTS_ONE(8) PORTS_ONE(9) PORTS_ONE(10)              \
    PORTS_ONE(11) PORTS_ONE(12) PORTS_ONE(13) PORTS_ONE(14) PORTS_ONE(15) PORTS_ONE(16)         \
    PORTS_ONE(17) "kxnorw %%k2,%%k2,%%k2\n"
#define PORTS_TIME(body, out)                                                               \
    for (int r = 0; r < 5; ++r) {                                                           \
        long i = n;                                                                         \
        double t = now();                                                                   \
        __asm__ volatile(PORTS_INIT "1:\n" body "dec %0\n jnz 1b\n" : "+r"(i) : "r"(ONES)  \
                         : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5",  \
                           "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",       \
                           "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19",   \
                           "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "k1", "k2"); \
        t = now() - t;                                                                      \
        if (t < out) out = t;                                                               \
    }

int main(void) {
    const double ghz = clock_ghz();
    long n = 2000000;
    printf("%.4f\n", ghz);
    /* per op: 16 of it alone, then beside 16 of each reference; cycles per op or pair */
#define PORTS_ROW(alone, with0, with5)                                                      \
    {                                                                                       \
        double a = 1e30, b = 1e30, c = 1e30;                                                \
        PORTS_TIME(alone, a)                                                                \
        PORTS_TIME(with0, b)                                                                \
        PORTS_TIME(with5, c)                                                                \
        printf("%.3f %.3f %.3f\n", a * ghz * 1e9 / (16.0 * n), b * ghz * 1e9 / (16.0 * n),  \
               c * ghz * 1e9 / (16.0 * n));                                                 \
    }
ROWS
    return 0;
}
"""


def _ports_source(ops) -> str:
    """PORTS_MAIN with a row per op: 16 of it on zmm0-15, and beside them 16 of each reference
    on zmm18-25 (two each: a reference's latency is one cycle)."""
    def lines(template: str, regs) -> str:
        return " ".join(f'"{template.format(r=r)}\\n"' for r in regs)
    own, other = range(16), [18 + i % 8 for i in range(16)]
    ref0, ref5 = (next(t for n, t, _ in PORT_OPS if n == ref) for ref in PORT_REFS)
    rows = [f"    PORTS_ROW({lines(t, own)}, {lines(t, own)} {lines(ref0, other)}, "
            f"{lines(t, own)} {lines(ref5, other)})" for _, t, _ in ops]
    return PORTS_MAIN.replace("ROWS", "\n".join(rows))


def port_class(alone: float, with_shifts: float, with_shuffles: float) -> str:
    """Which of the two reference ops' ports an op takes (PORT_CLASSES), from its cycles per op
    alone and per pair beside 16 vpsrld or 16 vpshufb: a pair that takes a cycle more than the
    slower of the two alone shares that one's port; neither, the op goes to either port; a
    fraction of a cycle beside each, it takes from both (more than one uop)."""
    extra0 = with_shifts - max(alone, 1.0)
    extra5 = with_shuffles - max(alone, 1.0)
    if extra0 > 0.5 and extra5 < 0.3:
        return PORT_CLASSES[0]
    if extra5 > 0.5 and extra0 < 0.3:
        return PORT_CLASSES[1]
    if extra0 < 0.3 and extra5 < 0.3:
        return PORT_CLASSES[2]
    return PORT_CLASSES[3]


def ports() -> tuple[float, dict[str, tuple[float, float, float]]]:
    """(the core's GHz, {op: (cycles per op of 16 independent ones, per pair beside 16 vpsrld,
    per pair beside 16 vpshufb)}) for the zmm ops of the coded pass (PORT_OPS) that this CPU
    has: what each shares with a shift and with a shuffle (ports 0 and 5 on Intel's AVX-512
    cores, where zmm work has no other vector port); raises RuntimeError without AVX-512 or
    a C compiler."""
    flags = _cpu_flags()
    if "avx512f" not in flags or "avx512bw" not in flags:
        raise RuntimeError("--ports times zmm ops: this CPU has no AVX-512F/BW")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc, or $CC) on PATH")
    ops = [op for op in PORT_OPS if op[2] in flags]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "ports.c", Path(tmp) / "ports"
        src.write_text(_ports_source(ops))
        build = subprocess.run([cc, "-O2", "-march=native", str(src), "-o", str(exe)],
                               capture_output=True, text=True)
        if build.returncode:
            raise RuntimeError(f"the port probe did not build:\n{build.stderr}")
        out = subprocess.run([str(exe)], capture_output=True, text=True,
                             check=True).stdout.split("\n")
    rows = [tuple(float(v) for v in line.split()) for line in out[1:1 + len(ops)]]
    return float(out[0]), {name: row for (name, _, _), row in zip(ops, rows, strict=True)}


def _spec(modes) -> list[str]:
    spec = []
    for _, master, state in modes:
        spec += [STATES[state], QBLOCKS.get(state, 256), STATES[master]]
    return [str(x) for x in spec]


def _build(tmp: str, extra: tuple[str, ...] = ()) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc, or $CC) on PATH")
    src, exe = Path(tmp) / "loop.c", Path(tmp) / "loop"
    src.write_text(DRIVER)
    build = subprocess.run([cc, *FLAGS, *extra, "-I", str(ROOT / "cython_ext"), str(src),
                            "-o", str(exe), "-lm"], capture_output=True, text=True)
    if build.returncode:
        raise RuntimeError(f"the driver did not build:\n{build.stderr}")
    return exe


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((set(line.split(":", 1)[1].split()) for line in fh
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def count_flags() -> tuple[str, ...]:
    """Extra flags of the driver that valgrind runs: -mno-avx512f where -march=native would
    emit AVX-512, which valgrind does not decode (3.19: SIGILL at the first zmm op)."""
    return ("-mno-avx512f",) if "avx512f" in _cpu_flags() else ()


def run(elements: int, calls: int, rounds: int,
        modes: list[tuple[str, str, str]] = MODES) -> dict[str, float]:
    """{mode name: ns/param}; raises RuntimeError when the driver does not build or run."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = _build(tmp)
        out = subprocess.run([str(exe), str(elements), str(calls), str(rounds),
                              *_spec(modes)], capture_output=True, text=True,
                             check=True).stdout
    by_index = {int(k): float(ns) for k, ns in (line.split() for line in out.splitlines())}
    return {name: by_index[i] for i, (name, _, _) in enumerate(modes)}


def instructions(elements: int, calls: int,
                 modes: list[tuple[str, str, str]] = MODES) -> dict[str, float]:
    """{mode name: instructions per param}: the driver's kernel calls counted by valgrind's
    callgrind (only inside the kernel's entry points), each mode in a run of its own.  Counts
    do not depend on the machine's load, as times do; they say nothing of memory stalls."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("--instructions needs valgrind on PATH")
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = _build(tmp, count_flags())
        for mode in modes:
            out = Path(tmp) / "callgrind.out"
            # the kernel's entry points, whatever suffix gcc's clones give them
            subprocess.run([valgrind, "--tool=callgrind", "--toggle-collect=hz_adam_range*",
                            "--toggle-collect=hz_m16_range*", f"--callgrind-out-file={out}",
                            str(exe), str(elements), str(calls), "1", *_spec([mode])],
                           capture_output=True, text=True, check=True)
            total = next(int(line.split()[1]) for line in out.read_text().splitlines()
                         if line.startswith("totals:"))
            if total == 0:
                raise RuntimeError("callgrind counted nothing: the kernel's entry points were "
                                   "renamed (see --toggle-collect above)")
            got[mode[0]] = total / (elements * calls)
    return got


KINDS = ("vector ALU", "divider", "vector load/store", "scalar")


def _kind(mnemonic: str, operands: str) -> str:
    """An instruction's kind (KINDS): vsqrtps / vdivps (the divider), a vector move or
    broadcast with a memory operand (AT&T: a parenthesis), any other vector instruction
    (register moves included), and the rest (loop, addresses, tests, scalar math)."""
    if not mnemonic.startswith("v"):
        return "scalar"
    if re.match(r"v(sqrt|div)p", mnemonic):
        return "divider"
    if re.match(r"v(mov|broadcast|pbroadcast|maskmov)", mnemonic) and "(" in operands:
        return "vector load/store"
    return "vector ALU"


def _costs(path: Path, obj: str) -> dict[int, int]:
    """{instruction address: count} inside obj from a callgrind file written with
    --dump-instr=yes: positions absolute (0x..) or relative (+n, -n, *) to the last one, the
    cost line after a calls= line a callee's inclusive cost (skipped: the callee's own lines
    count it)."""
    names, cost, here, pos, after_call = {}, {}, None, 0, False
    for line in path.read_text().splitlines():
        named = re.match(r"c?ob=\((\d+)\)\s+(\S.*)", line)
        if named:
            names[named.group(1)] = named.group(2)
        if line.startswith("ob="):
            here = names[re.match(r"ob=\((\d+)\)", line).group(1)]
        elif line.startswith("calls="):
            after_call = True
        elif line[:1].isdigit() or line[:1] in ("+", "-", "*"):
            field = line.split()
            if field[0].startswith("0x"):
                pos = int(field[0], 16)
            elif field[0][0] in "+-":
                pos += int(field[0])
            if after_call:
                after_call = False
            elif here == obj:
                cost[pos] = cost.get(pos, 0) + int(field[-1])
    return cost


def kinds(elements: int, calls: int,
          modes: list[tuple[str, str, str]] = MODES) -> dict[str, dict[str, float]]:
    """{mode name: {kind: instructions per param}} (KINDS): callgrind's count of each of the
    kernel's instructions, each named by objdump of the driver (built without PIE, so that
    the two agree on addresses).  The kinds sum to instructions()'s total."""
    valgrind, objdump = shutil.which("valgrind"), shutil.which("objdump")
    if valgrind is None or objdump is None:
        raise RuntimeError("--kinds needs valgrind and objdump on PATH")
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = _build(tmp, ("-no-pie", *count_flags()))
        named = {}
        for line in subprocess.run([objdump, "-d", "--no-show-raw-insn", str(exe)],
                                   capture_output=True, text=True, check=True).stdout.splitlines():
            ins = re.match(r"\s+([0-9a-f]+):\s+(\S+)\s*(.*)", line)
            if ins:
                named[int(ins.group(1), 16)] = _kind(ins.group(2), ins.group(3))
        for mode in modes:
            out = Path(tmp) / "callgrind.out"
            subprocess.run([valgrind, "--tool=callgrind", "--dump-instr=yes",
                            "--toggle-collect=hz_adam_range*", "--toggle-collect=hz_m16_range*",
                            f"--callgrind-out-file={out}", str(exe), str(elements), str(calls),
                            "1", *_spec([mode])], capture_output=True, text=True, check=True)
            per = dict.fromkeys(KINDS, 0.0)
            for address, n in _costs(out, str(exe)).items():
                per[named.get(address, "scalar")] += n / (elements * calls)
            if not sum(per.values()):
                raise RuntimeError("callgrind counted nothing inside the driver")
            got[mode[0]] = per
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=65536, help="buffer size, in params")
    ap.add_argument("--calls", type=int, default=3000, help="timed calls per mode per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over the modes")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions per param with valgrind's callgrind instead of "
                         "timing (--calls calls a mode, --rounds unused)")
    ap.add_argument("--kinds", action="store_true",
                    help="with --instructions: split each mode's count by kind (vector ALU, "
                         "divider, vector load/store, scalar)")
    ap.add_argument("--clock", action="store_true",
                    help="also measure the core's clock and its vsqrtps / vdivps throughput, "
                         "and give cycles per param")
    ap.add_argument("--ports", action="store_true",
                    help="instead of the kernel, time the coded pass's zmm ops alone and "
                         "beside zmm shifts or shuffles: which port each shares (AVX-512 only)")
    args = ap.parse_args(argv)
    if min(args.elements, args.calls, args.rounds) < 1:
        ap.error("--elements, --calls and --rounds must be positive")
    if args.kinds and not args.instructions:
        ap.error("--kinds splits the count of --instructions: give both")
    if args.clock and args.instructions:
        ap.error("--clock goes with the timing; --instructions counts instead: give one")
    if args.ports and (args.instructions or args.clock):
        ap.error("--ports times ops instead of the kernel: give it alone")
    if args.ports:
        try:
            ghz, rows = ports()
        except RuntimeError as e:
            ap.error(str(e))
        print(f"core: {ghz:.2f} GHz (dependent multiplies); cycles per op of 16 independent "
              f"zmm ops, and per pair beside 16 {PORT_REFS[0]} or 16 {PORT_REFS[1]}")
        print(f"| op | alone | beside {PORT_REFS[0]} | beside {PORT_REFS[1]} | the port of |"
              "\n|---|---:|---:|---:|---|")
        for name, (alone, with0, with5) in rows.items():
            print(f"| {name} | {alone:.2f} | {with0:.2f} | {with5:.2f} | "
                  f"{port_class(alone, with0, with5)} |")
        return 0
    code = ", AVX2 code: valgrind runs no AVX-512" if count_flags() else ""
    if args.kinds:
        split = kinds(args.elements, args.calls)
        print(f"| mode | instructions/param ({args.elements} params, 1 thread, callgrind, "
              f"{args.calls} calls{code}) | " + " | ".join(KINDS) + " |\n|---|---:|"
              + "---:|" * len(KINDS))
        for name, per in split.items():
            print(f"| {name} | {sum(per.values()):.2f} | "
                  + " | ".join(f"{per[k]:.2f}" for k in KINDS) + " |")
        return 0
    if args.instructions:
        counts = instructions(args.elements, args.calls)
        print(f"| mode | instructions/param ({args.elements} params, 1 thread, callgrind, "
              f"{args.calls} calls{code}) |\n|---|---:|")
        for name, value in counts.items():
            print(f"| {name} | {value:.2f} |")
        return 0
    core = clock() if args.clock else None
    ns = run(args.elements, args.calls, args.rounds)
    head = f"| mode | ns/param ({args.elements} params, 1 thread, fastest of " \
           f"{args.rounds} x {args.calls} calls) |"
    if core is None:
        print(f"{head}\n|---|---:|")
        for name, value in ns.items():
            print(f"| {name} | {value:.3f} |")
        return 0
    print(f"core: {core['ghz']:.2f} GHz (dependent multiplies); vsqrtps {core['sqrt']:.2f}, "
          f"vdivps {core['div']:.2f}, the pair {core['sqrt+div']:.2f} cycles per 8 lanes")
    if "zmm" in core:
        print("zmm, cycles: " + ", ".join(f"{k} {v:.1f}" for k, v in core["zmm"].items()))
    print(f"{head} cycles/param |\n|---|---:|---:|")
    for name, value in ns.items():
        print(f"| {name} | {value:.3f} | {value * core['ghz']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
