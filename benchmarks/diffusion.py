"""Text diffusion speed: a 256-token reply denoised by fucina and by llama-diffusion-cli on
the same random-weight file with the same settings, alternated, plus one canvas pass.

    python benchmarks/diffusion.py [--arch dream] [--reps 3] [--steps 64] [--threads 2]

Writes a synthetic dream (or llada) GGUF (byte vocabulary, Q8_0 weights, a Qwen2.5-0.5B-
shaped block, 8 layers), then for each rep runs fucina's loop in-process and the oracle
($FUCINA_LLAMA_CPP/llama-diffusion-cli, timed by its own "total time" line, which excludes
loading) and prints the reply tokens/s of each and their ratio. Both canvases are checked
equal. Needs FUCINA_LLAMA_CPP."""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import gguf  # noqa: E402

from oracle import oracle_dir  # noqa: E402
from synth import write_model  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."
REPLY = 256


def oracle_run(d: Path, path: str, canvas: int, a) -> tuple[float, bytes]:
    cmd = [str(d / "llama-diffusion-cli"), "-m", path, "-p", PROMPT, "-ub", str(canvas), "-c", str(canvas),
           "-b", str(canvas), "--diffusion-steps", str(a.steps), "--diffusion-eps", "0.001", "--seed", "1",
           "-t", str(a.threads)]
    for _ in range(8):   # its log thread may be cut off at exit: repeat until the result is there
        r = subprocess.run(cmd, capture_output=True, env=dict(os.environ, LD_LIBRARY_PATH=str(d)))
        m = re.search(rb"total time: ([0-9.]+)ms", r.stderr)
        tail = r.stderr[m.end():] if m else b""
        j = tail.find(b"I \n")
        if m and j >= 0 and tail.endswith(b"\n"):
            return float(m.group(1)) / 1e3, tail[j + 3:-1]
    raise SystemExit("llama-diffusion-cli never logged its result")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="dream", choices=("dream", "llada"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    d = oracle_dir()
    if d is None:
        raise SystemExit("set FUCINA_LLAMA_CPP to llama.cpp's bin/")
    import torch

    import fucina
    from fucina import kernels
    from fucina.text.diffusion import DiffusionConfig, denoise

    kernels.set_threads(a.threads)
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp) / f"{a.arch}.gguf", a.arch, layers=8, hidden=896, heads=14, kv_heads=2,
                           head_dim=64, ffn=4864, qtype=gguf.GGMLQuantizationType.Q8_0, ctx=4096)
        llm = fucina.load(path)
        m = llm.model
        ids = llm.tokenizer.encode(llm.template.render([{"role": "user", "content": PROMPT}]))
        canvas = len(ids) + REPLY
        cfg = DiffusionConfig(canvas=canvas, steps=a.steps, eps=0.001, seed=1)
        c = m.canvas_cache(canvas)
        m.forward_canvas(ids + [m.config.mask_token_id] * REPLY, c)        # warm
        t = time.perf_counter()
        for _ in range(3):
            m.forward_canvas(ids + [m.config.mask_token_id] * REPLY, c)
        full_pass = (time.perf_counter() - t) / 3
        ours, theirs = [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            out = denoise(m, ids, cfg)
            ours.append(time.perf_counter() - t)
            secs, text = oracle_run(d, path, canvas, a)
            theirs.append(secs)
        mine = b"".join(llm.tokenizer.token_to_piece(i, False) for i in out[len(ids):])
        print(f"{a.arch}: canvas {canvas} ({len(ids)} prompt + {REPLY}), {a.steps} steps, {a.threads} threads; "
              f"canvases equal: {mine == text}")
        print(f"one full canvas pass (all {canvas} rows' logits): {full_pass * 1e3:.1f} ms")
        fo, lo = statistics.median(ours), statistics.median(theirs)
        print(f"fucina     {REPLY / fo:7.1f} reply tok/s  ({fo * 1e3 / a.steps:.1f} ms/step)  runs {[round(x, 3) for x in ours]}")
        print(f"llama.cpp  {REPLY / lo:7.1f} reply tok/s  ({lo * 1e3 / a.steps:.1f} ms/step)  runs {[round(x, 3) for x in theirs]}")
        print(f"ratio (fucina / llama.cpp, tok/s): {lo / fo:.2f}x; per-rep pairs: "
              f"{[round(t2 / t1, 2) for t1, t2 in zip(ours, theirs)]}")


if __name__ == "__main__":
    main()
