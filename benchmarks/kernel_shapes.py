"""Model-shaped kernel timings: GEMV at 1 and 2 threads, and prefill GEMM beside oneDNN.

    python benchmarks/kernel_shapes.py [--gemv-reps 300] [--gemm-reps 15]

GEMV (m=1) on the weight shapes of SmolLM2 / Qwen3-0.6B (the 128 MB Q6_K is Qwen3's
tied output matrix): median of --gemv-reps calls (20 for the big one) at 1 then 2
threads. GEMM (m=128): best of --gemm-reps at 1 and 2 threads beside torch's bf16
GEMM (oneDNN) on bf16 weights of the same shape.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import fucina.kernels as K
from fucina.gguf import GGMLType as T

from kernels import rand_raw

GEMV = [("Q6_K", 151936, 1024), ("Q4_K", 3072, 1024), ("Q4_K", 1024, 3072), ("Q8_0", 3072, 1024),
        ("Q4_1", 1536, 576), ("Q4_1", 576, 576), ("Q3_K", 3072, 1024), ("Q2_K", 1024, 3072)]
GEMM = [("Q4_K", 6144, 1024), ("Q4_K", 1024, 3072), ("Q8_0", 6144, 1024), ("Q6_K", 1024, 3072),
        ("Q5_0", 4096, 640)]


def times(fn, n):
    fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemv-reps", type=int, default=300)
    ap.add_argument("--gemm-reps", type=int, default=15)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| weight | MB | GEMV 1 thread GB/s (µs) | 2 threads GB/s (µs) |\n| --- | --- | --- | --- |")
    for f, n, k in GEMV:
        raw, x = rand_raw(T[f], n, k, rng), torch.randn(1, k)
        cells = []
        for th in (1, 2):
            K.set_threads(th)
            t = float(np.median(times(lambda: K.matmul(raw, T[f], n, k, x), a.gemv_reps if n < 10000 else 20)))
            cells.append(f"{raw.numel() / t / 1e9:.1f} ({t * 1e6:.0f})")
        print(f"| {f} {n}x{k} | {raw.numel() / 1e6:.1f} | {cells[0]} | {cells[1]} |", flush=True)
    m = 128
    print(f"\n| weight (m={m}) | ours 1 thread GFLOP/s | ours 2 threads | torch bf16 2 threads |\n| --- | --- | --- | --- |")
    for f, n, k in GEMM:
        raw, x = rand_raw(T[f], n, k, rng), torch.randn(m, k)
        wb, xb = torch.randn(n, k).bfloat16(), x.bfloat16()
        flop = 2.0 * m * n * k
        cells = []
        for th in (1, 2):
            K.set_threads(th)
            cells.append(flop / times(lambda: K.matmul(raw, T[f], n, k, x), a.gemm_reps).min() / 1e9)
        cells.append(flop / times(lambda: torch.nn.functional.linear(xb, wb), a.gemm_reps).min() / 1e9)
        print(f"| {f} {n}x{k} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
