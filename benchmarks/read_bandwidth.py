"""The machine's read bandwidth, the ceiling decode is measured against.

    python benchmarks/read_bandwidth.py [--gib 1] [--reps 7]

Sums a GiB-sized f32 tensor (larger than every cache) with torch at 1 and 2 threads and
prints the median and best GB/s. Decode streams the weights once per token, so decode
GB/s (file bytes x tok/s) over this figure is the share of the ceiling a run reaches.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    x = torch.ones(int(a.gib * (1 << 28)), dtype=torch.float32)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        x.sum()
        ts = []
        for _ in range(a.reps):
            t = time.perf_counter()
            x.sum()
            ts.append(time.perf_counter() - t)
        nbytes = x.numel() * 4
        print(f"{threads} thread(s): {nbytes / statistics.median(ts) / 1e9:.1f} GB/s median, "
              f"{nbytes / min(ts) / 1e9:.1f} best")


if __name__ == "__main__":
    main()
