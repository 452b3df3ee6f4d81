"""MTPDrafter: chained drafts from a multi-token-prediction head (models/mtp.py).

The head keeps its own one-layer cache, entry q made from the committed token x_q and the
trunk's state at q - 1 (the trunk cache's `hidden_rows`, written by every forward). Before
drafting it catches up the entries the last verify committed (one multi-row head pass),
then drafts token by token from its own state: each drafted token goes back in with the
head's output as the state (chained drafts), and the entries past the committed ones are
dropped after. Drafts only propose; the verify pass decides, so a head can cost speed but
never change a token. `seconds_per_token` (an EWMA of a draft's wall time per drafted
token, catch-up included) is what the cost gate charges a draft on top of its verify rows.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from fucina.text.generate import common_prefix
from fucina.text.speculative.source import DraftSource


class MTPDrafter(DraftSource):
    def __init__(self, head, p_min: float = 0.0):
        self.head, self.p_min = head, p_min
        self.cache = None          # the trunk's cache (its hidden rows)
        self.hcache = None         # the head's own cache
        self.toks: list[int] = []  # the committed tokens whose entries the head cache holds
        self.seconds_per_token: float | None = None

    def bind(self, cache) -> None:
        if cache is not self.cache:
            self.cache = cache
            self.hcache = self.head.init_cache(cache.capacity)
            self.toks = []

    def usable(self) -> bool:
        return self.cache is not None and self.cache.hidden_rows is not None

    def _truncate(self, n: int) -> None:
        n = self.hcache.truncate_point(min(n, self.hcache.len))
        self.hcache.truncate(n)
        del self.toks[n:]

    def sync(self, history: Sequence[int]) -> None:
        if self.hcache is not None:
            self._truncate(common_prefix(self.toks, history))

    def suggest(self, context: Sequence[int], n: int) -> list[int]:
        if n <= 0 or not context or not self.usable():
            return []
        t0 = time.perf_counter()
        head, rows, L = self.head, self.cache.hidden_rows, len(context)
        last = min(L - 1, self.cache.len)          # the last entry the trunk's states reach
        self._truncate(min(common_prefix(self.toks, context), last))
        m0 = self.hcache.len
        new = [int(t) for t in context[m0:last + 1]]
        states = rows[max(m0 - 1, 0):last]
        if m0 == 0:                                 # position 0 has no state before it
            states = torch.cat([torch.zeros(1, rows.shape[1]), states])
        hn = head.forward(self.hcache, new, head.trunk_state(states), m0)[-1]
        self.toks += new
        real, pos = self.hcache.len, self.hcache.len
        try:
            for t in context[last + 1:]:            # carried tokens the trunk has not run yet
                hn = head.forward(self.hcache, [int(t)], hn[None], pos)[-1]
                pos += 1
            draft: list[int] = []
            while True:
                tok, p = head.draft_token(hn)
                if p < self.p_min:
                    break
                draft.append(tok)
                if len(draft) >= n or pos >= self.hcache.capacity:
                    break
                hn = head.forward(self.hcache, [tok], hn[None], pos)[-1]
                pos += 1
        finally:
            self.hcache.truncate(real)
        if draft:
            per = (time.perf_counter() - t0) / len(draft)
            self.seconds_per_token = per if self.seconds_per_token is None else \
                0.8 * self.seconds_per_token + 0.2 * per
        return draft
