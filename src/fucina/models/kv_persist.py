"""Crash-safe, append-only persistence of a KV cache: a conversation reopens warm
across process restarts with no re-prefill.

The sidecar is a fixed header, then one fixed-size record per position:

    header  b"FUXKV002" | count u64 | n_layers u32 |
            n_layers x (kind 8s, storage 8s, 4 x u32 geometry)   (cache.layout())
            [recurrent layers: their state once, then the count it describes, u64]
    record  token u32 | for each layer, each storage tensor: that position's row bytes

An append writes the new records first, syncs, then writes the header's count and
syncs again, so a torn append (a crash, a kill -9) is invisible: bytes past `count`
records are ignored and overwritten by the next append. A file whose layout differs
from the opening cache is foreign and ignored wholesale. Records are rows in the
cache's own storage (f16, or q8_0 quants and scales), so every kind round-trips
bit-exactly. A window layer's rows older than its window read as zeros (they are
never read again, and a restore keeps only the last window). A recurrent state is
not per position: it is stored once with the count it belongs to, written before the
header's count, so a torn append leaves the two disagreeing and the file unusable
(a cold start), never restored wrong.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fucina.errors import KVCacheError

MAGIC = b"FUXKV002"
_COUNT_AT = len(MAGIC)


def _header(cache, count: int) -> bytes:
    out = MAGIC + struct.pack("<QI", count, cache.n_layers)
    for kind, storage, geo in cache.layout():
        out += struct.pack("<8s8s4I", kind.encode(), storage.encode(), *geo)
    return out


def _state_parts(cache) -> list[torch.Tensor]:
    return [t for mem in cache.memories for t in mem.state_parts()]


def _state_bytes(cache) -> int:
    parts = _state_parts(cache)
    return sum(t.numel() * t.element_size() for t in parts) + 8 if parts else 0


def _record_layout(cache, start: int, end: int) -> list[torch.Tensor]:
    """Every storage tensor's rows for positions [start, end), in record order."""
    return [t for mem in cache.memories for t in mem.export(start, end)]


def _record_bytes(cache) -> int:
    return 4 + sum(t[0].numel() * t.element_size() for mem in cache.memories for t in mem.parts())


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
        layout, a history beyond the cache's capacity, or a recurrent state that does
        not describe the count. A torn tail shorter than the stored count restores
        the complete records before it (caches without recurrent layers)."""
        if cache.len != 0:
            raise KVCacheError("kv_persist.load needs an empty cache")
        want = _header(cache, 0)
        state_n = _state_bytes(cache)
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(want))
                if len(head) < len(want) or head[:_COUNT_AT] != MAGIC or head[16:] != want[16:]:
                    return None
                (count,) = struct.unpack_from("<Q", head, _COUNT_AT)
                state = f.read(state_n)
                rec = _record_bytes(cache)
                size = os.fstat(f.fileno()).st_size
                n = min(count, (size - len(want) - state_n) // rec)
                if n > cache.capacity or len(state) < state_n:
                    return None
                if state_n and (n != count or struct.unpack_from("<Q", state, state_n - 8)[0] != count):
                    return None
                raw = np.frombuffer(f.read(n * rec), dtype=np.uint8).reshape(n, rec)
        except FileNotFoundError:
            return None
        self._armed_for = want
        self.tokens = raw[:, :4].copy().view("<u4").reshape(-1).astype(np.int64).tolist()
        col = 4
        for mem in cache.memories if n else ():
            parts = []
            for t in mem.parts():
                nbytes = t[0].numel() * t.element_size()
                parts.append(torch.from_numpy(raw[:, col:col + nbytes].copy()).view(t.dtype).reshape(n, *t.shape[1:]))
                col += nbytes
            mem.restore(n, parts)
        at = 0
        for t in _state_parts(cache):
            nbytes = t.numel() * t.element_size()
            t.copy_(torch.frombuffer(bytearray(state[at:at + nbytes]), dtype=t.dtype).reshape(t.shape))
            at += nbytes
        cache.len = n
        for mem in cache.memories:
            mem.commit(n)
        return list(self.tokens)

    # -- writing ---------------------------------------------------------------
    def reset(self, cache) -> None:
        """Arm a fresh, empty sidecar for this cache's layout."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_header(cache, 0) + bytes(_state_bytes(cache)))
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
        head, state_n = len(_header(cache, 0)), _state_bytes(cache)
        with open(self.path, "r+b") as f:
            if keep < len(self.tokens):  # rewind: the old tail becomes a torn tail
                self._write_count(f, keep)
                self.tokens = self.tokens[:keep]
            if new:
                rec = _record_bytes(cache)
                buf = np.empty((len(new), rec), dtype=np.uint8)
                buf[:, :4] = np.asarray(new, dtype="<u4").view(np.uint8).reshape(-1, 4)
                col = 4
                for t in _record_layout(cache, keep, len(tokens)):
                    rows = t.contiguous().view(torch.uint8).reshape(len(new), -1)
                    buf[:, col:col + rows.shape[1]] = rows.numpy()
                    col += rows.shape[1]
                f.seek(head + state_n + keep * rec)
                f.write(buf.tobytes())      # records first ...
                f.flush()
                os.fsync(f.fileno())
            if state_n:                     # ... the state that goes with them ...
                f.seek(head)
                f.write(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in _state_parts(cache))
                        + struct.pack("<Q", len(tokens)))
                f.flush()
                os.fsync(f.fileno())
            if new or state_n:
                self._write_count(f, len(tokens))   # ... the count last
        self.tokens = tokens
        return len(new)

    @staticmethod
    def _write_count(f, count: int) -> None:
        f.seek(_COUNT_AT)
        f.write(struct.pack("<Q", count))
        f.flush()
        os.fsync(f.fileno())
