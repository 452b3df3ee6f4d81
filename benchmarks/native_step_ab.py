"""The native layer step against the torch blocks on one model, paired in one process: one
thread, the two routes alternated (A B A B), process CPU time (a paused process does not
count), medians of the per-round figures and ratios.
usage: python benchmarks/native_step_ab.py MODEL.gguf [--pp 128] [--tg 32] [--rounds 5]"""
import argparse
import gc
import statistics
import time

import torch

import fucina.kernels as K
from fucina.models import load_model

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--pp", type=int, default=128)
ap.add_argument("--tg", type=int, default=32)
ap.add_argument("--rounds", type=int, default=5)
a = ap.parse_args()
torch.set_num_threads(1)
K.set_threads(1)
gc.disable()
model = load_model(a.model)
gc.freeze()
prompt = [(7 * i * i + 3 * i + 5) % 250 + 1 for i in range(a.pp)]


def run(native: bool) -> tuple[float, float]:
    model.use_native_step = native
    cache = model.init_cache(a.pp + a.tg)
    t = time.process_time()
    model.forward_step_all_logits(cache, prompt, 0)
    pp = a.pp / (time.process_time() - t)
    t = time.process_time()
    for i in range(a.tg):
        model.forward_step_all_logits(cache, [5 + i % 200], cache.len)
    return pp, a.tg / (time.process_time() - t)


run(True)
run(False)
rows = [(run(True), run(False)) for _ in range(a.rounds)]
for k, name in ((0, f"prefill pp{a.pp}"), (1, f"decode tg{a.tg}")):
    nat, tor = (statistics.median(r[s][k] for r in rows) for s in (0, 1))
    ratio = statistics.median(r[0][k] / r[1][k] for r in rows)
    print(f"{name}: native {nat:.1f} tok/s, torch blocks {tor:.1f} tok/s, native / torch {ratio:.2f}")
