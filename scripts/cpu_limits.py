"""What this CPU can do at most: fp32 multiply-adds a second from registers, and bytes a second read from memory.

The kernels' figures mean little without these two: a verify of many tokens is bound by multiply-adds, a draft
step by the bytes of the draft's weights. A small C probe, built with the kernels' compiler and -march=native:

- multiply-adds: each thread runs 12 independent chains of vector FMAs (as many lanes as the kernels' vectors:
  8 with AVX2, 16 with AVX-512) with no memory operands, the most the FMA units do;
- reads: the threads sum a 1 GiB buffer, each a contiguous part of it, one vector load at a time.

Best of `--repeats` runs each (a shared machine is only ever slower than it can be). `hybrid_replay.py --limits`
reads the report to price a draft step at its weights' read time and a verify's extra tokens at the FMA peak.

    PYTHONPATH=.:proto python scripts/cpu_limits.py --json out/cpu_limits.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

PROBE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define LOAD _mm512_load_ps
#define STORE _mm512_storeu_ps
#else
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define LOAD _mm256_load_ps
#define STORE _mm256_storeu_ps
#endif
#define CHAINS 12

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float first_lane(vec v) {
    float lanes[LANES];
    STORE(lanes, v);
    return lanes[0];
}

/* GFLOP/s of `threads` threads each running `iters` rounds of CHAINS independent FMAs. */
static double fma_gflops(int threads, long iters) {
    float sink = 0.0f;
    double t = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        vec acc[CHAINS], a = SET1(0.999f), b = SET1(1e-4f);
        for (int c = 0; c < CHAINS; c++) acc[c] = SET1((float)c);
        for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12 /* all chains in registers */
            for (int c = 0; c < CHAINS; c++) acc[c] = FMA(acc[c], a, b);
        }
        vec s = acc[0];
        for (int c = 1; c < CHAINS; c++) s = ADD(s, acc[c]);
        sink += first_lane(s);
    }
    t = now() - t;
    if (sink == 12345.0f) puts(""); /* keeps the chains */
    return 2.0 * LANES * CHAINS * (double)iters * threads / t / 1e9;
}

/* GB/s of `threads` threads summing `bytes` of memory. */
static double read_gbs(int threads, const float *buf, size_t floats) {
    float sink = 0.0f;
    double t = now();
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sink)
    for (long part = 0; part < threads; part++) {
        size_t begin = floats / threads * part, end = begin + floats / threads;
        vec s0 = SET1(0.0f), s1 = SET1(0.0f);
        for (size_t i = begin; i + 2 * LANES <= end; i += 2 * LANES) {
            s0 = ADD(s0, LOAD(buf + i));
            s1 = ADD(s1, LOAD(buf + i + LANES));
        }
        sink += first_lane(ADD(s0, s1));
    }
    t = now() - t;
    if (sink == 12345.0f) puts("");
    return floats * sizeof(float) / t / 1e9;
}

int main(int argc, char **argv) {
    int threads = atoi(argv[1]), repeats = atoi(argv[2]);
    size_t floats = ((size_t)1 << 30) / sizeof(float);
    float *buf = aligned_alloc(64, floats * sizeof(float));
    if (buf == NULL) return 1;
    for (size_t i = 0; i < floats; i++) buf[i] = 1.0f;
    double best_fma = 0.0, best_read = 0.0;
    for (int r = 0; r < repeats; r++) {
        double f = fma_gflops(threads, 20000000L), g = read_gbs(threads, buf, floats);
        if (f > best_fma) best_fma = f;
        if (g > best_read) best_read = g;
    }
    printf("{\"lanes\": %d, \"fma_gflops\": %.1f, \"read_gbs\": %.2f}\n", LANES, best_fma, best_read);
    free(buf);
    return 0;
}
"""


def measure(threads: int, repeats: int) -> dict[str, float]:
    """Build the probe with the kernels' compiler and run it: {"lanes", "fma_gflops", "read_gbs"}."""
    from specdec_core.kernels.cpu import kernel_compiler

    cc = kernel_compiler()
    if cc is None:
        raise SystemExit("no C compiler: the probe, like the CPU kernels, needs one")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "limits.c", Path(tmp) / "limits"
        source.write_text(PROBE)
        subprocess.run([cc, "-O2", "-march=native", "-fopenmp", "-o", str(binary), str(source)], check=True,
                       timeout=120)
        out = subprocess.run([str(binary), str(threads), str(repeats)], check=True, capture_output=True, text=True,
                             timeout=600)
    return json.loads(out.stdout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = {"threads": args.threads, **measure(args.threads, args.repeats)}
    print(f"{args.threads} threads, {result['lanes']} fp32 lanes: {result['fma_gflops']:.1f} GFLOP/s of multiply-adds "
          f"from registers, {result['read_gbs']:.2f} GB/s read from memory")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
