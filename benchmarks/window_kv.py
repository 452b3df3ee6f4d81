"""Gemma-3 with window memories vs a cache that keeps every position (the layout before
issue 11), same process and kernels, interleaved A B A B: a long prefill, then decode
tokens past the window. Prints medians and every run.

usage: PYTHONPATH=src python benchmarks/window_kv.py GEMMA3.gguf [--rounds 3] [--slack 512]
"""
import argparse
import statistics
import time

import torch

from fucina.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=1536)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--slack", type=int, default=None, help="window_slack (default: the model's)")
    a = ap.parse_args()
    m = load_model(a.model)
    if a.slack is not None:
        m.window_slack = a.slack
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.config.n_vocab, (a.prompt + a.tokens,), generator=g).tolist()
    res = {"window": [], "keep_all": []}
    for _ in range(a.rounds):
        for kind in res:
            c = m.init_cache(a.prompt + a.tokens + 1, rewindable=kind == "keep_all")
            t = time.perf_counter()
            m.forward_step(c, ids[:a.prompt], 0)
            pp = a.prompt / (time.perf_counter() - t)
            t = time.perf_counter()
            for i in range(a.tokens):
                m.forward_step(c, [ids[a.prompt + i]], c.len)
            res[kind].append((pp, a.tokens / (time.perf_counter() - t), c.nbytes()))
    for kind, runs in res.items():
        print(f"{kind}: prefill median {statistics.median(r[0] for r in runs):.1f} tok/s, decode median "
              f"{statistics.median(r[1] for r in runs):.2f} tok/s, KV {runs[0][2] / 1e6:.1f} MB, runs "
              f"{[(round(p), round(d, 1)) for p, d, _ in runs]}")


if __name__ == "__main__":
    main()
