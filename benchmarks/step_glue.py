"""Where a single-token decode step's time goes outside the native layer step and the
output matmul: each statement of the native path of `forward_step` timed in place.

    python benchmarks/step_glue.py MODEL.gguf [--threads 2] [--steps 48] [--reps 6]

A copy of the path `DecoderBase.forward_step` takes for one token on a family with a native
plan and no residual hooks (llama-shaped embed and head), timed statement by statement with
`time.perf_counter` inside a greedy decode loop; medians per part. Set FUCINA_ISA to time
another ISA level.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fucina.models import load_model
from fucina.models.base import as_ids, rms_norm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    import fucina.kernels as kernels
    from fucina.models.hub import resolve_model

    kernels.set_threads(args.threads)
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model))
    if model.native_plan is None or getattr(model, "final_softcap", 0) or model.residual_hooks:
        raise SystemExit("step_glue: needs a model on the native step with a plain norm + matmul head")
    parts: dict[str, list[float]] = {}

    @torch.inference_mode()
    def step(cache, tokens, pos0):
        def mark(name, t0):
            t = time.perf_counter()
            parts.setdefault(name, []).append(t - t0)
            return t
        t = time.perf_counter()
        ids = as_ids(tokens, model.config.n_vocab); t = mark("token ids (as_ids)", t)
        cache.check_room(ids.numel()); t = mark("check_room", t)
        x = model.embed(ids); t = mark("embedding row", t)
        ptrs = model._native_cache(cache); t = mark("cache pointer table", t)
        tables = [tb.table(pos0 + 1) for tb in model.rope_tables(cache.capacity)]; t = mark("rope tables", t)
        x = x.float().contiguous(); t = mark("f32 / contiguous", t)
        min(model.native_chunk, cache.step_limit()); t = mark("step_limit", t)
        cache.reserve(1); t = mark("cache reserve", t)
        model.native_plan.run(x, ptrs, pos0, tables); t = mark("LAYERS (native step)", t)
        cache.advance(1); t = mark("cache advance", t)
        last = x[-1:]; t = mark("last row sliced", t)
        h = rms_norm(last, model.output_norm, model.config.rms_eps); t = mark("final RMS norm", t)
        logits = model.output.linear(h); t = mark("HEAD (output matmul)", t)
        row = logits[0]; mark("logits row indexed", t)
        return row

    for _ in range(args.reps):
        cache = model.init_cache(args.steps + 8)
        logits = model.forward_step(cache, [1, 2, 3, 4], 0)
        for _ in range(args.steps):
            logits = step(cache, [int(torch.argmax(logits))], cache.len)
    med = {k: statistics.median(v[args.steps:] or v) for k, v in parts.items()}   # the first repetition warms up
    total = sum(med.values())
    glue = sum(v for k, v in med.items() if not k.isupper() and not k.split(" ")[0].isupper())
    for k, v in med.items():
        print(f"{k:24s} {1e6 * v:10.1f} us")
    print(f"step {1e3 * total:.3f} ms, glue {1e6 * glue:.0f} us ({100 * glue / total:.1f}%)")


if __name__ == "__main__":
    main()
