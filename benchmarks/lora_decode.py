"""Decode and prefill speed with a LoRA adapter on SmolLM2 Q4_1, unmerged (the default: the
frozen weights in their type, B (A x) added in f32 in the native step) against merged Q8_0 /
F16 copies and the plain model, paired in one process (rounds of A B C D, medians).
Adapter: random, r 16 on all seven projections of every layer (BENCHMARK.md "Unmerged LoRA
in the native step").

    python benchmarks/lora_decode.py [ROUNDS] [THREADS]
"""
import os
import statistics
import sys
import time

import torch

import fucina.kernels as K
from fucina.gguf import GGMLType
from fucina.models import load_model
from fucina.text.evaluate import bench
from fucina.train.adapters import apply_adapters, read_adapter, write_adapter

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
K.set_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
path = os.environ.get("MODEL", os.path.expanduser("~/.cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf"))
base = load_model(path)
g = torch.Generator().manual_seed(0)
pairs = {}
for i, L in enumerate(base.layers):
    for t in TARGETS:
        w = next(w for w in vars(L).values() if getattr(w, "name", "") == f"blk.{i}.{t}.weight")
        pairs[w.name] = (torch.randn(16, w.in_features, generator=g) / w.in_features ** 0.5,
                         torch.randn(w.out_features, 16, generator=g) * 0.02)
adapter = read_adapter(write_adapter("/tmp/fucina-lora-bench.gguf", base.config.arch, 32.0, pairs))
models = {"plain": base}
for name, qtype in (("unmerged", None), ("merged Q8_0", GGMLType.Q8_0), ("merged F16", GGMLType.F16)):
    models[name] = load_model(path)
    apply_adapters(models[name], [(adapter, 1.0)], qtype)
runs = {k: [] for k in models}
for _ in range(rounds):
    for name, m in models.items():
        c = time.process_time()
        r = bench(m, 64, 32, 2)
        runs[name].append((r["prefill_tok_s"], r["decode_tok_s"], time.process_time() - c))
for name, rs in runs.items():
    pp, tg, cpu = (statistics.median(x[i] for x in rs) for i in range(3))
    print(f"{name:12s} prefill {pp:7.1f} tok/s  decode {tg:6.1f} tok/s  (process CPU {cpu:.2f} s/bench; "
          f"decode runs {', '.join(f'{x[1]:.1f}' for x in rs)})")
