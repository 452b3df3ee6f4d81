"""The KV cache: per layer one [capacity, kv_heads, head_dim] tensor for K (post-RoPE)
and one for V. The active prefix [0, len) is a zero-copy narrow; `truncate` rewinds.

Every position is kept: windowed layers apply their window at read time, so a
rewind is always just `len = n`.
"""
from __future__ import annotations

import torch

from fucina.errors import ContextFull, KVCacheError


class KVCache:
    def __init__(self, n_layers: int, kv_heads: int | list[int], head_dim: int | list[int],
                 capacity: int, dtype: torch.dtype = torch.float16):
        heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * n_layers
        dims = head_dim if isinstance(head_dim, list) else [head_dim] * n_layers
        if capacity <= 0:
            raise KVCacheError(f"cache capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.dtype = dtype
        # tuples: the tensors are fixed for the cache's life (the native step keeps their
        # addresses), only their rows change
        self.k = tuple(torch.zeros(capacity, h, d, dtype=dtype) for h, d in zip(heads, dims))
        self.v = tuple(torch.zeros(capacity, h, d, dtype=dtype) for h, d in zip(heads, dims))
        self.len = 0

    @property
    def n_layers(self) -> int:
        return len(self.k)

    def check_room(self, m: int) -> None:
        if self.len + m > self.capacity:
            raise ContextFull(f"{self.len} cached + {m} new tokens exceed the context of "
                              f"{self.capacity}")

    def check_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor,
                   v_store: torch.Tensor) -> int:
        """Room for [m, kv_heads, head_dim] rows k/v in the layer's stores; returns m."""
        m = k.shape[0]
        self.check_room(m)
        if k.shape[1:] != k_store.shape[1:] or v.shape[1:] != v_store.shape[1:]:
            raise KVCacheError(f"layer {layer}: rows {tuple(k.shape)} do not fit cache "
                               f"{tuple(k_store.shape)}")
        return m

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write [m, kv_heads, head_dim] rows at offset len (does not advance)."""
        m = self.check_rows(layer, k, v, self.k[layer], self.v[layer])
        self.k[layer][self.len:self.len + m] = k
        self.v[layer][self.len:self.len + m] = v

    def keys(self, layer: int, n: int) -> torch.Tensor:
        return self.k[layer][:n]

    def values(self, layer: int, n: int) -> torch.Tensor:
        return self.v[layer][:n]

    def advance(self, m: int) -> None:
        self.check_room(m)
        self.len += m

    def truncate(self, keep: int) -> None:
        if keep < self.len:
            self.len = max(0, keep)

    def reset(self) -> None:
        self.len = 0

    def copy_rows(self, src: "KVCache", start: int, end: int) -> None:
        """Adopt rows [start, end) of a same-geometry cache at the same positions."""
        if self.len != start or end > src.len or start > end:
            raise KVCacheError(f"copy_rows [{start}, {end}) needs len == {start} (is {self.len}) "
                               f"and end <= source len {src.len}")
        if end > self.capacity or len(src.k) != len(self.k) or any(
                a.shape[1:] != b.shape[1:] or a.dtype != b.dtype for a, b in zip(src.k, self.k)):
            raise KVCacheError("copy_rows: cache geometry differs")
        for i in range(len(self.k)):
            self.k[i][start:end] = src.k[i][start:end]
            self.v[i][start:end] = src.v[i][start:end]
        self.len = end

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
