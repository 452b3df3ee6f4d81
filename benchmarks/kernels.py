"""Kernel micro-benchmarks: GEMV bandwidth and GEMM throughput per GGML format.

    python benchmarks/kernels.py [--threads 2] [--formats Q4_0,Q8_0] [--reps 7] [--gemm-m 128]

GEMV (m=1, the decode route): a weight of ~--mib MiB per format (well past the 32 MiB
L3, so it streams from DRAM like decode does), GB/s = weight bytes read / median time.
GEMM (m=--gemm-m, the prefill route): an [n=4096, k=4096] weight, GFLOP/s = 2*m*n*k /
median time. Every figure is the median of --reps timed repetitions, and each format
is timed alternately with torch's own f32 GEMV/GEMM on a matrix of the same shape
(a paired comparison: the machine is shared, so both see the same noise). Both are
timed on the canonical (batch-invariant, default) route and on the legacy route it
replaced (FUCINA_INVARIANT=0: the fused GEMVs, and for GEMM the AVX512_BF16 route where
the CPU has it, else the int8 tiles), beside torch's f32 and bf16 (oneDNN) GEMMs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

import fucina.kernels as K
from fucina.gguf import TYPE_SIZES, GGMLType as T

F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
              T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
              T.IQ4_NL: [0], T.IQ4_XS: [0], T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0],
              T.IQ3_S: [0], T.IQ1_S: [0], T.TQ1_0: [52], T.TQ2_0: [64]}
ORDER = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
         T.IQ4_NL, T.IQ4_XS, T.F16, T.BF16, T.F32]


def rand_raw(qt: T, n: int, k: int, rng) -> torch.Tensor:
    bs, ts = TYPE_SIZES[qt]
    if qt == T.F32:
        return torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32).view(np.uint8))
    if qt == T.F16:
        return torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32).astype(np.float16).view(np.uint8))
    if qt == T.BF16:
        w = rng.standard_normal((n, k), dtype=np.float32).view(np.uint32) >> 16
        return torch.from_numpy(w.astype(np.uint16).view(np.uint8))
    raw = rng.integers(0, 256, (n * (k // bs), ts), dtype=np.uint8)
    if qt == T.MXFP4:   # the E8M0 scale byte: 2^-10 .. 2^-4
        raw[:, 0] = rng.integers(118, 124, raw.shape[0], dtype=np.uint8)
    for o in F16_FIELDS.get(qt, []):
        raw[:, o:o + 2] = (rng.standard_normal(raw.shape[0]) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qt == T.IQ1_M:   # its f16 d in the top nibbles of the four scale words (bytes 49, 51, 53, 55)
        d = (rng.standard_normal(raw.shape[0]) * 0.02).astype(np.float16).view(np.uint16)
        for i in range(4):
            raw[:, 49 + 2 * i] = (raw[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def timeit(fn, reps: int, inner: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        ts.append((time.perf_counter() - t0) / inner)
    return statistics.median(ts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mib", type=int, default=96, help="GEMV weight size per format")
    ap.add_argument("--gemm-m", type=int, default=128)
    ap.add_argument("--gemm-nk", type=int, default=4096)
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--isa", default="")
    a = ap.parse_args(argv)
    K.set_threads(a.threads)
    if a.isa:
        K.set_isa(a.isa)
    fmts = [T[f] for f in a.formats.split(",")] if a.formats else ORDER
    rng = np.random.default_rng(0)
    k = 4096
    print(f"isa={K.isa()} threads={K.get_threads()} reps={a.reps} (medians)", file=sys.stderr)
    legacy = "int8"
    try:
        K.set_prefill_route("bf16")
        legacy = "bf16"
    except K.KernelError:
        pass
    K.set_prefill_route("canon")
    print(f"| format | GEMV GB/s canon (m=1) | GEMV GB/s legacy | torch f32 GEMV GB/s | GEMM GFLOP/s canon "
          f"(m={a.gemm_m}) | GEMM GFLOP/s legacy {legacy} | torch f32 GEMM | torch bf16 GEMM |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def on(route, fn):
        K.set_prefill_route(route)
        try:
            return fn()
        finally:
            K.set_prefill_route("canon")

    for qt in fmts:
        bs, ts = TYPE_SIZES[qt]
        n = max(64, int(a.mib * 2**20 / (k // bs * ts)))
        raw = rand_raw(qt, n, k, rng)
        x = torch.randn(1, k)
        wf = torch.randn(n, k) if n * k * 4 <= 512 * 2**20 else torch.randn(512 * 2**18 // k, k)
        t_c, t_l, t_f = [], [], []
        for _ in range(a.reps):  # paired: canon, legacy, torch, each round
            t_c.append(timeit(lambda: K.matmul(raw, qt, n, k, x), 1, 10))
            t_l.append(on(legacy, lambda: timeit(lambda: K.matmul(raw, qt, n, k, x), 1, 10)))
            t_f.append(timeit(lambda: torch.nn.functional.linear(x, wf), 1, 10))
        t_c, t_l, t_f = (statistics.median(t) for t in (t_c, t_l, t_f))
        row = (f"| {qt.name} | {raw.numel() / t_c / 1e9:.1f} | {raw.numel() / t_l / 1e9:.1f} "
               f"| {wf.numel() * 4 / t_f / 1e9:.1f} |")
        del raw, wf
        if not a.no_gemm:
            nn = kk = a.gemm_nk
            raw = rand_raw(qt, nn, kk, rng)
            xm = torch.randn(a.gemm_m, kk)
            wf = torch.randn(nn, kk)
            wb, xb = wf.bfloat16(), xm.bfloat16()
            flop = 2.0 * a.gemm_m * nn * kk
            reps = max(3, a.reps // 2)
            t_d, t_i = [], []
            for _ in range(reps):  # paired rounds: canon, legacy
                t_d.append(timeit(lambda: K.matmul(raw, qt, nn, kk, xm), 1, 1))
                t_i.append(on(legacy, lambda: timeit(lambda: K.matmul(raw, qt, nn, kk, xm), 1, 1)))
            t_d, t_i = statistics.median(t_d), statistics.median(t_i)
            t_f = timeit(lambda: torch.nn.functional.linear(xm, wf), reps, 1)
            t_b = timeit(lambda: torch.nn.functional.linear(xb, wb), reps, 1)
            row += " | ".join(f" {flop / t / 1e9:.0f}" for t in (t_d, t_i, t_f, t_b)) + " |"
        else:
            row += " | | | |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
