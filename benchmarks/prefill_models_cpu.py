"""Whole-model prefill in process CPU time, one configuration per process.

    python benchmarks/prefill_models_cpu.py MODEL.gguf [--pp 128] [--reps 5] [--threads 1] [--isa avx2]

Loads the model and times --reps prefills of --pp ids (forward_step on a fresh cache) in
process CPU time (getrusage: on a shared machine it counts the cycles this process got), and
prints one JSON line with the median prefill tok per CPU-second. Pair two trees by running it
under PYTHONPATH=<tree>/src alternately in one shell loop (FUCINA_ISA=avx2 forces the level)
and take the median of the per-round ratios.
"""
from __future__ import annotations

import json
import os
import statistics

import fucina.kernels as K
from decode_models_cpu import cpu, load, parser   # this directory's sibling: the shared set-up


def main() -> None:
    ap = parser(reps=5)
    ap.add_argument("--pp", type=int, default=128)
    a = ap.parse_args()
    model = load(a)
    ids = [(7 * i + 3) % 200 + 10 for i in range(a.pp)]
    times = []
    for _ in range(a.reps):
        cache = model.init_cache(a.pp + 1)
        t = cpu()
        model.forward_step(cache, ids, 0)
        times.append(cpu() - t)
    print(json.dumps({"model": os.path.basename(a.model), "isa": K.isa(), "threads": a.threads,
                      "prefill_tok_per_cpu_s": round(a.pp / statistics.median(times), 1)}), flush=True)


if __name__ == "__main__":
    main()
