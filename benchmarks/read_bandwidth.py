"""The machine's read bandwidth, the ceiling decode is measured against.

    python benchmarks/read_bandwidth.py [--gib 1] [--reps 7]
    python benchmarks/read_bandwidth.py --model FILE [--threads 2] [--rounds 9] [--tokens 32]

Sums a GiB-sized f32 tensor (larger than every cache) with torch at 1 and 2 threads and
prints the median and best GB/s. Decode streams the weights once per token, so decode
GB/s (file bytes x tok/s) over this figure is the share of the ceiling a run reaches.

The sum reads a buffer in transparent huge pages where Linux gives them (fucina's repacked
weights live in such pages; `--plain-pages` sums 4 KB pages, as a plain allocation gets):
on 4 KB pages the page walks slow the sum itself, so a decode in huge pages could read more
than that "ceiling".

The host's ceiling moves with its other tenants (two-thread sums of 30 to 55 GB/s on one
shared host within an hour), so a share taken from two separate runs mixes two machines. With
--model, one process alternates the model's decode steps with the sum, round by round,
and reports the median of the rounds' paired shares: decode GB/s / sum GB/s, each round
timed within the same second.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def sum_times(x: torch.Tensor, reps: int) -> list[float]:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return ts


def sum_buffer(gib: float, plain: bool) -> torch.Tensor:
    """gib GiB of f32 ones, in huge pages unless plain (or where Linux does not give them)."""
    nbytes = int(gib * (1 << 30)) // 4 * 4
    if plain:
        return torch.ones(nbytes // 4, dtype=torch.float32)
    from fucina.kernels import huge_empty
    return huge_empty(nbytes).view(torch.float32).fill_(1.0)


def paired(a) -> None:
    from fucina import kernels
    from fucina.models.registry import load_model
    from vs_llamacpp import read_bytes

    kernels.set_threads(a.threads)        # torch's threads too (the sum's)
    model = load_model(a.model)
    nbytes = read_bytes(a.model)
    x = sum_buffer(a.gib, a.plain_pages)
    capacity, prompt = 1024, list(range(3, 3 + 16))
    cache = model.init_cache(capacity)
    decode, ceiling, shares = [], [], []
    with torch.inference_mode():
        model.forward_step(cache, prompt, 0)
        for _ in range(a.rounds):
            if cache.len + a.tokens > capacity:
                cache = model.init_cache(capacity)
                model.forward_step(cache, prompt, 0)
            t = time.perf_counter()
            for _ in range(a.tokens):
                model.forward_step(cache, [5], cache.len)
            dec = nbytes * a.tokens / (time.perf_counter() - t) / 1e9
            ceil = x.numel() * 4 / statistics.median(sum_times(x, 3)) / 1e9
            decode.append(dec)
            ceiling.append(ceil)
            shares.append(dec / ceil)
    print(f"{Path(a.model).name}, ISA {kernels.isa()}, {a.threads} thread(s), {nbytes / 1e9:.3f} GB a token: "
          f"decode {statistics.median(decode):.1f} GB/s, sum {statistics.median(ceiling):.1f} GB/s "
          f"(range {min(ceiling):.1f}-{max(ceiling):.1f}); paired share median {statistics.median(shares):.0%} "
          f"(range {min(shares):.0%}-{max(shares):.0%}, {a.rounds} rounds; the sum in "
          f"{'4 KB' if a.plain_pages or not kernels.hugepages() else 'huge'} pages)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", help="a GGUF file: pair its decode with the sum in one process")
    ap.add_argument("--threads", type=int, default=2, help="with --model")
    ap.add_argument("--rounds", type=int, default=9, help="with --model")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps a round, with --model")
    ap.add_argument("--plain-pages", action="store_true", help="sum a buffer in 4 KB pages")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if a.model:
        paired(a)
        return
    x = sum_buffer(a.gib, a.plain_pages)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        x.sum()
        ts = sum_times(x, a.reps)
        nbytes = x.numel() * 4
        print(f"{threads} thread(s): {nbytes / statistics.median(ts) / 1e9:.1f} GB/s median, "
              f"{nbytes / min(ts) / 1e9:.1f} best")


if __name__ == "__main__":
    main()
