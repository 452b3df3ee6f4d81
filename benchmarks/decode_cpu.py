"""Decode matmuls (m = 1..4) in process CPU time, canonical route vs the legacy fused GEMV.

    python benchmarks/decode_cpu.py [--m 1,2,4] [--isa avx512] [--reps 5]

1 thread. For each model-shaped weight the canonical (batch-invariant) route and the
legacy route (FUCINA_INVARIANT=0's fused GEMVs, set_prefill_route("int8")) are timed
alternately in this one process, each cell the best of --reps batches of calls, in
process CPU time (getrusage: the cycles this process got, not the waits for a core on a
shared machine). Prints GB/s of weight bytes per CPU-second and the canon/legacy ratio.
"""
from __future__ import annotations

import argparse
import resource

import numpy as np
import torch

import fucina.kernels as K
from fucina.gguf import GGMLType as T

from kernels import rand_raw

# SmolLM2 (Q4_1 / Q8_0), Gemma-3 270M (Q5_0 / Q8_0 / Q4_K / Q6_K, its 262144 x 640 Q8_0
# output matrix), Qwen3-0.6B (Q8_0, Q4_K / Q6_K)
SHAPES = [("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576), ("Q5_0", 2048, 640),
          ("Q8_0", 640, 2048), ("Q8_0", 262144, 640), ("Q4_K", 1024, 1024), ("Q6_K", 640, 2048),
          ("Q8_0", 3072, 1024), ("Q4_K", 3072, 1024), ("Q4_K", 1024, 3072), ("Q6_K", 1024, 3072),
          ("Q6_K", 151936, 1024)]


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def best(fn, reps: int, inner: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = cpu()
        for _ in range(inner):
            fn()
        out.append((cpu() - t) / inner)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--formats", default=None)
    a = ap.parse_args()
    if a.isa:
        K.set_isa(a.isa)
    K.set_threads(1)
    rng = np.random.default_rng(0)
    print(f"isa {K.isa()}, 1 thread, GB/s per CPU-second (best of {a.reps})")
    print("| weight [n, k] | m | canon | legacy | canon / legacy |\n| --- | --- | --- | --- | --- |")
    for f, n, k in SHAPES:
        if a.formats and f not in a.formats.split(","):
            continue
        raw = rand_raw(T[f], n, k, rng)
        inner = max(1, int(4e7 / raw.numel()))
        for m in map(int, a.m.split(",")):
            x = torch.randn(m, k)
            t = {}
            for _ in range(2):
                for route in ("canon", "int8"):
                    K.set_prefill_route(route)
                    v = best(lambda: K.matmul(raw, T[f], n, k, x), a.reps, inner)
                    t[route] = min(t.get(route, 1e9), v)
            K.set_prefill_route("canon")
            gb = raw.numel() / 1e9
            print(f"| {f} [{n}, {k}] | {m} | {gb / t['canon']:.1f} | {gb / t['int8']:.1f} | "
                  f"{t['int8'] / t['canon']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
