#!/usr/bin/env python3
"""The decode GEMV's rate with its weight in cache: how fast a core's dots go, beside the
DRAM rate `read_bandwidth.py` gives a core.

    python benchmarks/gemv_cache.py [--threads 1] [--formats Q4_K,Q6_K,Q8_0] [--reps 400]

One activation row (m = 1) against a random weight of 1024 x 2048 (in a 2 MB L2) and 6144 x
2048 (past L2, in L3), each laid out as a model load lays it out (every format with a
row-group layout in its groups where the ISA in force reads them; FUCINA_Q50_X16=0 and the
like keep the rows). Prints the best and median GB/s of weight bytes
over --reps calls. FUCINA_ISA=avx2 times the AVX2 level.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fucina import kernels as K  # noqa: E402
from fucina.gguf import GGMLType  # noqa: E402
from fucina.weights import LinearWeight  # noqa: E402


def main() -> int:
    from test_kernels import rand_weight

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", type=lambda s: s.split(","), default=["Q4_K", "Q6_K", "Q8_0"])
    ap.add_argument("--reps", type=int, default=400)
    a = ap.parse_args()
    K.set_threads(a.threads)
    print(f"ISA {K.isa()}, {a.threads} thread(s)")
    for name in a.formats:
        fmt = getattr(GGMLType, name)
        for n, k in ((1024, 2048), (6144, 2048)):
            raw = torch.from_numpy(rand_weight(fmt, n, k, np.random.default_rng(0)))
            w = LinearWeight(raw, fmt, n, k, "w")
            K.attach(w)
            grouped = K.interleave(w)
            x = torch.randn(1, k)
            for _ in range(50):
                w.kernel(x)
            ts = []
            for _ in range(a.reps):
                t = time.perf_counter()
                w.kernel(x)
                ts.append(time.perf_counter() - t)
            nb = raw.numel()
            print(f"{name} {n}x{k} ({nb / 1e6:.1f} MB{', 16-row groups' if grouped else ''}): "
                  f"best {nb / min(ts) / 1e9:.1f} GB/s, median {nb / statistics.median(ts) / 1e9:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
