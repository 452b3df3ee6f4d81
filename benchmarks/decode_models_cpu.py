"""Whole-model decode in process CPU time, one configuration per process.

    python benchmarks/decode_models_cpu.py MODEL.gguf [--steps 32] [--reps 2] [--threads 1] [--isa avx2]

Loads the model, prefills 16 ids, then times --steps greedy forward_step calls in
process CPU time (getrusage: on a shared machine it counts the cycles this process got,
not the waits for a core), best of --reps, and prints one JSON line with decode tok per
CPU-second. Pair trees by running it under PYTHONPATH=<tree>/src (and FUCINA_INVARIANT=0
for the legacy routes of this one) alternately in one shell loop.
"""
from __future__ import annotations

import argparse
import json
import os
import resource

import torch

import fucina.kernels as K
from fucina.models import load_model


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def parser(reps: int) -> argparse.ArgumentParser:
    """MODEL, --reps, --threads, --isa: what every whole-model CPU-time bench here takes."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default=None, help="force an ISA level before loading (kernels.set_isa)")
    return ap


def load(a: argparse.Namespace):
    """The ISA and thread count of `a` in force, then its model."""
    if a.isa:
        K.set_isa(a.isa)
    K.set_threads(a.threads)
    torch.set_num_threads(a.threads)
    return load_model(a.model)


def main() -> None:
    ap = parser(reps=2)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    model = load(a)
    best = None
    for _ in range(a.reps):
        cache = model.init_cache(16 + a.steps + 1)
        logits = model.forward_step(cache, [(7 * i + 3) % 200 + 10 for i in range(16)], 0)
        t = cpu()
        for s in range(a.steps):
            logits = model.forward_step(cache, [int(torch.argmax(logits))], 16 + s)
        dt = cpu() - t
        best = dt if best is None else min(best, dt)
    print(json.dumps({"model": os.path.basename(a.model), "route": K.prefill_route(), "isa": K.isa(),
                      "decode_tok_per_cpu_s": round(a.steps / best, 1)}), flush=True)


if __name__ == "__main__":
    main()
