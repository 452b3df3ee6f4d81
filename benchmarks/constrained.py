"""Constrained decoding cost: bridge build, mask time per token, decode tok/s.

    python benchmarks/constrained.py [--reps 3] [--tokens 96] [--threads 2] [--json]

1. The tokenizer bridge (`lltokenizer`): build time for SmolLM2 (49,152 ids) and the
   Qwen3 vocabulary (151,936 ids), each from a fresh Tokenizer.
2. Mask time per token, p50/p99, at every state of a real constrained reply (replayed
   through a fresh matcher, so each state's mask is computed cold, as in decode):
   `compute` is llguidance's mask into our reusable buffer (paid every token);
   `ours apply` our application of it to the torch row (unpack + masked_fill_), paid
   only when the sampler's first choice is forbidden (`first-choice miss`);
   `llg numpy apply` llguidance's own numpy helper (apply_token_bitmask_inplace), the
   path a Python integration would pay on every token.
3. Decode tok/s, constrained against unconstrained, paired (A B A B ...), medians: on
   SmolLM2 (chat, a JSON-schema reply) and on the random-weight Qwen3-0.6B Q4_K_M
   (raw completion: the 151,936-id vocabulary under the same schema), temperature 0.8
   (the draw-first path) and with top-k 40 (mask-first), and the share of reply
   tokens the grammar fast-forwarded (no sampling, forwarded in one multi-token step).
   tok/s counts reply tokens over the decode time after the first piece.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

SMOL = Path.home() / ".cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN = Path(os.environ.get("FUCINA_BENCH_QWEN3", "qwen3-0.6b-Q4_K_M.gguf"))     # a Qwen3-0.6B Q4_K_M file
QWEN_VOCAB = Path(os.environ.get("FUCINA_QWEN3_VOCAB", "vocab-qwen3.gguf"))      # its tokenizer-only GGUF

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 3, "maxItems": 6},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "summary": {"type": "string", "maxLength": 160}},
    "required": ["title", "tags", "rating", "summary"], "additionalProperties": False}


def pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else float("nan")


def bridge_build(path: Path) -> dict:
    from fucina.text.constraint import lltokenizer
    from fucina.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    t = time.perf_counter()
    lltokenizer(tok)
    return {"n_vocab": tok.n_vocab, "build_s": time.perf_counter() - t}


def mask_times(tok, tokens: list[int], grammar: str, stop_ids, n_logits: int) -> dict:
    """Replay a reply's tokens through a fresh Constraint; at each state time the mask
    (computed cold) and applying it, ours against llguidance's numpy helper."""
    import llguidance.numpy as lnp

    from fucina.text.constraint import Constraint, apply_mask

    c = Constraint(tok, grammar, stop_ids=stop_ids, n_vocab=n_logits)
    comp, ours, theirs = [], [], []
    row = torch.randn(n_logits)
    for warm in range(2):                                 # first-touch of both apply paths
        apply_mask(row.clone(), c.allowed_words())
        lnp.apply_token_bitmask_inplace(row.numpy().copy()[None, :c.n_vocab], c.allowed_words()[None, :])
    for t in [*tokens, None]:
        c._fresh = False
        a = time.perf_counter_ns()
        words = c.allowed_words()
        comp.append(time.perf_counter_ns() - a)
        r = row.clone()
        a = time.perf_counter_ns()
        apply_mask(r, words)
        ours.append(time.perf_counter_ns() - a)
        x = row.numpy().copy()[None, :c.n_vocab]
        a = time.perf_counter_ns()
        lnp.apply_token_bitmask_inplace(x, words[None, :])
        theirs.append(time.perf_counter_ns() - a)
        if t is not None:
            c.commit(t)
    us = 1e-3
    return {"states": len(comp),
            "compute_p50_us": pct(comp, 50) * us, "compute_p99_us": pct(comp, 99) * us,
            "ours_apply_p50_us": pct(ours, 50) * us, "ours_apply_p99_us": pct(ours, 99) * us,
            "llg_numpy_apply_p50_us": pct(theirs, 50) * us, "llg_numpy_apply_p99_us": pct(theirs, 99) * us}


