"""Lockstep batch decode: N streams, each with its own cache, advance by one token per
step, the dense trunk (QKV, O, FFN, lm_head) running as ONE m=N pass so the weights
are read once for all streams; RoPE positions, KV appends and attention stay per
stream (ragged: each row against its own cache at its own position).

`forward_step_batch(model, caches, tokens)` uses the model's own one-pass
`forward_step_batch(caches, tokens)` when it sets `supports_batch` (every family whose
blocks route attention through `fucina.models.base.attend`: llama, qwen3, gemma3), else
N sequential `forward_step` calls (correct, no weight-pass saving).

`generate_batch` drives it: per-stream prefill, then lockstep sampling with one
Sampler per stream, each stream stopping on its own.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fucina.errors import FucinaError, KVCacheError
from fucina.text.generate import Reply, ReplyDecoder, prefill
from fucina.text.sampler import Sampler


def _check(model, caches: Sequence, tokens: Sequence[int]) -> None:
    if not caches:
        raise FucinaError("batch decode needs at least one stream")
    if len(caches) != len(tokens):
        raise FucinaError(f"batch decode: {len(caches)} caches for {len(tokens)} tokens")
    if len({id(c) for c in caches}) != len(caches):
        raise KVCacheError("batch decode: the same cache appears twice")
    n_layer = model.config.n_layer
    for c in caches:
        if c.n_layers != n_layer:
            raise KVCacheError(f"batch decode: a cache has {c.n_layers} layers, the model {n_layer}")
        c.check_room(1)


def forward_step_batch(model, caches: Sequence, tokens: Sequence[int]) -> torch.Tensor:
    """Append one token per stream (stream s at position caches[s].len) and return the
    next-token logits [N, n_vocab]; every cache advances by one."""
    tokens = [int(t) for t in tokens]
    _check(model, caches, tokens)
    if getattr(model, "supports_batch", False):
        return model.forward_step_batch(caches, tokens)
    return torch.stack([model.forward_step(cache, [t], cache.len) for cache, t in zip(caches, tokens)])


def generate_batch(model, tokenizer, prompts: Sequence[Sequence[int]], samplers: Sequence[Sampler], *,
                   max_tokens: int = 128, stop_ids: Sequence[int] = (), stop: Sequence[str] = (),
                   caches: Sequence | None = None, capacity: int | None = None,
                   on_piece: Callable[[int, str], None] | None = None) -> list[Reply]:
    """Complete N prompts (token ids) in lockstep, one Sampler per stream. Per-stream
    semantics equal N separate `decode` runs (same draws, stops, limits); a stream that
    finishes drops out of the batch. `on_piece(stream, text)` receives streamed text."""
    n = len(prompts)
    if len(samplers) != n:
        raise FucinaError(f"generate_batch: {n} prompts for {len(samplers)} samplers")
    if caches is None:
        caches = [model.init_cache(capacity or max(len(p) + max_tokens, 1)) for p in prompts]
    histories: list[list[int]] = [[] for _ in range(n)]
    logits: list[torch.Tensor] = []
    decoders = []
    for s in range(n):
        caches[s].reset()
        lg, reused = prefill(model, caches[s], histories[s], prompts[s])
        logits.append(lg)
        decoders.append(ReplyDecoder(caches[s], histories[s], samplers[s], tokenizer,
                                     max_tokens=max_tokens, stop_ids=stop_ids, stop=stop,
                                     reply=Reply(prompt_tokens=len(prompts[s]), reused_tokens=reused)))
    try:
        lockstep(model, decoders, logits, on_piece)
    finally:
        replies = [d.close() for d in decoders]
    return replies


def lockstep(model, decoders: Sequence[ReplyDecoder], logits: list[torch.Tensor],
             on_piece: Callable[[int, str], None] | None = None) -> None:
    """Step N ReplyDecoders together until all are done: each step samples every live
    stream from its own logits row, then forwards the streams that continue in one
    batched step. (The caller closes the decoders.)"""
    live = list(range(len(decoders)))
    while live:
        forward = []
        for s in live:
            tok, piece = decoders[s].step(logits[s])
            if piece and on_piece is not None:
                on_piece(s, piece)
            if tok is not None:
                forward.append((s, tok))
        if not forward:
            return
        out = forward_step_batch(model, [decoders[s].cache for s, _ in forward], [t for _, t in forward])
        for row, (s, _) in enumerate(forward):
            logits[s] = out[row]
        live = [s for s, _ in forward]


def bench_streams(model, n_streams: int = 4, n_tokens: int = 32, prompt_len: int = 16) -> dict:
    """Aggregate greedy decode throughput of N lockstep streams against the same N
    streams run one after another (prefill excluded from both). Returns tok/s figures
    and whether the two produced the same tokens."""
    import time

    prompts = [[(97 + 7 * s + j) % model.config.n_vocab for j in range(prompt_len)] for s in range(n_streams)]

    def greedy(logits):
        return [int(t) for t in torch.argmax(logits.reshape(-1, logits.shape[-1]), dim=-1)]

    def prefilled():
        caches = [model.init_cache(prompt_len + n_tokens + 1) for _ in prompts]
        return caches, [model.forward_step(c, p, 0) for c, p in zip(caches, prompts)]

    caches, first = prefilled()
    t0 = time.perf_counter()
    seq = []
    for c, lg in zip(caches, first):
        toks = greedy(lg)
        for _ in range(n_tokens - 1):
            toks += greedy(model.forward_step(c, toks[-1:], c.len))
        seq.append(toks)
    t_seq = time.perf_counter() - t0

    caches, first = prefilled()
    t0 = time.perf_counter()
    bat = [greedy(lg) for lg in first]
    for _ in range(n_tokens - 1):
        out = forward_step_batch(model, caches, [b[-1] for b in bat])
        for b, t in zip(bat, greedy(out)):
            b.append(t)
    t_bat = time.perf_counter() - t0
    total = n_streams * (n_tokens - 1)
    return {"streams": n_streams, "tokens_per_stream": n_tokens,
            "sequential_tok_s": total / t_seq, "batch_tok_s": total / t_bat,
            "gain": t_seq / t_bat, "same_tokens": seq == bat,
            "agreement": sum(a == b for s, t in zip(seq, bat) for a, b in zip(s, t)) / (n_streams * n_tokens)}
