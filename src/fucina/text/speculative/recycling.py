"""Token recycling: a vocab x K table of the latest top-K next-token candidates seen
after each token (Luo et al. 2024), drafting by walking its top-1 chain.

Rows are refreshed from verification logits (`observe_topk`); every committed bigram
(a, b) is promoted to slot 0 of row a, because ground truth beats stale logits.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from fucina.text.speculative.source import DraftSource

SENTINEL = -1


class TokenRecycling(DraftSource):
    wants_topk = True

    def __init__(self, n_vocab: int, k: int = 8):
        self.k = k
        self.table = np.full((n_vocab, k), SENTINEL, dtype=np.int32)
        self.prev: int | None = None   # the last observed token (bigram head)

    def topk_of(self, token: int) -> list[int]:
        row = self.table[token]
        return [int(t) for t in row if t != SENTINEL]

    def update(self, token: int, topk: Sequence[int]) -> None:
        if not 0 <= token < self.table.shape[0]:
            return
        ids = [int(t) for t in topk[:self.k]]
        self.table[token] = ids + [SENTINEL] * (self.k - len(ids))

    def promote(self, a: int, b: int) -> None:
        n = self.table.shape[0]
        if not (0 <= a < n and 0 <= b < n):
            return
        row = self.table[a]
        old = row.tolist()
        if old[0] != b:      # b first, the rest in order (sentinels stay at the tail)
            row[:] = ([b] + [t for t in old if t != b])[:self.k]

    def draft_chain(self, last_token: int, n: int) -> list[int]:
        out: list[int] = []
        t = int(last_token)
        if not 0 <= t < self.table.shape[0]:
            return out
        while len(out) < n:
            t = int(self.table[t, 0])
            if t == SENTINEL:
                break
            out.append(t)
        return out

    # DraftSource
    def suggest(self, context: Sequence[int], n: int) -> list[int]:
        return self.draft_chain(context[-1], n) if context else []

    def observe(self, committed: Sequence[int]) -> None:
        for t in committed:
            t = int(t)
            if self.prev is not None:
                self.promote(self.prev, t)
            self.prev = t

    def observe_topk(self, tokens: Sequence[int], topk: Sequence[Sequence[int]]) -> None:
        for t, row in zip(tokens, topk):
            self.update(int(t), row)

    def sync(self, history: Sequence[int]) -> None:
        self.prev = int(history[-1]) if len(history) else None
