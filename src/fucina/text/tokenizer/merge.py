"""What BPE and SentencePiece share: the per-piece cache and the pair-merging queue.

The merge loops also exist in C++ (`_merge`, csrc/tokenizer/), built at install: an
engine that has it wraps its Python `encode_piece` in `NativePieces`, and the pieces of
a text missing from the cache go to native code in one call. Without the module (or with
FUCINA_TOKENIZER_NATIVE=0) everything runs in Python, to the same ids.
"""
from __future__ import annotations

import heapq
import os
from collections.abc import Callable
from itertools import chain
from typing import Any, TypeVar

try:
    from fucina.text.tokenizer import _merge as native
except ImportError:   # not built: the pure-Python path
    native = None

Sym = TypeVar("Sym", str, bytes)
CACHE_MAX = 1 << 18   # pieces remembered before a cache starts over
LIST_MAX = 64         # pieces up to this many symbols merge with list scans, longer with a heap


def use_native(want: bool | None = None) -> bool:
    """Whether an engine built now should merge natively: `want` if given, else yes when
    the module is built and FUCINA_TOKENIZER_NATIVE is not "0"."""
    if want is None:
        want = os.environ.get("FUCINA_TOKENIZER_NATIVE", "1") != "0"
    return bool(want) and native is not None


class NativePieces:
    """A piece encoder: call it on one piece, or `many` on a batch (one native call).
    A piece the native code declines (None) goes to the Python encoder, which gives the
    same ids or raises the typed error."""

    __slots__ = ("engine", "python")

    def __init__(self, engine: Any, python: Callable[[Any], tuple[int, ...]]):
        self.engine = engine
        self.python = python

    def __call__(self, piece: Any) -> tuple[int, ...]:
        return self.many([piece])[0]

    def many(self, pieces: list[Any]) -> list[tuple[int, ...]]:
        got = self.engine.encode_many(pieces)
        if None in got:
            got = [self.python(p) if ids is None else ids for p, ids in zip(pieces, got)]
        return got


def encode_cached(pieces: list[Any], cache: dict[Any, tuple[int, ...]],
                  miss: Callable[[Any], tuple[int, ...]], out: list[int]) -> dict[Any, tuple[int, ...]]:
    """out += ids of every piece; a piece's ids never depend on its neighbours.

    Written as whole-list passes (set difference, map, chain) so the per-piece work
    runs in C; only pieces never seen before reach `miss` (all in one `miss.many` call
    when it has that batch form). A piece may be an int: an already-resolved token id,
    standing for itself. Returns the cache to keep: a full one is replaced, never
    cleared, so a concurrent caller's view stays whole.
    """
    missing = set(pieces).difference(cache)
    if missing:
        if len(cache) + len(missing) > CACHE_MAX:
            cache = {}
            missing = set(pieces)
        many = getattr(miss, "many", None)
        if many is not None:
            batch = list(missing)
            cache.update(zip(batch, many(batch)))
        else:
            cache.update(zip(missing, map(miss, missing)))
    out.extend(chain.from_iterable(map(cache.__getitem__, pieces)))
    return cache


def list_merge(syms: list[Sym], keys: list[Any], key_of: Callable[[Sym, Sym], Any], none: Any) -> list[Sym]:
    """Merge adjacent symbols best key first (smallest; leftmost on a tie) until every
    pair's key is `none`. keys[i] is the key of (syms[i], syms[i+1]). Quadratic in C
    (min/index over a short list), linear in Python: the fast path for short pieces."""
    while keys:
        k = min(keys)
        if k == none:
            break
        i = keys.index(k)
        a = syms[i] + syms[i + 1]
        syms[i] = a
        del syms[i + 1]
        del keys[i]
        if i:
            keys[i - 1] = key_of(syms[i - 1], a)
        if i < len(keys):
            keys[i] = key_of(a, syms[i + 1])
    return syms


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
