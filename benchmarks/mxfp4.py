"""MXFP4 against Q4_0 on the native canonical route: paired per-call timings of the same
shape in both formats (17 vs 18 bytes a block of 32), one thread, process CPU time, the
two sides alternating A B A B in one process, median over rounds.

    python benchmarks/mxfp4.py [--isa avx512 --isa avx2 ...] [--rows 1,4,8,64] [--shapes 2880x2880,...]

Prints per ISA level and shape: microseconds per call of Q4_0 and MXFP4 and their ratio
(MXFP4 / Q4_0). The default shapes are gpt-oss-20b's expert matrices (2880 x 2880, the
gate/up and down projections of one expert) and a 4096 x 4096 square.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

import fucina.kernels as K
from fucina.gguf import GGMLType as T

from kernel_pairs import paired
from kernels import rand_raw


def mxfp4_raw(n: int, k: int, rng) -> torch.Tensor:
    raw = rng.integers(0, 256, (n * (k // 32), 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(118, 124, raw.shape[0], dtype=np.uint8)   # scales 2^-10 .. 2^-4
    return torch.from_numpy(raw.reshape(n, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", action="append")
    ap.add_argument("--rows", default="1,4,8,64")
    ap.add_argument("--shapes", default="2880x2880,4096x4096")
    ap.add_argument("--rounds", type=int, default=11)
    a = ap.parse_args()
    K.set_threads(1)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    for isa in a.isa or K.supported_isas():
        K.set_isa(isa)
        for shape in a.shapes.split(","):
            n, k = map(int, shape.split("x"))
            q4, mx = rand_raw(T.Q4_0, n, k, rng), mxfp4_raw(n, k, rng)
            for m in map(int, a.rows.split(",")):
                x = torch.randn(m, k)
                reps = max(1, int(2e6 // (n * k * max(1, m // 8))))
                t4, tm = paired(lambda: K.matmul(q4, T.Q4_0, n, k, x), lambda: K.matmul(mx, T.MXFP4, n, k, x),
                                reps, a.rounds)
                print(f"{isa:7s} {n}x{k} m={m:3d}: Q4_0 {t4 * 1e6:9.1f} us, MXFP4 {tm * 1e6:9.1f} us, "
                      f"ratio {tm / t4:.3f}", flush=True)


if __name__ == "__main__":
    main()
