"""What BPE and SentencePiece share: the per-piece cache and the pair-merging queue."""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

Sym = TypeVar("Sym", str, bytes)
CACHE_MAX = 1 << 18   # pieces remembered before a cache starts over


def encode_cached(pieces: Iterable[str], cache: dict[str, tuple[int, ...]],
                  miss: Callable[[str], tuple[int, ...]], out: list[int]) -> None:
    """out += ids of every piece; a piece's ids never depend on its neighbours."""
    get = cache.get
    extend = out.extend
    for piece in pieces:
        ids = get(piece)
        if ids is None:
            ids = miss(piece)
            if len(cache) >= CACHE_MAX:
                cache.clear()
            cache[piece] = ids
        extend(ids)


def heap_merge(syms: list[Sym], priority: Callable[[Sym, Sym], Any]) -> list[Sym]:
    """Merge adjacent symbols best-priority first (smallest key; leftmost on a tie) until
    no pair has a priority (None). `syms` is consumed."""
    n = len(syms)
    if n < 2:
        return syms
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap: list[tuple[Any, int, int, Sym]] = []
    for i in range(n - 1):
        key = priority(syms[i], syms[i + 1])
        if key is not None:
            heap.append((key, i, i + 1, syms[i] + syms[i + 1]))
    heapq.heapify(heap)
    while heap:
        _, i, j, text = heapq.heappop(heap)
        if not syms[i] or not syms[j] or syms[i] + syms[j] != text:
            continue                      # outdated: one side merged since
        syms[i] = text
        syms[j] = syms[j][:0]
        k = nxt[j]
        nxt[i] = k
        if k >= 0:
            prv[k] = i
        for a, b in ((prv[i], i), (i, k)):
            if a >= 0 and b >= 0:
                key = priority(syms[a], syms[b])
                if key is not None:
                    heapq.heappush(heap, (key, a, b, syms[a] + syms[b]))
    out = []
    i = 0
    while i >= 0:
        out.append(syms[i])
        i = nxt[i]
    return out
