"""How costs grow with length: pp512 and tg32 at depth 2048, fucina beside llama-bench.

    python benchmarks/growth.py MODEL.gguf [...] [--llama-bench PATH] [--threads 2] [--reps 2]

Each model: `fucina bench M --pp 512 --tg 0` and `--pp 0 --tg 32 --depth 2048` (JSON,
with peak RSS), then `llama-bench -m M -p 512 -n 32 -d 0,2048`, back to back. llama-bench
finds its libraries beside it (LD_LIBRARY_PATH is set to its directory; see tests/oracle.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess


def fucina(model: str, threads: int, reps: int, *args: str) -> dict:
    out = subprocess.run(["fucina", "bench", model, "--threads", str(threads), "--reps", str(reps), "--json",
                          *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama(bench: str, model: str, threads: int, reps: int) -> dict:
    libs = os.path.dirname(os.path.abspath(bench))   # its libraries sit beside it (tests/oracle.py)
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [libs, os.environ.get("LD_LIBRARY_PATH")])))
    out = subprocess.run([bench, "-m", model, "-t", str(threads), "-p", "512", "-n", "32", "-d", "0,2048",
                          "-r", str(reps), "-o", "json"], capture_output=True, text=True, check=True, env=env).stdout
    return {(r["n_prompt"], r["n_gen"], r["n_depth"]): r["avg_ts"] for r in json.loads(out)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    print("| model | pp512 fucina / llama.cpp | tg32 at depth 2048 fucina / llama.cpp | peak RSS MB |")
    print("| --- | --- | --- | --- |")
    for m in a.models:
        pp = fucina(m, a.threads, a.reps, "--pp", "512", "--tg", "0")
        tg = fucina(m, a.threads, a.reps, "--pp", "0", "--tg", "32", "--depth", "2048")
        lc = llama(a.llama_bench, m, a.threads, a.reps) if a.llama_bench else {}
        lpp, ltg = lc.get((512, 0, 0)), lc.get((0, 32, 2048))
        fmt = (lambda f, l: f"{f:.1f} / {l:.1f} ({f / l:.2f}x)" if l else f"{f:.1f}")
        print(f"| {os.path.basename(m)} | {fmt(pp['prefill_tok_s'], lpp)} | {fmt(tg['decode_tok_s'], ltg)} "
              f"| {max(pp['peak_rss_mb'], tg['peak_rss_mb']):.0f} |")


if __name__ == "__main__":
    main()
