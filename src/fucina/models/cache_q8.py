"""A q8_0 KV cache: the KVCache interface over GGML q8_0 rows.

Each (position, kv_head) row of head_dim values is head_dim/32 blocks of one f16 scale
and 32 int8 quants (34 bytes per 32 values, 0.53x the f16 cache), quantized exactly as
ggml's quantize_row_q8_0_ref (d = amax/127, q = roundf(x/d)). A block never straddles
a position (head_dim % 32 == 0 is checked), so `truncate` stays `len = n`.

`keys`/`values` return the active prefix dequantized to float32 for attention: a
capacity lever (twice the context in the same memory), not a speed lever.
"""
from __future__ import annotations

import torch

from fucina.errors import KVCacheError
from fucina.models.cache import KVCache

QK8_0 = 32
CACHE_TYPES = ("f16", "q8_0")


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] float -> (int8 [..., d], f16 scales [..., d/32])."""
    *lead, d = x.shape
    b = x.float().reshape(*lead, d // QK8_0, QK8_0)
    amax = b.abs().amax(-1, keepdim=True)
    scale = amax / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = b * inv
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).to(torch.int8)  # roundf: half away from 0
    return q.reshape(*lead, d), scale.squeeze(-1).to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    *lead, d = q.shape
    b = q.reshape(*lead, d // QK8_0, QK8_0).float() * s.float().unsqueeze(-1)
    return b.reshape(*lead, d)


class Q8Cache:
    """Drop-in for KVCache (same constructor geometry, same methods) storing q8_0 rows."""

    dtype = "q8_0"

    def __init__(self, n_layers: int, kv_heads: int | list[int], head_dim: int | list[int],
                 capacity: int):
        heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * n_layers
        dims = head_dim if isinstance(head_dim, list) else [head_dim] * n_layers
        if capacity <= 0:
            raise KVCacheError(f"cache capacity must be positive, got {capacity}")
        bad = sorted({d for d in dims if d % QK8_0})
        if bad:
            raise KVCacheError(f"q8_0 KV cache needs head_dim % {QK8_0} == 0 (got head_dim {bad[0]})")
        self.capacity = capacity
        self.kq = [torch.zeros(capacity, h, d, dtype=torch.int8) for h, d in zip(heads, dims)]
        self.vq = [torch.zeros(capacity, h, d, dtype=torch.int8) for h, d in zip(heads, dims)]
        self.ks = [torch.zeros(capacity, h, d // QK8_0, dtype=torch.float16) for h, d in zip(heads, dims)]
        self.vs = [torch.zeros(capacity, h, d // QK8_0, dtype=torch.float16) for h, d in zip(heads, dims)]
        self.len = 0

    @property
    def n_layers(self) -> int:
        return len(self.kq)

    def geometry(self) -> list[tuple[int, int]]:
        return [(t.shape[1], t.shape[2]) for t in self.kq]

    check_room = KVCache.check_room
    check_rows = KVCache.check_rows
    advance = KVCache.advance
    truncate = KVCache.truncate
    reset = KVCache.reset

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize [m, kv_heads, head_dim] rows into offset len (does not advance)."""
        end = self.len + self.check_rows(layer, k, v, self.kq[layer], self.vq[layer])
        self.kq[layer][self.len:end], self.ks[layer][self.len:end] = quantize_q8_0(k)
        self.vq[layer][self.len:end], self.vs[layer][self.len:end] = quantize_q8_0(v)

    def keys(self, layer: int, n: int) -> torch.Tensor:
        return dequantize_q8_0(self.kq[layer][:n], self.ks[layer][:n])

    def values(self, layer: int, n: int) -> torch.Tensor:
        return dequantize_q8_0(self.vq[layer][:n], self.vs[layer][:n])

    def row_tensors(self, layer: int) -> list[torch.Tensor]:
        """The per-position storage tensors of one layer (persistence, copying)."""
        return [self.kq[layer], self.ks[layer], self.vq[layer], self.vs[layer]]

    def copy_rows(self, src: "Q8Cache", start: int, end: int) -> None:
        """Adopt rows [start, end) of a same-geometry q8_0 cache at the same positions."""
        if self.len != start or end > src.len or start > end:
            raise KVCacheError(f"copy_rows [{start}, {end}) needs len == {start} (is {self.len}) "
                               f"and end <= source len {src.len}")
        if not isinstance(src, Q8Cache) or end > self.capacity or src.geometry() != self.geometry():
            raise KVCacheError("copy_rows: cache geometry or type differs")
        for i in range(self.n_layers):
            for dst, s in zip(self.row_tensors(i), src.row_tensors(i)):
                dst[start:end] = s[start:end]
        self.len = end

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kq + self.vq + self.ks + self.vs)


def make_cache(model, capacity: int | None = None, cache_type: str = "f16"):
    """A cache for `model` of the given storage type ("f16" or "q8_0"); the model's
    `init_cache` owns the geometry and the choice."""
    if cache_type in ("f16", None):
        return model.init_cache(capacity)
    if cache_type not in CACHE_TYPES:
        raise KVCacheError(f"unknown cache type {cache_type!r} (expected one of {', '.join(CACHE_TYPES)})")
    return model.init_cache(capacity, cache_type=cache_type)
