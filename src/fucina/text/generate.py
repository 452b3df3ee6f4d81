"""The generation loop every front end shares (LLM.generate/stream, Conversation).

Prefill reuses the longest common token prefix with what the cache already holds (a
rewind is `cache.truncate`), then: sample → stop-id check → stream → stop-string check
→ commit → forward one token. Text leaves through an incremental UTF-8 decoder, so a
character split across tokens is never emitted half; text that could be the start of
a stop string is held back until it is known not to be one. The token that completes a
stop string (or is a stop id) is neither streamed nor committed.

Invariant kept on every exit, an abandoned stream included: `len(history) == cache.len`.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Sequence

import torch

from fucina.errors import ContextFull
from fucina.text.sampler import Sampler


@dataclass
class Reply:
    text: str = ""
    tokens: list[int] = field(default_factory=list)   # committed reply tokens
    finish_reason: str = "length"    # "stop" (stop id or string), "length" (max_tokens), "context"
    stop_token: int | None = None
    fired_stop: int | None = None    # index into the stop strings of the one that fired
    prompt_tokens: int = 0
    reused_tokens: int = 0           # prompt tokens served from the cache (cached_tokens)


class PieceStream:
    """Token ids in, UTF-8-safe text out (`token_to_piece` bytes through an incremental
    decoder; an unfinished character waits for the next piece)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self._dec.decode(self.tokenizer.token_to_piece(int(token)))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def pieces_text(tokenizer, ids: Iterable[int]) -> str:
    return b"".join(tokenizer.token_to_piece(int(i)) for i in ids).decode("utf-8", "replace")


class StopScanner:
    """Finds stop strings in a growing text and decides what may be emitted: everything
    before a fired stop; otherwise all but a tail that is a proper prefix of a stop."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.emitted = 0
        self.fired: int | None = None
        self.cut: int | None = None    # where the fired stop starts in text

    def feed(self, piece: str) -> str:
        old = len(self.text)
        self.text += piece
        best = None
        for i, s in enumerate(self.stops):
            at = self.text.find(s, max(0, old - len(s) + 1))
            if at >= 0 and (best is None or at < best[1]):
                best = (i, at)
        if best is not None:
            self.fired, self.cut = best
            out = self.text[self.emitted:self.cut]
            self.emitted = self.cut
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        end = len(self.text) - hold
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out

    @property
    def reply(self) -> str:
        return self.text[:self.cut] if self.cut is not None else self.text


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefill(model, cache, history: list[int], ids: Sequence[int]) -> tuple[torch.Tensor, int]:
    """Make the cache hold `ids` and return the last position's logits, reusing the
    longest common prefix with `history` (the ids the cache holds; updated in place).
    At least one token is always forwarded (logits are not cached state)."""
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("prefill needs at least one token")
    if len(ids) > cache.capacity:
        raise ContextFull(f"prompt of {len(ids)} tokens exceeds the context of {cache.capacity}")
    keep = min(common_prefix(history, ids), len(ids) - 1, cache.len)
    cache.truncate(keep)
    del history[keep:]
    logits = model.forward_step(cache, ids[keep:], keep)
    history.extend(ids[keep:])
    return logits, keep


def decode(model, cache, history: list[int], logits: torch.Tensor, sampler: Sampler, tokenizer, *,
           max_tokens: int, stop_ids: Iterable[int] = (), stop: Sequence[str] = (),
           reply: Reply | None = None) -> Generator[str, None, Reply]:
    """Generate one reply after a prefill. Yields text pieces; returns the Reply (filled
    in place when given, so an abandoned stream's partial reply stays readable)."""
    stop_ids = set(int(i) for i in stop_ids)
    stream, scan = PieceStream(tokenizer), StopScanner(stop)
    reply = reply if reply is not None else Reply()
    try:
        while True:
            if len(reply.tokens) >= max_tokens:
                reply.finish_reason = "length"
                break
            tok = sampler.next(logits, history)
            if tok in stop_ids:
                reply.finish_reason, reply.stop_token = "stop", tok
                break
            if cache.len >= cache.capacity:
                reply.finish_reason = "context"
                break
            piece = scan.feed(stream.push(tok))
            if scan.fired is not None:
                reply.finish_reason, reply.fired_stop = "stop", scan.fired
                if piece:
                    yield piece
                break
            history.append(tok)
            reply.tokens.append(tok)
            if piece:
                yield piece
            logits = model.forward_step(cache, [tok], cache.len)
        if scan.fired is None:
            tail = scan.feed(stream.flush())
            if scan.fired is not None:
                reply.finish_reason, reply.fired_stop = "stop", scan.fired
            else:
                tail += scan.flush()
            if tail:
                yield tail
    finally:
        extra = len(history) - cache.len     # a stream abandoned between commit and forward
        if extra > 0:
            del history[cache.len:]
            del reply.tokens[len(reply.tokens) - extra:]
        reply.text = scan.reply
    return reply


def run(gen: Generator[str, None, Reply], on_piece: Callable[[str], None] | None = None) -> Reply:
    """Drive a decode generator to its Reply, handing each piece to `on_piece`."""
    while True:
        try:
            piece = next(gen)
        except StopIteration as done:
            return done.value
        if on_piece is not None:
            on_piece(piece)
