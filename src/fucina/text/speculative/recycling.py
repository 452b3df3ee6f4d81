"""Token recycling: per token, the latest top-K next-token candidates seen after it
(Luo et al. 2024), drafting by walking the top-1 chain.

Rows are refreshed from verification logits (`observe_topk`); every committed bigram
(a, b) is promoted to slot 0 of row a, because ground truth beats stale logits. Rows are
Python lists in a dict, made for the tokens seen: a promote is ~1 us where a row of a
vocab x K numpy table cost ~15 us a committed token, and memory follows the stream, not
the vocabulary (262k x 8 ids on Gemma-3).
"""
from __future__ import annotations

from typing import Sequence

from fucina.text.speculative.source import DraftSource


class TokenRecycling(DraftSource):
    wants_topk = True

    def __init__(self, n_vocab: int, k: int = 8):
        self.n_vocab, self.k = n_vocab, k
        self.rows: dict[int, list[int]] = {}
        self.prev: int | None = None   # the last observed token (bigram head)

    def topk_of(self, token: int) -> list[int]:
        return list(self.rows.get(token, ()))

    def update(self, token: int, topk: Sequence[int]) -> None:
        if 0 <= token < self.n_vocab:
            self.rows[token] = [int(t) for t in topk[:self.k]]

    def promote(self, a: int, b: int) -> None:
        if not (0 <= a < self.n_vocab and 0 <= b < self.n_vocab):
            return
        row = self.rows.get(a)
        if row is None:
            self.rows[a] = [b]
        elif row[0] != b:      # b first, the rest in order
            if b in row:
                row.remove(b)
            elif len(row) == self.k:
                row.pop()
            row.insert(0, b)

    def draft_chain(self, last_token: int, n: int) -> list[int]:
        out: list[int] = []
        rows, t = self.rows, int(last_token)
        while len(out) < n:
            row = rows.get(t)
            if not row:
                break
            t = row[0]
            out.append(t)
        return out

    # DraftSource
    def suggest(self, context: Sequence[int], n: int) -> list[int]:
        return self.draft_chain(context[-1], n) if context else []

    def observe(self, committed: Sequence[int]) -> None:
        prev = self.prev
        for t in committed:
            if prev is not None:
                self.promote(prev, t)
            prev = t
        self.prev = prev

    def observe_topk(self, tokens: Sequence[int], topk: Sequence[Sequence[int]]) -> None:
        for t, row in zip(tokens, topk):
            self.update(int(t), row)

    def sync(self, history: Sequence[int]) -> None:
        self.prev = int(history[-1]) if len(history) else None