def decode_once(llm, prompt: str, *, chat: bool, tokens: int, grammar: str | None, cfg: dict):
    """One reply; returns (Reply, seconds after its first piece, Sampler)."""
    from fucina.models.cache_q8 import make_cache
    from fucina.text.constraint import for_reply
    from fucina.text.sampler import Sampler, SamplingConfig

    config = SamplingConfig(**cfg)
    if chat:
        conv = llm.chat(**cfg)
        conv.sampler.processor = for_reply(llm.tokenizer, grammar, stop_ids=conv.stop_ids,
                                           n_vocab=llm.config.n_vocab, template=llm.template)
        gen, sampler = conv.stream(prompt, max_tokens=tokens), conv.sampler
    else:
        if llm._cache is None:
            llm._cache = make_cache(llm.model, llm.n_ctx, llm.cache_type)
        proc = for_reply(llm.tokenizer, grammar, stop_ids=llm._stop_ids(), n_vocab=llm.config.n_vocab)
        sampler = Sampler(config, proc)
        gen = llm._complete(llm.tokenize(prompt), tokens, sampler, [])
    first = None
    for _ in gen:
        first = first or time.perf_counter()
    end = time.perf_counter()
    return (conv.last if chat else llm.last), end - (first or end), sampler


def paired_decode(llm, prompt: str, *, chat: bool, tokens: int, reps: int) -> dict:
    from fucina.text import grammar as grammars

    g = grammars.from_options(json_schema=SCHEMA)
    variants = {"plain": (None, dict(temperature=0.8)), "json": (g, dict(temperature=0.8)),
                "json_topk40": (g, dict(temperature=0.8, top_k=40))}
    rates: dict[str, list[float]] = {k: [] for k in variants}
    ff = total = sampled = misses = 0
    for r in range(reps):
        for name, (grammar, cfg) in variants.items():
            reply, secs, sampler = decode_once(llm, prompt, chat=chat, tokens=tokens, grammar=grammar,
                                               cfg=dict(cfg, seed=100 + r))
            n = len(reply.tokens)
            if secs > 0 and n > 1:
                rates[name].append((n - 1) / secs)
            if name == "json":
                proc = sampler.processor
                ff, total = ff + proc.forced, total + n
                picks = n - proc.forced + (reply.stop_token is not None)   # sampled tokens
                sampled, misses = sampled + picks, misses + sampler.draws - picks
    out = {k: statistics.median(v) if v else float("nan") for k, v in rates.items()}
    out.update({"json_vs_plain": out["json"] / out["plain"], "json_topk40_vs_plain": out["json_topk40"] / out["plain"],
                "fast_forwarded_share": ff / total if total else float("nan"),
                "first_choice_miss_share": misses / sampled if sampled else float("nan")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import fucina.kernels as kernels
    from fucina.text.api import load

    kernels.set_threads(args.threads)
    res: dict = {"bridge": {}, "mask": {}, "decode": {}}
    for name, path in (("smollm2", SMOL), ("qwen3", QWEN_VOCAB)):
        if path.exists():
            res["bridge"][name] = bridge_build(path)
    for name, path, chat, prompt in (("smollm2", SMOL, True, "Review a film as JSON."),
                                     ("qwen3-0.6b-Q4_K_M", QWEN, False, "Review:")):
        if not path.exists():
            continue
        llm = load(path, n_ctx=1024)
        decode_once(llm, prompt, chat=chat, tokens=8, grammar=None, cfg=dict(temperature=0.8))   # warm-up
        res["decode"][name] = paired_decode(llm, prompt, chat=chat, tokens=args.tokens, reps=args.reps)
        reply = llm.chat(json_schema=SCHEMA, temperature=0.8, seed=1, think=False)
        reply.send(prompt, max_tokens=args.tokens)
        stop = llm.template.stop_ids(llm.tokenizer)
        grammar = reply.sampler.processor.grammar      # think-wrapped on a thinking template
        res["mask"][name] = mask_times(llm.tokenizer, reply.last.tokens, grammar, stop, llm.config.n_vocab)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    for name, b in res["bridge"].items():
        print(f"bridge  {name:<20} {b['n_vocab']:>7} ids  {b['build_s'] * 1e3:7.0f} ms")
    for name, m in res["mask"].items():
        print(f"mask    {name:<20} compute p50/p99 {m['compute_p50_us']:6.0f}/{m['compute_p99_us']:6.0f} us  "
              f"ours apply {m['ours_apply_p50_us']:5.0f}/{m['ours_apply_p99_us']:5.0f} us  "
              f"llg numpy apply {m['llg_numpy_apply_p50_us']:5.0f}/{m['llg_numpy_apply_p99_us']:5.0f} us  "
              f"({m['states']} states)")
    for name, d in res["decode"].items():
        extra = f"  first-choice miss {d['first_choice_miss_share']:.0%}"
        print(f"decode  {name:<20} plain {d['plain']:6.1f}  json {d['json']:6.1f} ({d['json_vs_plain']:.2f}x)  "
              f"json top-k 40 {d['json_topk40']:6.1f} ({d['json_topk40_vs_plain']:.2f}x) tok/s  "
              f"fast-forwarded {d['fast_forwarded_share']:.0%}{extra}")


if __name__ == "__main__":
    main()
