"""diffusion-gemma speed on a random-weight file (no public diffusion-gemma GGUF exists and
llama.cpp has no released runner for it, so there is no oracle to pair with):

    python benchmarks/diffusion_gemma.py [--reps 3] [--steps 16] [--threads 2]

Writes a Q8_0 diffusion-gemma file (Gemma 4 layers: 640 wide, 8 heads, 2 KV heads,
head dims 128 global / 64 sliding, FFN 2048, 6 layers, a 256-position canvas, the byte
vocabulary) and its gemma4 twin (the same backbone), then times, alternated per rep:
- one canvas pass (256 rows over a 64-token prompt, the torch blocks) against the
  twin's prefill of the same 256 rows at the same position (gemma4's native step): what
  running the passes without a native kernel costs;
- the sampler over the canvas's logits;
- a 256-token reply (`--steps` max steps per canvas), as reply tokens/s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from synth_diffusion_gemma import write_diffusion_gemma  # noqa: E402

SHAPE = dict(layers=6, hidden=640, heads=8, kv_heads=2, head_dim=128, ffn=2048, window=512,
             qtype=gguf.GGMLQuantizationType.Q8_0)
PROMPT, CANVAS, REPLY = 64, 256, 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch

    from fucina import kernels
    from fucina.models import load_model
    from fucina.text import diffusion_gemma as dg

    kernels.set_threads(a.threads)
    tmp = Path(tempfile.mkdtemp())
    m = load_model(write_diffusion_gemma(tmp / "dg.gguf", canvas=CANVAS, **SHAPE))
    g4 = load_model(write_diffusion_gemma(tmp / "g4.gguf", twin=True, **SHAPE))
    assert g4.native_plan is not None, "the twin should run gemma4's native step"
    prompt = [2] + [40 + i % 60 for i in range(PROMPT - 1)]
    canvas = np.arange(CANVAS) % 200 + 3
    cfg = dg.GemmaDiffusionConfig.for_model(m, steps=a.steps, seed=1)
    rows = {"canvas pass (torch)": [], "gemma4 prefill (native)": [], "sampler": [], "reply tok/s": []}
    for _ in range(a.reps):
        cache = m.init_cache(PROMPT + 2 * CANVAS)
        m.encode_step(cache, prompt, 0)
        t0 = time.perf_counter()
        logits = m.canvas_forward(cache, canvas)
        rows["canvas pass (torch)"].append(time.perf_counter() - t0)
        c4 = g4.init_cache(PROMPT + CANVAS)
        with torch.inference_mode():
            g4.forward_step(c4, prompt, 0)
            t0 = time.perf_counter()
            g4.forward_step(c4, canvas.tolist(), PROMPT)
        rows["gemma4 prefill (native)"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dg.sampler_pass(logits.numpy(), 0.8, np.full(CANVAS, 0.5, np.float32), collect_sc=m.has_self_conditioning)
        rows["sampler"].append(time.perf_counter() - t0)
        cache = m.init_cache(dg.capacity(PROMPT, REPLY, CANVAS))
        t0 = time.perf_counter()
        n = steps = 0
        for blk in dg.blocks(m, cache, prompt, REPLY, cfg, set()):
            n += len(blk.kept)
            steps += blk.steps
        rows["reply tok/s"].append(n / (time.perf_counter() - t0))
    print(f"threads {a.threads}, steps <= {a.steps} per canvas, last reply: {n} tokens in {steps} steps")
    for name, v in rows.items():
        unit = "" if "tok/s" in name else " s"
        print(f"{name:26s} median {statistics.median(v):8.3f}{unit}   ({', '.join(f'{x:.3f}' for x in v)})")


if __name__ == "__main__":
    main()
