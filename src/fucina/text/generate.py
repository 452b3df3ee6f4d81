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

from fucina.errors import ContextFull, FucinaError
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
        raise FucinaError("the prompt is empty: nothing to prefill")
    if len(ids) > cache.capacity:
        raise ContextFull(f"prompt of {len(ids)} tokens exceeds the context of {cache.capacity}")
    keep = min(common_prefix(history, ids), len(ids) - 1, cache.len)
    cache.truncate(keep)
    del history[keep:]
    logits = model.forward_step(cache, ids[keep:], keep)
    history.extend(ids[keep:])
    return logits, keep


class ReplyDecoder:
    """One reply's per-token logic, independent of how logits are computed (one stream
    or a lockstep batch): `step(logits)` samples, applies the stop rules and commits,
    returning (token to forward, or None when the reply is over; text to emit)."""

    def __init__(self, cache, history: list[int], sampler: Sampler, tokenizer, *, max_tokens: int,
                 stop_ids: Iterable[int] = (), stop: Sequence[str] = (), reply: Reply | None = None):
        self.cache, self.history, self.sampler = cache, history, sampler
        self.max_tokens = max_tokens
        self.stop_ids = set(int(i) for i in stop_ids)
        self.stream, self.scan = PieceStream(tokenizer), StopScanner(stop)
        self.reply = reply if reply is not None else Reply()
        self.done = False

    def step(self, logits: torch.Tensor) -> tuple[int | None, str]:
        r = self.reply
        if len(r.tokens) >= self.max_tokens:
            r.finish_reason = "length"
            return None, self._finish()
        return self.accept(self.sampler.next(logits, self.history))

    def accept(self, tok: int) -> tuple[int | None, str]:
        """The stop rules and the commit for one chosen token (sampled or forced)."""
        r = self.reply
        if tok in self.stop_ids:
            r.finish_reason, r.stop_token = "stop", tok
            return None, self._finish()
        if self.cache.len >= self.cache.capacity:
            r.finish_reason = "context"
            return None, self._finish()
        piece = self.scan.feed(self.stream.push(tok))
        if self.scan.fired is not None:
            r.finish_reason, r.fired_stop = "stop", self.scan.fired
            self.done = True
            return None, piece
        self.history.append(tok)
        r.tokens.append(tok)
        return tok, piece

    def forced(self) -> list[int]:
        """The tokens the sampler's grammar forces next (llguidance fast-forward),
        committed to it; the caller passes each to `accept` and forwards them together."""
        proc = self.sampler.processor
        ff = getattr(proc, "fast_forward", None)
        if ff is None:
            return []
        room = min(self.max_tokens - len(self.reply.tokens), self.cache.capacity - self.cache.len - 1)
        return ff(room) if room > 0 else []

    def _finish(self) -> str:
        self.done = True
        tail = self.scan.feed(self.stream.flush())
        if self.scan.fired is not None:
            self.reply.finish_reason, self.reply.fired_stop = "stop", self.scan.fired
        else:
            tail += self.scan.flush()
        return tail

    def close(self) -> Reply:
        """Settle the reply; a token committed but never forwarded (an abandoned
        stream) is taken back so that history matches the cache again."""
        extra = len(self.history) - self.cache.len
        if extra > 0:
            del self.history[self.cache.len:]
            del self.reply.tokens[len(self.reply.tokens) - extra:]
        self.reply.text = self.scan.reply
        return self.reply


def decode(model, cache, history: list[int], logits: torch.Tensor, sampler: Sampler, tokenizer, *,
           max_tokens: int, stop_ids: Iterable[int] = (), stop: Sequence[str] = (),
           reply: Reply | None = None) -> Generator[str, None, Reply]:
    """Generate one reply after a prefill. Yields text pieces; returns the Reply (filled
    in place when given, so an abandoned stream's partial reply stays readable)."""
    rd = ReplyDecoder(cache, history, sampler, tokenizer, max_tokens=max_tokens,
                      stop_ids=stop_ids, stop=stop, reply=reply)
    return (yield from drive(model, rd, logits))


def drive(model, rd: ReplyDecoder, logits: torch.Tensor) -> Generator[str, None, Reply]:
    """Run one ReplyDecoder with single-stream forward steps; yields its text."""
    try:
        while True:
            tok, piece = rd.step(logits)
            if piece:
                yield piece
            if tok is None:
                break
            toks = [tok]
            for f in rd.forced():              # grammar-forced span: one multi-token step
                ftok, piece = rd.accept(f)
                if piece:
                    yield piece
                if ftok is None:
                    break
                toks.append(ftok)
            logits = model.forward_step(rd.cache, toks, rd.cache.len)
            if rd.done:
                break
    finally:
        rd.close()
    return rd.reply


def run(gen: Generator[str, None, Reply], on_piece: Callable[[str], None] | None = None) -> Reply:
    """Drive a decode generator to its Reply, handing each piece to `on_piece`."""
    while True:
        try:
            piece = next(gen)
        except StopIteration as done:
            return done.value
        if on_piece is not None:
            on_piece(piece)
