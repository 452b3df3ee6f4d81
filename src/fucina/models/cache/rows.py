"""Row stores: where one layer's K (or V) rows live, one row per held position.

A store is a fixed set of tensors [rows, heads, dim, ...] (their addresses never change:
the native step keeps them). `F16Rows` holds the rows as they are (f16 by default);
`Q8Rows` holds GGML q8_0 blocks: per (position, head) dim/32 blocks of one f16 scale and
32 int8 quants (34 bytes per 32 values, 0.53x f16), quantized exactly as ggml's
quantize_row_q8_0_ref (d = amax/127, q = roundf(x/d)); a block never straddles a
position, so a rewind is still just a length.
"""
from __future__ import annotations

import torch

from fucina.errors import KVCacheError

QK8_0 = 32


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] float -> (int8 [..., d], f16 scales [..., d/32])."""
    *lead, d = x.shape
    b = x.float().reshape(*lead, d // QK8_0, QK8_0)
    scale = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = b * inv
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).to(torch.int8)  # roundf: half away from 0
    return q.reshape(*lead, d), scale.squeeze(-1).to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    *lead, d = q.shape
    b = q.reshape(*lead, d // QK8_0, QK8_0).float() * s.float().unsqueeze(-1)
    return b.reshape(*lead, d)


class F16Rows:
    """Rows stored as given (the store's dtype: f16 unless asked otherwise)."""

    name = "f16"

    def __init__(self, rows: int, heads: int, dim: int, dtype: torch.dtype = torch.float16):
        self.heads, self.dim, self.dtype = heads, dim, dtype
        self.parts = (torch.zeros(rows, heads, dim, dtype=dtype),)

    @property
    def rows(self) -> int:
        return self.parts[0].shape[0]

    def put(self, slot: int, x: torch.Tensor) -> None:
        self.parts[0][slot:slot + x.shape[0]] = x

    def get(self, s0: int, s1: int) -> torch.Tensor:
        return self.parts[0][s0:s1]

    def move(self, src: int, dst: int, n: int) -> None:
        """Rows [src, src+n) to [dst, dst+n) (the ranges may overlap)."""
        for t in self.parts:
            t[dst:dst + n] = t[src:src + n].clone()

    def take(self, other: "F16Rows", src: int, dst: int, n: int) -> None:
        """Rows [src, src+n) of a same-format store to [dst, dst+n) of this one."""
        for a, b in zip(self.parts, other.parts):
            a[dst:dst + n] = b[src:src + n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    def row_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.parts)


class Q8Rows(F16Rows):
    """Rows as q8_0 blocks: `parts` = (int8 quants [rows, heads, dim], f16 scales
    [rows, heads, dim/32]); reads dequantize to f32 (a capacity lever, not a speed one)."""

    name = "q8_0"

    def __init__(self, rows: int, heads: int, dim: int, dtype=None):
        if dim % QK8_0:
            raise KVCacheError(f"q8_0 KV cache needs head_dim % {QK8_0} == 0 (got head_dim {dim})")
        self.heads, self.dim, self.dtype = heads, dim, "q8_0"
        self.parts = (torch.zeros(rows, heads, dim, dtype=torch.int8),
                      torch.zeros(rows, heads, dim // QK8_0, dtype=torch.float16))

    def put(self, slot: int, x: torch.Tensor) -> None:
        m = x.shape[0]
        self.parts[0][slot:slot + m], self.parts[1][slot:slot + m] = quantize_q8_0(x)

    def get(self, s0: int, s1: int) -> torch.Tensor:
        return dequantize_q8_0(self.parts[0][s0:s1], self.parts[1][s0:s1])


STORES = {"f16": F16Rows, "q8_0": Q8Rows}
