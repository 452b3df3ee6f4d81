"""The deepseek2 KV cache's bytes per position: fucina's latent cache beside llama.cpp's.

    FUCINA_LLAMA_CPP=/path/to/llama.cpp/bin python benchmarks/mla_cache_bytes.py [--ctx 4096]

Writes random-weight deepseek2 GGUFs with DeepSeek-V2-Lite's attention geometry (16 heads,
kv_lora_rank 512, rope 64, nope 128, v 128; tiny experts and 2 layers: the cache's cost per
layer does not depend on them) in both generations, asks llama.cpp for its KV buffer (the
`llama_kv_cache: size = ...` line llama-completion logs at -c CTX) and fucina for its
cache's nbytes at the same capacity, and prints bytes per position per layer.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import oracle  # noqa: E402
from synth_deepseek2 import write_deepseek2  # noqa: E402

from fucina.models import load_model  # noqa: E402

LITE = dict(layers=2, hidden=256, heads=16, q_lora=0, kv_lora=512, nope=128, rope=64, v_head=128, ffn=256,
            ffn_exp=32, experts=8, used=2, shared=1, dense_lead=1)


def llama_cpp_kv_bytes(path: str, ctx: int) -> int:
    d = oracle.oracle_dir()
    import os
    import subprocess
    r = subprocess.run([str(d / "llama-completion"), "-m", path, "-p", "a", "-n", "1", "-c", str(ctx), "-t", "2",
                        "-no-cnv", "--temp", "0", "-v"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, LD_LIBRARY_PATH=str(d)))
    found = list(re.finditer(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells.*", r.stderr + r.stdout))
    m = found[-1] if found else None     # (the last: the context's cache after the fit probe)
    if m is None:
        raise RuntimeError("no KV size line in llama-completion's log:\n" + r.stderr[-3000:])
    assert int(m.group(2)) == ctx, m.group(0)
    print("  llama.cpp:", m.group(0))
    return round(float(m.group(1)) * 2 ** 20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    assert oracle.oracle_dir(), "set FUCINA_LLAMA_CPP"
    with tempfile.TemporaryDirectory() as tmp:
        for gen in ("split", "kv_b"):
            path = write_deepseek2(Path(tmp) / f"{gen}.gguf", generation=gen, **LITE)
            theirs = llama_cpp_kv_bytes(path, args.ctx)
            model = load_model(path)
            ours = model.init_cache(args.ctx).nbytes()
            n = LITE["layers"] * args.ctx
            print(f"{gen:5s}: bytes per position per layer  fucina {ours / n:.0f}  llama.cpp {theirs / n:.0f}  "
                  f"(ratio {ours / theirs:.3f})")


if __name__ == "__main__":
    main()
