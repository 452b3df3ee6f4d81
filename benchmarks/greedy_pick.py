"""The greedy pick right after a forward step: numpy's argmax, the native first maximum
(`kernels.first_max`) and `Sampler.next` (temperature 0), each timed on the logits a
`forward_step` has just written, so its code and the row are as cold as in the decode
loop (5-10x their warm time).

    python benchmarks/greedy_pick.py [MODEL.gguf ...] [--threads 2] [--rounds 60]

Each round runs one step and one timed call per method, alternating; medians in us.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import fucina
from fucina import kernels
from fucina.text.sampler import Sampler, SamplingConfig

DEFAULT_MODELS = [Path.home() / ".cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf",
                  Path.home() / ".cache/fucina/gemma-3-270m-q4_k_m.gguf"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path, default=DEFAULT_MODELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    kernels.set_threads(args.threads)
    for path in args.models:
        if not path.exists():
            print(f"{path}: missing, skipped")
            continue
        model = fucina.load(str(path)).model
        cache = model.init_cache(512)
        model.forward_step_all_logits(cache, list(range(100, 300)), 0)
        base = cache.len
        sampler = Sampler(SamplingConfig(temperature=0))
        methods = {
            "numpy argmax": lambda row: int(np.argmax(row.numpy())),
            "kernels.first_max": kernels.first_max,
            "Sampler.next": lambda row: sampler.next(row, [1, 2, 3]),
        }
        times: dict[str, list[int]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, pick in methods.items():
                row = model.forward_step(cache, [5], base)
                cache.truncate(base)
                t0 = time.perf_counter_ns()
                pick(row)
                times[name].append(time.perf_counter_ns() - t0)
        print(f"{path.name} ({row.numel()} logits, {args.threads} threads): " +
              ", ".join(f"{name} {statistics.median(v) / 1e3:.1f} us" for name, v in times.items()))


if __name__ == "__main__":
    main()
