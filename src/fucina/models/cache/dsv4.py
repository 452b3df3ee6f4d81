"""DeepSeek-V4's per-layer memory: the raw K=V rows, the compressor state and the
compressed keys, all kept per position so any rewind is a shorter length.

llama.cpp b11434 (src/llama-kv-cache-dsv4.cpp) keeps the raw rows in a sliding-window
cache, a ring of the compressor's per-position projections (kv and score, f32, 2 x ratio
rows for the overlapping CSA compressor, ratio rows for HCA) and one compressed key per
completed block. Here every part has one row per position:

  raw     [cap, head_dim]            f16   each position's K=V row (RoPE'd)
  st_kv   [cap, coff * head_dim]     f32   the compressor's kv projection (coff 2 for CSA)
  st_sc   [cap, coff * head_dim]     f32   its score projection plus the position's ape row
  comp    [cap, head_dim]            f16   block b's compressed key at row (b + 1) * ratio - 1
  lid_kv / lid_sc [cap, 2 * idx_dim] f32   the indexer compressor's state (CSA only)
  lid     [cap, idx_dim]             f16   the indexer's compressed key of block b, same row

`row_dtype` float32 keeps raw / comp / lid in f32 (the trainer's per-sequence stand-in, where
the rows carry gradients). A block is written when the step that holds its last position
runs, from rows of this memory, so a rewind to any length leaves exactly the blocks complete
at that length valid and a rerun rewrites the rest. Rows are independent per position: prefix reuse, turns,
speculation and persistence use the generic row machinery. The cost is the per-position
state (f32) and the sparse compressed rows: more memory than llama.cpp's rings.
"""
from __future__ import annotations

import torch

from fucina.errors import KVCacheError
from fucina.models.cache.memory import RowMemory


class DSV4Memory(RowMemory):
    kind = "dsv4"

    def __init__(self, capacity: int, ratio: int, head_dim: int, idx_dim: int = 0,
                 row_dtype: torch.dtype = torch.float16):
        if capacity <= 0:
            raise KVCacheError(f"cache capacity must be positive, got {capacity}")
        self.ratio, self.head_dim, self.idx_dim = ratio, head_dim, idx_dim
        self.storage, self.table_row = "f16", None
        coff = 2 if ratio == 4 else 1
        names = [("raw", head_dim, row_dtype)]
        if ratio:
            names += [("st_kv", coff * head_dim, torch.float32), ("st_sc", coff * head_dim, torch.float32),
                      ("comp", head_dim, row_dtype)]
        if ratio == 4:
            names += [("lid_kv", 2 * idx_dim, torch.float32), ("lid_sc", 2 * idx_dim, torch.float32),
                      ("lid", idx_dim, row_dtype)]
        self.names = [n for n, _, _ in names]
        for n, d, dt in names:
            setattr(self, n, torch.zeros(capacity, d, dtype=dt))

    def descriptor(self) -> tuple[int, ...]:
        return (self.ratio, self.head_dim, self.idx_dim, 0)

    def put(self, name: str, pos: int, rows: torch.Tensor) -> None:
        t = getattr(self, name)
        if pos < 0 or pos + rows.shape[0] > t.shape[0]:
            raise KVCacheError(f"dsv4 memory holds {t.shape[0]} positions; rows {pos}..{pos + rows.shape[0] - 1} "
                               "are outside")
        if rows.shape[0] == 1:   # a decode step: one copy, converting in place (~a third of the slice form)
            t[pos].copy_(rows.reshape(-1))
        else:
            t[pos:pos + rows.shape[0]] = rows.reshape(rows.shape[0], -1).to(t.dtype)

    def row(self, name: str, pos: int) -> torch.Tensor:
        """Position pos's row of part `name`, a view to write in place."""
        t = getattr(self, name)
        if not 0 <= pos < t.shape[0]:
            raise KVCacheError(f"dsv4 memory holds {t.shape[0]} positions; row {pos} is outside")
        return t[pos]

    def write(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise KVCacheError("a dsv4 memory is written part by part (put), not as K/V rows")

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.raw[start:end]
        return r, r

    def copy_from(self, src: "DSV4Memory", start: int, end: int) -> None:
        if not isinstance(src, DSV4Memory) or src.descriptor() != self.descriptor():
            raise KVCacheError("copy_rows: cache geometry or type differs")
        for t, s in zip(self.parts(), src.parts()):
            t[start:end] = s[start:end]

    def parts(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in self.names)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    def bytes_per_position(self) -> int:
        return sum(t.shape[1] * t.element_size() for t in self.parts())

    def export(self, start: int, end: int) -> list[torch.Tensor]:
        return [t[start:end].clone() for t in self.parts()]

    def state_parts(self) -> list[torch.Tensor]:
        return []

    def restore(self, n: int, parts: list[torch.Tensor]) -> None:
        for t, rows in zip(self.parts(), parts):
            t[:n] = rows[:n]

    def native_entry(self) -> None:
        return None
