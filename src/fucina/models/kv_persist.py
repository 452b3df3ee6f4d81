"""Crash-safe, append-only persistence of a KV cache: a conversation reopens warm
across process restarts with no re-prefill.

The sidecar is a fixed header, then one fixed-size record per position:

    header  b"FUXKV001" | count u64 | storage name 8s | n_layers u32 |
            n_layers x (kv_heads u32, head_dim u32)
    record  token u32 | for each layer, each storage tensor: that position's row bytes

An append writes the new records first, syncs, then writes the header's count and
syncs again, so a torn append (a crash, a kill -9) is invisible: bytes past `count`
records are ignored and overwritten by the next append. A file whose geometry or
storage type differs from the opening cache is foreign and ignored wholesale.
Records are rows in the cache's own storage (f16, or q8_0 quants and scales), so both
cache types round-trip bit-exactly.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fucina.errors import KVCacheError

MAGIC = b"FUXKV001"
_COUNT_AT = len(MAGIC)
_TORCH_NAMES = {torch.float16: "f16", torch.float32: "f32", torch.bfloat16: "bf16"}


def _row_tensors(cache, layer: int) -> list[torch.Tensor]:
    if hasattr(cache, "row_tensors"):
        return cache.row_tensors(layer)
    return [cache.k[layer], cache.v[layer]]


def _storage(cache) -> str:
    return cache.dtype if isinstance(cache.dtype, str) else _TORCH_NAMES[cache.dtype]


def _header(cache, count: int) -> bytes:
    geo = [(t.shape[1], t.shape[2]) for t in (_row_tensors(cache, i)[0] for i in range(cache.n_layers))]
    out = MAGIC + struct.pack("<Q8sI", count, _storage(cache).encode(), len(geo))
    return out + b"".join(struct.pack("<II", h, d) for h, d in geo)


def _record_layout(cache) -> list[tuple[int, torch.Tensor]]:
    """(bytes per position, tensor) for every storage tensor, in record order."""
    out = []
    for i in range(cache.n_layers):
        for t in _row_tensors(cache, i):
            out.append((t[0].numel() * t.element_size(), t))
    return out


class KVPersist:
    """One cache's sidecar. `sync(cache, tokens)` makes the file describe the cache's
    positions [0, len(tokens)); `load(cache)` restores it into an empty cache."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tokens: list[int] = []     # what the file's committed records hold
        self._armed_for: bytes | None = None

    # -- reading ---------------------------------------------------------------
    def load(self, cache) -> list[int] | None:
        """Resume into an empty cache. Returns the restored token ids (cache.len is
        set to their count), or None when nothing usable exists: no file, a foreign
        geometry or storage type, or a history beyond the cache's capacity. A torn
        tail shorter than the stored count restores the complete records before it."""
        if cache.len != 0:
            raise KVCacheError("kv_persist.load needs an empty cache")
        want = _header(cache, 0)
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(want))
                if len(head) < len(want) or head[:_COUNT_AT] != MAGIC or head[16:] != want[16:]:
                    return None
                (count,) = struct.unpack_from("<Q", head, _COUNT_AT)
                layout = _record_layout(cache)
                rec = 4 + sum(n for n, _ in layout)
                size = os.fstat(f.fileno()).st_size
                n = min(count, (size - len(want)) // rec)
                if n > cache.capacity:
                    return None
                raw = np.frombuffer(f.read(n * rec), dtype=np.uint8).reshape(n, rec)
        except FileNotFoundError:
            return None
        self._armed_for = want
        if n == 0:
            self.tokens = []
            return []
        tokens = raw[:, :4].copy().view("<u4").reshape(-1).astype(np.int64).tolist()
        col = 4
        for nbytes, t in layout:
            rows = torch.from_numpy(raw[:, col:col + nbytes].copy()).view(t.dtype)
            t[:n] = rows.reshape(n, *t.shape[1:])
            col += nbytes
        cache.len = n
        self.tokens = tokens
        return tokens

    # -- writing ---------------------------------------------------------------
    def reset(self, cache) -> None:
        """Arm a fresh, empty sidecar for this cache's geometry."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_header(cache, 0))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.tokens = []
        self._armed_for = _header(cache, 0)

    def sync(self, cache, tokens: Sequence[int]) -> int:
        """Persist positions [0, len(tokens)) of `cache` (tokens[i] is position i's id;
        len(tokens) must equal cache.len). Keeps the longest common prefix with what the
        file holds and appends the rest. Returns the number of records written."""
        tokens = [int(t) for t in tokens]
        if len(tokens) != cache.len:
            raise KVCacheError(f"kv_persist: {len(tokens)} tokens for a cache of {cache.len} positions")
        if self._armed_for != _header(cache, 0) or not self.path.exists():
            self.reset(cache)
        keep = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            keep += 1
        new = tokens[keep:]
        head = _header(cache, 0)
        with open(self.path, "r+b") as f:
            if keep < len(self.tokens):  # rewind: the old tail becomes a torn tail
                self._write_count(f, keep)
                self.tokens = self.tokens[:keep]
            if not new:
                return 0
            layout = _record_layout(cache)
            rec = 4 + sum(n for n, _ in layout)
            buf = np.empty((len(new), rec), dtype=np.uint8)
            buf[:, :4] = np.asarray(new, dtype="<u4").view(np.uint8).reshape(-1, 4)
            col = 4
            for nbytes, t in layout:
                rows = t[keep:keep + len(new)].contiguous().view(torch.uint8).reshape(len(new), nbytes)
                buf[:, col:col + nbytes] = rows.numpy()
                col += nbytes
            f.seek(len(head) + keep * rec)
            f.write(buf.tobytes())      # records first ...
            f.flush()
            os.fsync(f.fileno())
            self._write_count(f, len(tokens))   # ... the count last
        self.tokens = tokens
        return len(new)

    @staticmethod
    def _write_count(f, count: int) -> None:
        f.seek(_COUNT_AT)
        f.write(struct.pack("<Q", count))
        f.flush()
        os.fsync(f.fileno())
