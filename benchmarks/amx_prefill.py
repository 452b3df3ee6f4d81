#!/usr/bin/env python3
"""The AVX-512 prefill kernel with and without the AMX tiles, paired in one process.

    python benchmarks/amx_prefill.py --kernel [--formats Q4_K,Q8_0,Q6_K] [--shape 2048x2048] [--rows 256] [--threads 1]
    python benchmarks/amx_prefill.py MODEL.gguf [--pp 64,128,512] [--rounds 7] [--threads 2]

--kernel times one canonical matmul (N x K weights, --shape; m activation rows, each of --rows)
per format, the two kernels alternating, best of 5 each. With a model it times prefill of each prompt
length, the two alternating in ABBA order, and prints each side's median tokens/s and the
median of the per-round ratios (AMX / vector kernel). Both give the same bits (the tests
check it); this measures only the speed. Needs a CPU whose OS enables AMX.
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


def kernel_pairs(a) -> None:
    from fucina.gguf import GGMLType
    from test_kernels import rand_weight

    n, k = map(int, a.shape.split("x"))
    for name in a.formats:   # one weight per format, timed at each m
        qt = getattr(GGMLType, name)
        raw = torch.from_numpy(rand_weight(qt, n, k, np.random.default_rng(0)))
        for m in a.rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(0))
            best = {}
            for on in (False, True, False, True):
                K.set_amx(on)
                K.matmul(raw, qt, n, k, x)
                ts = []
                for _ in range(5):
                    t = time.perf_counter()
                    K.matmul(raw, qt, n, k, x)
                    ts.append(time.perf_counter() - t)
                best[on] = min(best.get(on, 1e9), min(ts))
            print(f"{name} {n}x{k}, m={m}, {a.threads} thread(s): vector {best[False] * 1e3:.2f} ms, "
                  f"AMX {best[True] * 1e3:.2f} ms, {best[False] / best[True]:.2f}x", flush=True)

def prefill_pairs(a) -> None:
    from fucina.models.registry import load_model

    model = load_model(a.model)
    for pp in a.pp:
        ids = [(7 * i * i + 3 * i + 5) % 1000 + 10 for i in range(pp)]
        tok_s = {True: [], False: []}
        with torch.inference_mode():
            for r in range(a.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    K.set_amx(on)
                    cache = model.init_cache(pp + 8)
                    t = time.perf_counter()
                    model.forward_step(cache, ids, 0)
                    tok_s[on].append(pp / (time.perf_counter() - t))
        ratios = [x / y for x, y in zip(tok_s[True], tok_s[False])]
        print(f"{Path(a.model).name} pp{pp}, {a.threads} thread(s): vector {statistics.median(tok_s[False]):.1f} "
              f"tok/s, AMX {statistics.median(tok_s[True]):.1f} tok/s, paired ratio {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}, {a.rounds} rounds)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--kernel", action="store_true", help="time the matmul alone, per format")
    ap.add_argument("--formats", type=lambda s: s.split(","), default=["Q4_K", "Q8_0", "Q6_K"])
    ap.add_argument("--shape", default="2048x2048", help="--kernel: the weight's N x K")
    ap.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[256],
                    help="--kernel: activation rows m, comma-separated")
    ap.add_argument("--pp", type=lambda s: [int(v) for v in s.split(",")], default=[64, 128, 512])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="default: 1 with --kernel, else 2")
    a = ap.parse_args()
    if not a.kernel and not a.model:
        ap.error("give a model, or --kernel")
    try:
        K.set_amx(True)
    except K.KernelError as e:
        print(f"skip: {e}")
        return 0
    K.set_prefill_route("canon")
    a.threads = a.threads or (1 if a.kernel else 2)
    K.set_threads(a.threads)
    if a.kernel:
        kernel_pairs(a)
    if a.model:
        prefill_pairs(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
