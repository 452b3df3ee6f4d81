"""Model-level measurements generic over any Decoder: greedy continuation, teacher-forced
logits, perplexity the way llama-perplexity computes it, and warm speed."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch

from fucina.errors import FucinaError
from fucina.text.sampler import first_argmax


def greedy(model, prompt: Sequence[int], n: int, stop: Callable[[int], bool] | None = None,
           on_token: Callable[[int], None] | None = None) -> list[int]:
    """Argmax continuation of `prompt` for up to `n` tokens (stops after a `stop` token,
    which is not returned)."""
    cache = model.init_cache(len(prompt) + n)
    logits = model.forward_step(cache, list(prompt), 0)
    out: list[int] = []
    for _ in range(n):
        t = first_argmax(logits)
        if stop is not None and stop(t):
            break
        out.append(t)
        if on_token:
            on_token(t)
        if len(out) == n:
            break
        logits = model.forward_step(cache, [t], cache.len)
    return out


def teacher_forced_logits(model, ids: Sequence[int], last: int = 0, chunk: int = 512) -> torch.Tensor:
    """Logits of every position (or the last `last`), as llama-logits writes them."""
    cache = model.init_cache(len(ids))
    rows = []
    first = len(ids) - last if 0 < last < len(ids) else 0
    for s in range(0, len(ids), chunk):
        part = list(ids[s:s + chunk])
        lg = model.forward_step_all_logits(cache, part, s)
        lo = max(first - s, 0)
        if lo < len(part):
            rows.append(lg[lo:])
    return torch.cat(rows)


def perplexity(model, tokens: Sequence[int], n_ctx: int, bos_id: int | None,
               log: Callable[[str], None] | None = None) -> tuple[float, int]:
    """llama-perplexity's figure: chunks of n_ctx tokens, BOS over each chunk's first token
    when the model adds BOS, score the second half of every chunk. Returns (ppl, chunks)."""
    n_chunk = len(tokens) // n_ctx
    if len(tokens) < 2 * n_ctx:
        raise FucinaError(f"need at least {2 * n_ctx} tokens for a context of {n_ctx}, "
                          f"have {len(tokens)}")
    first = n_ctx // 2
    nll, count = 0.0, 0
    for i in range(n_chunk):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        cache = model.init_cache(n_ctx)
        logits = model.forward_step_all_logits(cache, chunk, 0)
        lp = torch.log_softmax(logits[first:n_ctx - 1].double(), dim=-1)
        target = torch.tensor(tokens[i * n_ctx + first + 1:(i + 1) * n_ctx])
        nll -= float(lp.gather(1, target[:, None]).sum())
        count += n_ctx - 1 - first
        if log:
            log(f"[{i + 1}]{math.exp(nll / count):.4f}")
    return math.exp(nll / count), n_chunk


def bench(model, pp: int | Sequence[int], tg: int, reps: int, seed: int = 0, depth: int = 0,
          progress: Callable[[], None] = lambda: None) -> dict:
    """Warm prefill of `pp` tokens and decode of `tg` tokens, like llama-bench's pp/tg
    tests; with `depth` both start after that many tokens already in the cache
    (llama-bench -d). Tokens/s are medians over `reps` after one warm-up; `progress`
    is called after every timed or warm-up run. `pp` a list (llama-bench -p 1,16,128):
    one prefill test per length, each a prefix of one prompt, in `prefill` {pp: tok/s}."""
    pps = [pp] if isinstance(pp, int) else [p for p in pp if p > 0]
    g = torch.Generator().manual_seed(seed)
    n_vocab = model.config.n_vocab
    context = torch.randint(0, n_vocab, (depth,), generator=g).tolist()
    longest = max(pps, default=0)
    prompt_all = torch.randint(0, n_vocab, (longest,), generator=g).tolist()
    gen = torch.randint(0, n_vocab, (tg,), generator=g).tolist()
    cache = model.init_cache(depth + max(longest, tg) + 1, rewindable=depth > 0)  # each run rewinds to depth
    if depth:
        for s in range(0, depth, 512):
            model.forward_step(cache, context[s:s + 512], s)

    def run_pp(n: int) -> float:
        cache.truncate(depth)
        t = time.perf_counter()
        model.forward_step(cache, prompt_all[:n], depth)
        dt = time.perf_counter() - t
        progress()
        return n / dt

    def run_tg() -> float:
        cache.truncate(depth)
        t = time.perf_counter()
        for i, tok in enumerate(gen):
            model.forward_step(cache, [tok], depth + i)
        dt = time.perf_counter() - t
        progress()
        return tg / dt

    out = {}
    if isinstance(pp, int):
        if pp > 0:
            run_pp(pp)
            out["prefill_tok_s"] = statistics.median(run_pp(pp) for _ in range(reps))
    else:
        out["prefill"] = {}
        for n in pps:
            run_pp(n)
            out["prefill"][n] = statistics.median(run_pp(n) for _ in range(reps))
    if tg > 0:
        run_tg()
        out["decode_tok_s"] = statistics.median(run_tg() for _ in range(reps))
    return out
