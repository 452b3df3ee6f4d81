"""The decode GEMV's read rate from DRAM, beside a plain sequential read of as many bytes.

    python benchmarks/gemv_dram.py [--threads 1,2] [--reps 7] [--shapes Q8_0:262144:640,...]

Each shape is a matrix larger than the caches (Gemma-3's tied Q8_0 output matrix by default,
and SmolLM2's Q4_1 layer shape stacked to 98 MB), so every call reads its weights from DRAM
as a decode step does. Reports GB/s of weight bytes per call (median of --reps) for one
activation row and for 4 (a verify pass), and the rate of `torch.sum` over a float tensor of
the same size (the sequential read the memory system gives one process). The gap between
the two is what the GEMV's access order costs (BENCHMARK.md, "The decode GEMV reads each tile in address order").
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fucina import kernels
from fucina.gguf.types import GGMLType
from kernels import rand_raw


def rate(fn, nbytes: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shapes", default="Q8_0:262144:640,Q4_1:272640:576,Q5_0:131072:640")
    a = ap.parse_args()
    print(f"ISA {kernels.isa()}")
    for spec in a.shapes.split(","):
        qtype, n, k = spec.split(":")
        n, k, qt = int(n), int(k), getattr(GGMLType, qtype)
        raw = rand_raw(qt, n, k, np.random.default_rng(0))
        seq = torch.ones(raw.numel() // 4)
        for t in (int(x) for x in a.threads.split(",")):
            kernels.set_threads(t)     # torch's threads too (the sequential read's)
            row = {m: rate(lambda x=torch.randn(m, k): kernels.matmul(raw, qt, n, k, x),
                           raw.numel(), a.reps) for m in (1, 4)}
            s = rate(seq.sum, raw.numel(), a.reps)
            print(f"{qtype} {n}x{k} ({raw.numel() / 1e6:.0f} MB) threads {t}: GEMV m=1 {row[1]:.1f} GB/s, "
                  f"m=4 {row[4]:.1f} GB/s; sequential read {s:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
