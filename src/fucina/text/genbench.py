"""Generation-stack measurements behind BENCHMARK.md's "Generation" section.

    python -m fucina.text.genbench MODEL.gguf [--tokens 256] [--streams 4] [--threads 2]

prints one JSON object: q8_0-vs-f16 KV cache agreement over a long greedy run (free
running, and teacher-forced along the f16 path), the caches' sizes, and lockstep
batch-decode throughput against the same streams run one after another.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from fucina.models.cache_q8 import make_cache
from fucina.text.batch import bench_streams

PROMPT = ("<|im_start|>user\nWrite a long story about a lighthouse keeper who finds a "
          "message in a bottle.<|im_end|>\n<|im_start|>assistant\n")


def greedy_run(model, ids: list[int], n: int, cache_type: str) -> list[int]:
    cache = make_cache(model, len(ids) + n + 1, cache_type)
    logits = model.forward_step(cache, ids, 0)
    out = []
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        logits = model.forward_step(cache, out[-1:], cache.len)
    return out


def q8_agreement(model, ids: list[int], n: int) -> dict:
    t = time.perf_counter()
    f16 = greedy_run(model, ids, n, "f16")
    q8 = greedy_run(model, ids, n, "q8_0")
    first_div = next((i for i, (a, b) in enumerate(zip(f16, q8)) if a != b), n)
    seq = ids + f16
    a = model.forward_step_all_logits(make_cache(model, len(seq), "f16"), seq, 0)[len(ids) - 1:-1]
    b = model.forward_step_all_logits(make_cache(model, len(seq), "q8_0"), seq, 0)[len(ids) - 1:-1]
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    pa, pb = torch.log_softmax(a.float(), -1), torch.log_softmax(b.float(), -1)
    kl = (pa.exp() * (pa - pb)).sum(-1)
    cap = 4096
    return {"tokens": n, "free_running_identical_prefix": first_div,
            "free_running_agreement": sum(x == y for x, y in zip(f16, q8)) / n,
            "teacher_forced_top1_agreement": top1,
            "teacher_forced_mean_kl": kl.mean().item(), "teacher_forced_max_kl": kl.max().item(),
            "max_abs_logit_diff": (a - b).abs().max().item(),
            f"kv_bytes_f16_at_{cap}": make_cache(model, cap, "f16").nbytes(),
            f"kv_bytes_q8_0_at_{cap}": make_cache(model, cap, "q8_0").nbytes(),
            "seconds": time.perf_counter() - t}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fucina.text.genbench")
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--batch-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-q8", action="store_true")
    args = p.parse_args(argv)
    import fucina.kernels as kernels
    from fucina.models import load_model
    from fucina.text.tokenizer import Tokenizer

    if hasattr(kernels, "set_threads"):
        kernels.set_threads(args.threads)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tok = Tokenizer.from_metadata(model.gguf.metadata)
    res: dict = {"model": str(model.gguf.path), "threads": args.threads}
    bench_streams(model, 2, 3)                                    # warm up
    res["batch"] = bench_streams(model, args.streams, args.batch_tokens)
    if not args.skip_q8:
        res["q8_0"] = q8_agreement(model, tok.encode(PROMPT), args.tokens)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
