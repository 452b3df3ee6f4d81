"""The cache protocol: one length over per-layer memories (fucina.models.cache.memory).

Generic code (prefill with prefix reuse, Conversation, server slots, kv_persist, the
native step) asks the cache what it can do instead of probing its type:

  len, capacity, n_layers           what it holds
  append / keys / values / span     rows of one layer (span: positions [start, end))
  reserve(m), step_limit()          room for a step of m rows; the longest step it takes
  advance(m)                        commit m appended positions
  can_truncate(n), truncate_point(n), truncate(n), reset()
                                    rewinds: window layers and recurrent states reach back
                                    only as far as they hold; truncate raises past that
  rewind_reach()                    positions a step may append and still rewind to len
                                    (a speculative verify sizes its draft by it)
  copy_rows(src, start, end)        adopt another same-layout cache's rows
  nbytes(), bytes_per_position()    memory now / per extra position
  layout()                          per layer (kind, storage, geometry): persistence's key
  native_table()                    the pointer table the native step reads, or None

`KVCache(n_layers, kv_heads, head_dim, capacity)` is the all-positions f16 cache it
always was; `KVCache.of(memories, capacity)` builds any mix (models do, from their
per-layer specs: `DecoderBase.init_cache`).
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch

from fucina.errors import ContextFull, KVCacheError
from fucina.models.cache.memory import AliasKV, KVMemory, LatentKV, RecurrentState, WindowKV
from fucina.models.cache.rows import dequantize_q8_0, quantize_q8_0

__all__ = ["KVCache", "Q8Cache", "KVMemory", "WindowKV", "LatentKV", "AliasKV", "RecurrentState",
           "quantize_q8_0", "dequantize_q8_0", "cache_capacity"]


def _per_layer(x: int | list[int], n: int) -> list[int]:
    return list(x) if isinstance(x, (list, tuple)) else [x] * n


def cache_capacity(capacity: int | None, n_ctx_train: int, cache_type: str | None = None) -> int:
    """The positions a model's new cache holds: `capacity`, or by default the training
    context up to 4096; raises KVCacheError unless it is positive or unless `cache_type` is
    f16 or q8_0 (None: the caller has checked the type itself)."""
    if cache_type is not None and cache_type not in ("f16", "q8_0"):
        raise KVCacheError(f"unknown cache type {cache_type!r} (f16 or q8_0)")
    cap = capacity or min(n_ctx_train, 4096)
    if cap <= 0:
        raise KVCacheError(f"cache capacity must be positive, got {cap}")
    return cap


class KVCache:
    training = False   # models.base.attention: True only on the training stand-in (train.forward)
    hidden_rows = None  # [capacity, n_embd] f32: each position's last hidden row, when the model keeps them

    # objects whose rows_copied(dst, src, start, end) runs after every copy_rows: state a system
    # keeps per cache by position (an Engram graft's history) follows the rows (held weakly)
    copy_listeners: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, n_layers: int, kv_heads: int | list[int], head_dim: int | list[int],
                 capacity: int, dtype: torch.dtype = torch.float16, *, v_dim: int | list[int] | None = None,
                 storage: str = "f16"):
        heads, dims = _per_layer(kv_heads, n_layers), _per_layer(head_dim, n_layers)
        vdims = _per_layer(v_dim, n_layers) if v_dim is not None else dims
        self._setup([KVMemory(capacity, h, d, vd, storage, dtype) for h, d, vd in zip(heads, dims, vdims)]
                    if capacity > 0 else [], capacity)

    @classmethod
    def of(cls, memories: Sequence, capacity: int) -> "KVCache":
        cache = cls.__new__(cls)
        cache._setup(memories, capacity)
        return cache

    def _setup(self, memories: Sequence, capacity: int) -> None:
        if capacity <= 0:
            raise KVCacheError(f"cache capacity must be positive, got {capacity}")
        self.memories = list(memories)
        self.capacity = capacity
        self.len = 0
        stores = {m.k.dtype for m in self.memories if isinstance(m, KVMemory)}
        # the storage the rows are in: a torch dtype for plain rows, "q8_0" for blocks
        self.dtype = stores.pop() if len(stores) == 1 else "mixed"
        self._native = None

    @property
    def n_layers(self) -> int:
        return len(self.memories)

    # -- rows ----------------------------------------------------------------------
    def check_room(self, m: int) -> None:
        if self.len + m > self.capacity:
            raise ContextFull(f"{self.len} cached + {m} new tokens exceed the context of "
                              f"{self.capacity}")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write [m, kv_heads, head_dim] rows at offset len (does not advance)."""
        self.check_room(k.shape[0])
        self.memories[layer].write(self.len, k, v)

    def span(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end) of one layer (windowed layers hold only recent ones)."""
        return self.memories[layer].span(start, end)

    def keys(self, layer: int, n: int) -> torch.Tensor:
        return self.span(layer, 0, n)[0]

    def values(self, layer: int, n: int) -> torch.Tensor:
        return self.span(layer, 0, n)[1]

    def reserve(self, m: int) -> None:
        """Room for a step of m rows at positions len.. in every layer."""
        self.check_room(m)
        for mem in self.memories:
            mem.reserve(self.len, m)

    def step_limit(self) -> int:
        """The most rows one step may append (a window memory holds window + slack rows)."""
        return min((mem.step_limit() for mem in self.memories), default=self.capacity)

    def advance(self, m: int) -> None:
        self.check_room(m)
        self.len += m
        for mem in self.memories:
            mem.commit(self.len)

    # -- rewinds -------------------------------------------------------------------
    def can_truncate(self, keep: int) -> bool:
        keep = max(0, keep)
        return all(mem.can_truncate(keep, self.len) for mem in self.memories)

    def truncate_point(self, n: int) -> int:
        """The longest prefix <= n this cache can rewind to (0 always works)."""
        n = max(0, min(n, self.len))
        if self.can_truncate(n):
            return n
        # memories that rewind only to listed lengths (recurrent snapshots): the longest one below n
        points = {p for mem in self.memories for p in mem.rewind_points() if p < n}
        return next((p for p in sorted(points, reverse=True) if self.can_truncate(p)), 0)

    def rewind_reach(self) -> int:
        """How many positions may be appended with today's length still a rewind point
        (unbounded for rows kept per position; a recurrent state's snapshot horizon)."""
        return min((mem.rewind_reach() for mem in self.memories), default=self.capacity)

    def truncate(self, keep: int) -> None:
        keep = max(0, keep)
        if keep >= self.len:
            return
        if not self.can_truncate(keep):
            raise KVCacheError(f"cannot rewind to {keep}: a layer no longer holds what position "
                               f"{keep} reads (rewind to truncate_point({keep}) = 0 instead)")
        for mem in self.memories:
            mem.truncate(keep)
        self.len = keep

    def reset(self) -> None:
        self.truncate(0)

    def copy_rows(self, src: "KVCache", start: int, end: int) -> None:
        """Adopt rows [start, end) of a same-layout cache at the same positions."""
        if self.len != start or end > src.len or start > end:
            raise KVCacheError(f"copy_rows [{start}, {end}) needs len == {start} (is {self.len}) "
                               f"and end <= source len {src.len}")
        if end > self.capacity or not isinstance(src, KVCache) or src.layout() != self.layout():
            raise KVCacheError("copy_rows: cache geometry or type differs")
        for mine, theirs in zip(self.memories, src.memories):
            mine.copy_from(theirs, start, end)
        self.len = end
        for mem in self.memories:
            mem.commit(end)
        for listener in list(KVCache.copy_listeners):
            listener.rows_copied(self, src, start, end)

    # -- costs and descriptions ------------------------------------------------------
    def nbytes(self) -> int:
        return sum(mem.nbytes() for mem in self.memories)

    def bytes_per_position(self) -> int:
        """What one more position costs (window layers: nothing once their window is full)."""
        return sum(mem.bytes_per_position() for mem in self.memories if mem.kind != "window")

    def layout(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(mem.kind, mem.storage, mem.descriptor()) for mem in self.memories]

    def native_table(self):
        """The native step's pointer table (kernels.KVPointers: per layer k, v, base, rows;
        the memories keep `base` current), or None when some layer has no native route."""
        if self._native is None:
            entries = [mem.native_entry() for mem in self.memories]
            if not entries or any(e is None for e in entries):
                self._native = False
            else:
                from fucina.kernels import KVPointers
                with torch.inference_mode(False):   # memories update it outside inference too
                    table = torch.tensor(entries, dtype=torch.int64)
                for i, mem in enumerate(self.memories):
                    mem.table_row = table[i]
                self._native = KVPointers(table.reshape(-1), self.capacity, self.geometry())
        return self._native or None

    def geometry(self) -> list[tuple]:
        """Per layer (kv_heads, k_dim) of its K/V rows ((0, 0): no rows of its own; a
        recurrent state: ("recur", window floats, state floats))."""
        return [(m.k.heads, m.k.dim) if isinstance(m, KVMemory)
                else ("recur", m.conv.numel(), m.state.numel()) if isinstance(m, RecurrentState) else (0, 0)
                for m in self.memories]


class Q8Cache(KVCache):
    """The all-positions cache over q8_0 rows (same constructor geometry as KVCache)."""

    def __init__(self, n_layers: int, kv_heads: int | list[int], head_dim: int | list[int], capacity: int):
        super().__init__(n_layers, kv_heads, head_dim, capacity, storage="q8_0")
