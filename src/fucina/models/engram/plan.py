"""Engram's hash plan: where each position's n-gram rows live, as pure integer geometry.

Engram (arXiv 2601.07372) looks up hashed n-gram embeddings; every address is a function
of the token ids alone, so a step's rows are known before the forward reaches the layer.
The semantics are the reference demo's (deepseek-ai/Engram `engram_demo_v1.py`):

1. ids are compressed through a lookup table (`lookup`, ids whose normalised text is the
   same collapse into one; identity when absent); the pad id goes through it too;
2. per Engram layer, `max_ngram` odd int64 multipliers, drawn from numpy's PCG64
   `default_rng(seed + 10007 * layer)` in [0, half_bound) then 2r + 1, with
   half_bound = (int64 max // compressed vocabulary) // 2; or given (a file's own);
3. head table sizes: for each layer, order 2..max_ngram, head, the next prime above the
   order's vocabulary size - 1 (then above the previous head's), never one already taken
   anywhere (the seen set is global, so every head hashes with its own modulus);
4. order n at position t: mix = XOR over k < n of ids[t - k] * mult[k] in wrapping int64
   (positions before the first read the pad), head j's row is mix mod prime (floored);
5. rows carry their head's offset into one concatenated table per layer.

numpy only: the plan is what a prefetcher or a table in a mapped file needs, no tensors.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fucina.errors import FucinaError

PRIME_1 = 10007   # the reference's per-layer seed stride
INT64_MAX = np.iinfo(np.int64).max


class EngramError(FucinaError):
    """An Engram graft or its input is inconsistent (geometry, file, ids, model)."""


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def next_prime(start: int, seen: set[int]) -> int:
    """The smallest prime > start not in `seen`."""
    c = start + 1
    while not is_prime(c) or c in seen:
        c += 1
    return c


def head_sizes(layer_ids: Sequence[int], vocab_per_ngram: Sequence[int], n_head: int) -> list[list[list[int]]]:
    """[layer][order][head] table rows: the reference's global prime chain; a vocabulary of
    1 gives one-row heads (the capacity-1 control: every n-gram shares its head's row)."""
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        orders = []
        for v in vocab_per_ngram:
            if v == 1:
                orders.append([1] * n_head)
                continue
            heads, start = [], v - 1
            for _ in range(n_head):
                p = next_prime(start, seen)
                seen.add(p)
                heads.append(p)
                start = p
            orders.append(heads)
        out.append(orders)
    return out


def draw_multipliers(seed: int, layer_id: int, max_ngram: int, n_compressed: int) -> np.ndarray:
    half_bound = max(1, int(INT64_MAX // n_compressed) // 2)
    r = np.random.default_rng(int(seed + PRIME_1 * int(layer_id))).integers(
        low=0, high=half_bound, size=(max_ngram,), dtype=np.int64)
    return r * 2 + 1


class HashPlan:
    """The addresses of every Engram layer's rows.

    `layer_ids`: the decoder layers carrying a memory; `vocab_per_ngram`: one table size per
    order 2..max_ngram; `lookup`: int64 [n_vocab] compression (None: identity over
    `n_vocab`); `multipliers`: int64 [len(layer_ids), max_ngram] (None: drawn from `seed`)."""

    def __init__(self, *, n_vocab: int, layer_ids: Sequence[int], max_ngram: int = 3, n_head: int = 4,
                 vocab_per_ngram: Sequence[int] = (20011, 20011), pad_id: int = 0, seed: int = 0,
                 lookup: np.ndarray | None = None, multipliers: np.ndarray | None = None):
        self.n_vocab, self.layer_ids = int(n_vocab), tuple(int(i) for i in layer_ids)
        self.max_ngram, self.n_head, self.seed = int(max_ngram), int(n_head), int(seed)
        self.vocab_per_ngram = tuple(int(v) for v in vocab_per_ngram)
        if self.n_vocab < 1 or self.max_ngram < 2 or self.n_head < 1 or not self.layer_ids:
            raise EngramError("engram plan: needs n_vocab >= 1, max_ngram >= 2, n_head >= 1 and a layer")
        if len(set(self.layer_ids)) != len(self.layer_ids) or min(self.layer_ids) < 0:
            raise EngramError(f"engram plan: layer ids must be distinct and >= 0, got {list(self.layer_ids)}")
        if len(self.vocab_per_ngram) != self.max_ngram - 1 or min(self.vocab_per_ngram) < 1:
            raise EngramError(f"engram plan: one table size >= 1 per order 2..{self.max_ngram}, "
                              f"got {list(self.vocab_per_ngram)}")
        if lookup is None:
            self.lookup, self.n_compressed = None, self.n_vocab
        else:
            lookup = np.ascontiguousarray(lookup, dtype=np.int64)
            if lookup.shape != (self.n_vocab,) or lookup.min() < 0:
                raise EngramError(f"engram plan: the compression table must be {self.n_vocab} ids >= 0")
            self.lookup, self.n_compressed = lookup, int(lookup.max()) + 1
        if not 0 <= pad_id < self.n_vocab:
            raise EngramError(f"engram plan: pad id {pad_id} out of range [0, {self.n_vocab})")
        self.pad_id = int(pad_id)
        self.pad = int(self.compress(np.array([pad_id]))[0])
        if multipliers is None:
            multipliers = np.stack([draw_multipliers(self.seed, i, self.max_ngram, self.n_compressed)
                                    for i in self.layer_ids])
        multipliers = np.ascontiguousarray(multipliers, dtype=np.int64)
        if multipliers.shape != (len(self.layer_ids), self.max_ngram) or not (multipliers & 1).all():
            raise EngramError(f"engram plan: multipliers must be odd int64 [{len(self.layer_ids)}, {self.max_ngram}]")
        self.multipliers = multipliers
        self.sizes = head_sizes(self.layer_ids, self.vocab_per_ngram, self.n_head)
        # per layer: the flat head sizes, their offsets, the total rows of its table
        self.mods = [np.array([p for order in s for p in order], dtype=np.int64) for s in self.sizes]
        self.offsets = [np.concatenate([[0], np.cumsum(m)[:-1]]).astype(np.int64) for m in self.mods]
        self.table_rows = [int(m.sum()) for m in self.mods]

    @property
    def n_heads_total(self) -> int:
        """Rows gathered per position and layer: (max_ngram - 1) * n_head."""
        return (self.max_ngram - 1) * self.n_head

    def index(self, layer_id: int) -> int:
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise EngramError(f"engram plan: layer {layer_id} carries no memory") from None

    def compress(self, ids: np.ndarray) -> np.ndarray:
        """Raw ids -> compressed ids (checked against the vocabulary)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            raise EngramError(f"engram: token id out of range [0, {self.n_vocab})")
        return ids.copy() if self.lookup is None else self.lookup[ids]

    def rows(self, layer_id: int, ids: np.ndarray, prev: np.ndarray | None = None) -> np.ndarray:
        """int64 [T, n_heads_total] table rows (offsets included) of compressed `ids` [T];
        `prev`: the compressed ids before them (the last max_ngram - 1 are read; the start
        of the sequence when absent or short: pad)."""
        li = self.index(layer_id)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        k = self.max_ngram - 1
        head = np.full(k, self.pad, dtype=np.int64)
        if prev is not None and len(prev):
            p = np.asarray(prev, dtype=np.int64)[-k:]
            head[k - len(p):] = p
        seq, t = np.concatenate([head, ids]), ids.size
        mult, mods, offs = self.multipliers[li], self.mods[li], self.offsets[li]
        out = np.empty((t, self.n_heads_total), dtype=np.int64)
        with np.errstate(over="ignore"):
            mix = seq[k:] * mult[0]
            for n in range(2, self.max_ngram + 1):
                mix = mix ^ (seq[k - (n - 1):k - (n - 1) + t] * mult[n - 1])
                j = (n - 2) * self.n_head
                out[:, j:j + self.n_head] = mix[:, None] % mods[None, j:j + self.n_head]
        return out + offs

    def describe(self) -> dict:
        """What a file records to rebuild the plan (the multipliers and lookup travel as tensors)."""
        return dict(n_vocab=self.n_vocab, layer_ids=list(self.layer_ids), max_ngram=self.max_ngram,
                    n_head=self.n_head, vocab_per_ngram=list(self.vocab_per_ngram), pad_id=self.pad_id,
                    seed=self.seed)
