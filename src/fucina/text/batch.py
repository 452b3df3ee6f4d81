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

`ragged_step(model, caches, tokens, want[, every_row])` is the server's pass: segment s appends
tokens[s] (one token for a decoding stream, a chunk of prompt for a prefilling one)
to caches[s]. With the native layer step it is ONE weight pass over all rows: the
step's batch mode takes a cache and a position per row, stores every row's K/V
before any row attends, so the rows of a chunk repeat their cache at consecutive
positions and each attends causally over what precedes it (a speculative stream's verify
segment takes every row's logits: `every_row`). Without it (torch blocks,
q8_0 caches, models without the batch entry point) the decode rows go as one
`forward_step_batch` and each prefill chunk as its own `forward_step`, failures
isolated per segment.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fucina.errors import FucinaError, KVCacheError
from fucina.models.base import as_ids
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


class SegmentError(FucinaError):
    """A ragged step's segment failed on its own (the others went on)."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def native_rows(model, caches: Sequence):
    """The native pointer tables of `caches` when one native pass can serve them all, else None."""
    if getattr(model, "native_plan", None) is None or getattr(model, "residual_hooks", None):
        return None   # residual hooks: the per-stream steps run them
    ptrs = [model._native_cache(c) for c in caches]
    return ptrs if all(p is not None for p in ptrs) else None


def ragged_step(model, caches: Sequence, tokens: Sequence[Sequence[int]], want: Sequence[bool],
                every_row: Sequence[bool] = ()) -> list[torch.Tensor | None | SegmentError]:
    """Append tokens[s] to caches[s] (at caches[s].len) for every segment s in one pass
    where the model allows; return segment s's last-position logits [n_vocab] where
    want[s], else None; where every_row[s], the logits of all its rows [len, n_vocab]
    (a speculative stream's verify rows). A segment that failed alone comes back as a
    SegmentError (the caller rewinds its cache); a failure of the shared pass raises."""
    every_row = list(every_row) or [False] * len(caches)
    if not caches or not (len(caches) == len(tokens) == len(want) == len(every_row)):
        raise FucinaError(f"ragged step: {len(caches)} caches, {len(tokens)} segments, {len(want)} flags, "
                          f"{len(every_row)} every-row flags")
    if len({id(c) for c in caches}) != len(caches):
        raise KVCacheError("ragged step: the same cache appears twice")
    if any(len(t) == 0 for t in tokens):
        raise FucinaError("ragged step: an empty segment")
    ptrs = native_rows(model, caches)
    if ptrs is not None:
        return _ragged_native(model, caches, tokens, want, ptrs, every_row)
    return _ragged_split(model, caches, tokens, want, every_row)


@torch.inference_mode()
def _ragged_native(model, caches, tokens, want, ptrs, every_row) -> list[torch.Tensor | None]:
    for c, t in zip(caches, tokens):
        if len(t) > c.step_limit():
            raise FucinaError(f"ragged step: a segment of {len(t)} rows exceeds the cache's step "
                              f"limit of {c.step_limit()}")
        c.reserve(len(t))     # a window memory makes room here (its table follows)
    flat = [int(i) for t in tokens for i in t]
    x = model.embed(as_ids(flat, model.config.n_vocab)).float().contiguous()
    rows, positions, picked, spans = [], [], [], []
    for c, p, t, w, every in zip(caches, ptrs, tokens, want, every_row):
        first = len(positions)
        rows += [p] * len(t)
        positions += range(c.len, c.len + len(t))
        spans.append((len(picked), every, w))
        picked += range(first, len(positions)) if every else [len(positions) - 1] if w else []
    end = max(positions) + 1
    model.native_plan.run_batch(x, rows, positions, [t.table(end) for t in model.rope_tables()])
    at = 0
    for c, t in zip(caches, tokens):
        if c.hidden_rows is not None:      # an MTP head drafts from them
            c.hidden_rows[c.len:c.len + len(t)] = x[at:at + len(t)]
        at += len(t)
        c.advance(len(t))
    out: list[torch.Tensor | None] = [None] * len(caches)
    if picked:
        logits = model.head(x[picked])
        out = [logits[at:at + len(t)] if every else logits[at] if w else None
               for (at, every, w), t in zip(spans, tokens)]
    return out


def _ragged_split(model, caches, tokens, want, every_row) -> list[torch.Tensor | None | SegmentError]:
    out: list[torch.Tensor | None | SegmentError] = [None] * len(caches)
    decode = [s for s, t in enumerate(tokens) if len(t) == 1 and not every_row[s]]
    if len(decode) > 1:
        logits = forward_step_batch(model, [caches[s] for s in decode], [tokens[s][0] for s in decode])
        for row, s in enumerate(decode):
            out[s] = logits[row] if want[s] else None
        done = set(decode)
    else:
        done = set()
    for s, (c, t) in enumerate(zip(caches, tokens)):
        if s in done:
            continue
        try:
            if every_row[s]:
                logits = model.forward_step_all_logits(c, list(t), c.len)
            else:
                logits = model.forward_step(c, list(t), c.len)
        except Exception as e:          # this segment alone
            out[s] = SegmentError(e)
            continue
        out[s] = logits if want[s] else None
    return out


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
