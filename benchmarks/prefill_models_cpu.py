"""Whole-model prefill in process CPU time, one configuration per process.

    python benchmarks/prefill_models_cpu.py MODEL.gguf [--pp 128] [--reps 5] [--threads 1]

Loads the model and times --reps prefills of --pp ids (forward_step on a fresh cache) in
process CPU time (getrusage: on a shared machine it counts the cycles this process got), and
prints one JSON line with the median prefill tok per CPU-second. Pair two trees by running it
under PYTHONPATH=<tree>/src alternately in one shell loop (FUCINA_ISA=avx2 forces the level)
and take the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics

import torch

import fucina.kernels as K
from fucina.models import load_model


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    K.set_threads(a.threads)
    torch.set_num_threads(a.threads)
    model = load_model(a.model)
    ids = [(7 * i + 3) % 200 + 10 for i in range(a.pp)]
    times = []
    for _ in range(a.reps):
        cache = model.init_cache(a.pp + 1)
        t = cpu_seconds()
        model.forward_step(cache, ids, 0)
        times.append(cpu_seconds() - t)
    print(json.dumps({"model": os.path.basename(a.model), "isa": K.isa(), "threads": a.threads,
                      "prefill_tok_per_cpu_s": round(a.pp / statistics.median(times), 1)}), flush=True)


if __name__ == "__main__":
    main()
