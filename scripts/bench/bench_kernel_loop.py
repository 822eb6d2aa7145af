#!/usr/bin/env python
"""Per-param compute of the CPU-Adam kernel, without Python in the loop.

Compiles a small C driver against cython_ext/adam_kernel.h with the extension's flags (cc,
-O3 -fno-math-errno -ffp-contract=off -march=native), then times the engine's call (bf16 grads
in, bf16 params written over them, weight decay on) on one thread over a buffer small enough to
stay in cache, for fp32, bf16 and int8 moments. Each round times every state --calls times in
turn, the order rotating from round to round as in scripts/bench/_interleave.py; a state's figure is
its fastest call over all rounds, in ns per param. The rounds run in the C driver, not through
_interleave: the point is a loop without Python (a call over the 64K params is ~30 us), and in
cache the memory drift that _interleave's medians guard against does not reach the kernel, so
the fastest call, the least disturbed one, is the figure (disturbances only add time). It
prints no ratio between states (the README derives them from the figures).
Usage: python scripts/bench/bench_kernel_loop.py [--elements 65536] [--calls 3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# setup.py BASE_FLAGS and its native build (no OpenMP: the driver runs one thread)
FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-march=native"]
STATES = {"fp32": 0, "bf16": 2, "int8": 4}  # adam_kernel.h's HZ_F32, HZ_BF16, HZ_Q8

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

int main(int argc, char **argv) {
    size_t n = strtoull(argv[1], NULL, 10);
    int calls = atoi(argv[2]), rounds = atoi(argv[3]);
    const int kinds[3] = {HZ_F32, HZ_BF16, HZ_Q8};
    hz_adam_args a[3];
    double best[3] = {1e30, 1e30, 1e30};
    hz_range_fn fn = hz_select(HZ_AUTO);
    srand(1);
    for (int s = 0; s < 3; ++s) {
        float *p = aligned_alloc(64, n * 4);
        uint16_t *g = aligned_alloc(64, n * 2);
        void *m = aligned_alloc(64, n * 4), *v = aligned_alloc(64, n * 4);
        float *ms = calloc(n / 256 + 1, 4), *vs = calloc(n / 256 + 1, 4);
        memset(m, 0, n * 4);
        memset(v, 0, n * 4);
        for (size_t i = 0; i < n; ++i) {
            p[i] = rand() / (float)RAND_MAX - 0.5f;
            g[i] = hz_float_to_bf16((rand() / (float)RAND_MAX - 0.5f) * 1e-2f);
        }
        hz_adam_args x = {0};
        x.param = p; x.exp_avg = m; x.exp_avg_sq = v; x.m_scale = ms; x.v_scale = vs;
        x.grad = g; x.out16 = g; x.grad_kind = HZ_BF16; x.out_kind = HZ_BF16;
        x.state_kind = kinds[s]; x.qblock = 256; x.lerp_small = 1;
        x.grad_scale = 1.0f; x.decay = 1.0f - 1e-3f * 0.01f; x.lerp_coef = 0.1f;
        x.beta1 = 0.9f; x.one_minus_beta1 = 0.1f; x.beta2 = 0.999f;
        x.one_minus_beta2 = 0.001f; x.sqrt_beta2 = sqrtf(0.999f); x.inv_bc2_sqrt = 1.0f;
        x.eps = 1e-8f; x.neg_step = -1e-3f; x.inv_ratio_cap = 1.0f / 7.27f;
        a[s] = x;
    }
    for (int r = 0; r < rounds; ++r)
        for (int i = 0; i < 3; ++i) {
            int s = (r + i) % 3; /* round r starts at state r mod 3 */
            for (int c = 0; c < calls; ++c) {
                double t0 = now();
                fn(&a[s], 0, n);
                double dt = now() - t0;
                if (dt < best[s]) best[s] = dt;
            }
        }
    for (int s = 0; s < 3; ++s) printf("%d %.4f\n", kinds[s], best[s] / n * 1e9);
    return 0;
}
"""


def run(elements: int, calls: int, rounds: int) -> dict[str, float]:
    """{state: ns/param}; raises RuntimeError when the driver does not build or run."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc, or $CC) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "loop.c", Path(tmp) / "loop"
        src.write_text(DRIVER)
        build = subprocess.run([cc, *FLAGS, "-I", str(ROOT / "cython_ext"), str(src), "-o",
                                str(exe), "-lm"], capture_output=True, text=True)
        if build.returncode:
            raise RuntimeError(f"the driver did not build:\n{build.stderr}")
        out = subprocess.run([str(exe), str(elements), str(calls), str(rounds)],
                             capture_output=True, text=True, check=True).stdout
    by_kind = {int(k): float(ns) for k, ns in (line.split() for line in out.splitlines())}
    return {name: by_kind[kind] for name, kind in STATES.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=65536, help="buffer size, in params")
    ap.add_argument("--calls", type=int, default=3000, help="timed calls per state per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over the three states")
    args = ap.parse_args(argv)
    if min(args.elements, args.calls, args.rounds) < 1:
        ap.error("--elements, --calls and --rounds must be positive")
    ns = run(args.elements, args.calls, args.rounds)
    print(f"| moments | ns/param ({args.elements} params, 1 thread, fastest of "
          f"{args.rounds} x {args.calls} calls) |\n|---|---:|")
    for name, value in ns.items():
        print(f"| {name} | {value:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
