"""Per-layer memories: what one layer keeps between steps, and what it can undo.

Every kind answers the same questions (the `LayerMemory` protocol): write rows at a
position, read the rows of a span, make room before a step, how far back it can rewind
(`can_truncate`), copy another cache's rows, what it costs per position, its rows for
persistence, and its entry in the native step's pointer table (None: no native route).

Kinds:
  KVMemory       every position's K and V (K and V widths may differ)
  WindowKV       only the last `window` positions (plus `slack` rows so one step of up
                 to slack + 1 rows fits): local sliding-window layers
  LatentKV       MLA's per-position latent and rope key, shared by every head (the K and
                 V of all heads are derived from them at read time)
  AliasKV        another layer's K/V (layers that share KV): nothing of its own
  RecurrentState a fixed-size state (conv window + state matrices) with per-position
                 snapshots over a bounded horizon, so it rewinds within that horizon
"""
from __future__ import annotations

from typing import Protocol

import torch

from fucina.errors import KVCacheError
from fucina.models.cache.rows import STORES

NO_LIMIT = 1 << 30
KEY_BLOCK = 16   # the attention kernels read keys in blocks of 16 aligned to absolute positions (csrc FK_AB)


class LayerMemory(Protocol):
    kind: str

    def descriptor(self) -> tuple[int, ...]:
        """The geometry that must match for rows to be exchanged (persistence, copies)."""

    def write(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def reserve(self, pos: int, m: int) -> None:
        """Make room for m rows at positions pos.. (before a step writes them)."""

    def step_limit(self) -> int: ...

    def can_truncate(self, keep: int, length: int) -> bool: ...

    def rewind_points(self) -> tuple[int, ...]:
        """The only lengths it can rewind to below its current one, when it has such a
        list (a recurrent state's snapshots); () when any length that can_truncate says works."""

    def rewind_reach(self) -> int:
        """How many positions may be appended with the current length still a rewind point."""

    def truncate(self, keep: int) -> None: ...

    def commit(self, length: int) -> None:
        """The cache now holds `length` positions (recurrent kinds snapshot here)."""

    def copy_from(self, src: "LayerMemory", start: int, end: int) -> None: ...

    def nbytes(self) -> int: ...

    def bytes_per_position(self) -> int: ...

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The storage tensors with one row per position (their rows go in records)."""

    def export(self, start: int, end: int) -> list[torch.Tensor]:
        """Per-position storage for persistence: rows of positions [start, end)."""

    def state_parts(self) -> list[torch.Tensor]:
        """Storage kept once, not per position (a recurrent state); [] for the others."""

    def restore(self, n: int, parts: list[torch.Tensor]) -> None: ...

    def native_entry(self) -> tuple[int, int, int, int] | None: ...


class RowMemory:
    """What a memory whose rows are independent does by default: no reservation or step
    limit, truncation to any length, no snapshots (KVMemory, AliasKV; WindowKV overrides)."""

    def reserve(self, pos: int, m: int) -> None:
        pass

    def step_limit(self) -> int:
        return NO_LIMIT

    def can_truncate(self, keep: int, length: int) -> bool:
        return True

    def rewind_points(self) -> tuple[int, ...]:
        return ()

    def rewind_reach(self) -> int:
        return NO_LIMIT

    def truncate(self, keep: int) -> None:
        pass

    def commit(self, length: int) -> None:
        pass


class KVMemory(RowMemory):
    """K and V rows for positions [base, base + rows): base stays 0 here (every position
    is kept, so any rewind is just a shorter length)."""

    kind = "kv"

    def __init__(self, capacity: int, heads: int, k_dim: int, v_dim: int | None = None,
                 storage: str = "f16", dtype: torch.dtype = torch.float16):
        if storage not in STORES:
            raise KVCacheError(f"unknown cache type {storage!r} (f16 or q8_0)")
        rows = self._rows(capacity)
        self.k = STORES[storage](rows, heads, k_dim, dtype)
        self.v = STORES[storage](rows, heads, v_dim or k_dim, dtype)
        self.storage, self.base = storage, 0
        self.table_row: torch.Tensor | None = None   # this layer's native entry, kept current

    def _rows(self, capacity: int) -> int:
        return capacity

    @property
    def rows(self) -> int:
        return self.k.rows

    def descriptor(self) -> tuple[int, ...]:
        return (self.k.heads, self.k.dim, self.v.dim, 0)

    def _slot(self, pos: int, m: int) -> int:
        s = pos - self.base
        if s < 0 or s + m > self.rows:
            raise KVCacheError(f"{self.kind} memory holds positions [{self.base}, "
                               f"{self.base + self.rows}); rows {pos}..{pos + m - 1} are outside")
        return s

    def write(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape[1:] != (self.k.heads, self.k.dim) or v.shape[1:] != (self.v.heads, self.v.dim):
            raise KVCacheError(f"rows {tuple(k.shape)}/{tuple(v.shape)} do not fit the cache's "
                               f"[{self.k.heads}, {self.k.dim}]/[{self.v.heads}, {self.v.dim}]")
        self.reserve(pos, k.shape[0])
        s = self._slot(pos, k.shape[0])
        self.k.put(s, k)
        self.v.put(s, v)

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._slot(start, end - start)
        return self.k.get(s, s + end - start), self.v.get(s, s + end - start)

    def _same(self, src) -> None:
        if type(src) is not type(self) or src.descriptor() != self.descriptor() or src.storage != self.storage:
            raise KVCacheError("copy_rows: cache geometry or type differs")

    def copy_from(self, src: "KVMemory", start: int, end: int) -> None:
        self._same(src)
        self._take(src, start, end)

    def _take(self, src: "KVMemory", start: int, end: int) -> None:
        s, d = src._slot(start, end - start), self._slot(start, end - start)
        self.k.take(src.k, s, d, end - start)
        self.v.take(src.v, s, d, end - start)

    def nbytes(self) -> int:
        return self.k.nbytes() + self.v.nbytes()

    def bytes_per_position(self) -> int:
        return self.k.row_bytes() + self.v.row_bytes()

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The storage tensors whose per-position rows persistence records."""
        return self.k.parts + self.v.parts

    def export(self, start: int, end: int) -> list[torch.Tensor]:
        """Positions [start, end) of every storage tensor; positions no longer held
        (a window's past) read as zeros."""
        lo = max(start, self.base)
        out = []
        for t in self.parts():
            rows = torch.zeros((end - start,) + tuple(t.shape[1:]), dtype=t.dtype)
            if end > lo:
                rows[lo - start:] = t[lo - self.base:end - self.base]
            out.append(rows)
        return out

    def state_parts(self) -> list[torch.Tensor]:
        return []

    def restore(self, n: int, parts: list[torch.Tensor]) -> None:
        """Into an empty memory: positions [0, n) (this kind keeps those it needs)."""
        lo = self._restore_from(n)
        self.base = lo
        for t, rows in zip(self.parts(), parts):
            t[:n - lo] = rows[lo:n]
        self._publish()

    def _restore_from(self, n: int) -> int:
        return 0

    def native_entry(self) -> tuple[int, int, int, int] | None:
        if self.storage != "f16" or self.k.dtype is not torch.float16 or self.k.dim != self.v.dim:
            return None
        return (self.k.parts[0].data_ptr(), self.v.parts[0].data_ptr(), self.base, self.rows)

    def _publish(self) -> None:
        if self.table_row is not None:
            self.table_row[2] = self.base


class WindowKV(KVMemory):
    """A sliding-window layer: keys older than `window` positions are never read again,
    so only `window + slack` rows exist. Rows stay in position order (reads are one
    contiguous span, as the native kernels want): when a step would run past the end,
    the rows from the oldest one still read (rounded down to a 16-row key block) move to
    the front (every ~`slack` tokens, ~window rows copied: about one row per token). A
    step may append up to slack + 2 - 16 rows; a rewind reaches back as far as the rows
    still held allow."""

    kind = "window"

    def __init__(self, capacity: int, heads: int, k_dim: int, v_dim: int | None = None,
                 storage: str = "f16", dtype: torch.dtype = torch.float16, *, window: int,
                 slack: int = 512 + KEY_BLOCK):
        if window < 1 or slack < KEY_BLOCK - 1:
            raise KVCacheError(f"window memory needs window >= 1 and slack >= {KEY_BLOCK - 1} "
                               f"(got {window}, {slack}): its rows start on a {KEY_BLOCK}-row key block")
        self.window, self.slack = window, slack
        super().__init__(capacity, heads, k_dim, v_dim, storage, dtype)

    def _rows(self, capacity: int) -> int:
        self.capacity = capacity
        return min(capacity, self.window + self.slack)

    def descriptor(self) -> tuple[int, ...]:
        return (self.k.heads, self.k.dim, self.v.dim, self.window)

    def _need_from(self, pos: int) -> int:
        """The oldest position a query at `pos` reads, rounded down to the attention
        kernels' key block: they read whole blocks aligned to absolute positions (batch
        invariance), so the rows held start on a block boundary."""
        return max(0, pos - self.window + 1) // KEY_BLOCK * KEY_BLOCK

    def reserve(self, pos: int, m: int) -> None:
        if pos + m - self.base <= self.rows:
            return
        lo = self._need_from(pos)
        if lo < self.base or pos + m - lo > self.rows:
            raise KVCacheError(f"window memory: {m} rows at {pos} do not fit "
                               f"(held from {self.base}, {self.rows} rows)")
        held = pos - lo
        for store in (self.k, self.v):
            store.move(lo - self.base, 0, held)
        self.base = lo
        self._publish()

    def step_limit(self) -> int:
        if self.rows >= self.capacity:     # every position fits: it never moves
            return NO_LIMIT
        return max(1, self.rows - self.window + 2 - KEY_BLOCK)

    def can_truncate(self, keep: int, length: int) -> bool:
        return keep >= length or keep == 0 or self.base <= self._need_from(keep)

    def truncate(self, keep: int) -> None:
        if keep == 0 and self.base:
            self.base = 0
            self._publish()

    def copy_from(self, src: "WindowKV", start: int, end: int) -> None:
        self._same(src)
        lo = max(start, self._need_from(end))
        if src.base > lo:
            raise KVCacheError(f"copy_rows: the source window no longer holds position {lo}")
        if lo > start or end - self.base > self.rows:   # our own rows are not needed: restart at lo
            self.base = lo
            self._publish()
        self._take(src, lo, end)

    def _restore_from(self, n: int) -> int:
        return self._need_from(n)


class LatentKV(KVMemory):
    """Multi-head latent attention (DeepSeek-V2): per position one normed KV latent
    [kv_lora_rank] and one RoPE'd key [n_rot], shared by every head; heads read keys and
    values through absorbed projections, so nothing per head is stored (llama.cpp's MLA
    cache keeps the same two rows). `write(pos, latent, rope_key)` with rows
    [m, 1, rank] / [m, 1, n_rot]; `span` returns them. Every position is kept, so any
    rewind works. Its native entry (f16 rows): the latent rows as k, the rope key rows as v
    (csrc/fk_plan.h FK_MLA_FIELDS)."""

    kind = "latent"

    def __init__(self, capacity: int, rank: int, n_rot: int, storage: str = "f16",
                 dtype: torch.dtype = torch.float16):
        super().__init__(capacity, 1, rank, n_rot, storage, dtype)

    def native_entry(self) -> tuple[int, int, int, int] | None:
        if self.storage != "f16" or self.k.dtype is not torch.float16:
            return None
        return (self.k.parts[0].data_ptr(), self.v.parts[0].data_ptr(), self.base, self.rows)


class AliasKV(RowMemory):
    """A layer that reads another layer's K/V (cross-layer KV sharing): it writes and
    stores nothing; reads go to the target (which also answers for truncation)."""

    kind = "alias"

    def __init__(self, target: KVMemory, target_layer: int):
        self.target, self.target_layer = target, target_layer
        self.storage = target.storage
        self.table_row = None

    def descriptor(self) -> tuple[int, ...]:
        return (self.target_layer, 0, 0, 0)

    def write(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise KVCacheError(f"layer aliases layer {self.target_layer}'s KV: it has none of its own to write")

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.target.span(start, end)

    def copy_from(self, src: "AliasKV", start: int, end: int) -> None:
        if not isinstance(src, AliasKV) or src.target_layer != self.target_layer:
            raise KVCacheError("copy_rows: cache geometry or type differs")

    def nbytes(self) -> int:
        return 0

    bytes_per_position = nbytes

    def parts(self) -> tuple[torch.Tensor, ...]:
        return ()

    def export(self, start: int, end: int) -> list[torch.Tensor]:
        return []

    def state_parts(self) -> list[torch.Tensor]:
        return []

    def restore(self, n: int, parts: list[torch.Tensor]) -> None:
        pass

    def native_entry(self):
        """No rows: a plan layer with kv_from reads its target's entry instead."""
        return (0, 0, 0, 0) if self.target.native_entry() is not None else None


class RecurrentState:
    """A recurrent mixer's state (e.g. Gated DeltaNet): a conv window [conv_len, channels]
    and state matrices [heads, d_k, d_v], f32, overwritten in place each step. It cannot
    be cut back by a length; instead a snapshot is kept for each committed length over the
    last `horizon` positions, so a rewind within the horizon (a rejected speculation, the
    start of the last turn) restores the snapshot.

    Snapshots live in a pool of at most `horizon` preallocated slots ([window | state] f32
    each): `reserve(pos, m)` frees those the step will push out of the horizon and hands
    the step one slot per kept length (the last min(m, horizon) of pos + 1 .. pos + m).
    The native step (csrc/fk_delta.cpp) writes them while its state is hot, through this
    layer's entry in the cache's pointer table (window, state, slot table, keep); the torch
    mixer passes them to `write(pos, conv, state, inner)` as (length, conv, state) each.
    Decode so costs no allocation and no extra pass over the state.

    A one-row step (decode) leaves a snapshot only at every `decode_stride`-th length: a
    rewind between two lands on the one below and re-runs the few tokens after it (the
    cache says which through truncate_point), while the rows of a multi-row step (prefill,
    a speculative verify) and the length it starts from all stay rewind points. Writing the ~1 MB state of each layer
    per token was ~10% of a Qwen3.5-0.8B decode step."""

    kind = "recur"
    storage = "f32"

    def __init__(self, conv_len: int, channels: int, heads: int, d_k: int, d_v: int, horizon: int = 16,
                 decode_stride: int = 4):
        if min(conv_len, channels, heads, d_k, d_v, decode_stride) < 1 or horizon < 0:
            raise KVCacheError("recurrent state needs positive sizes and stride, and horizon >= 0")
        self.decode_stride = decode_stride
        with torch.inference_mode(False):   # updated in place inside and outside inference
            self.conv = torch.zeros(conv_len, channels)
            self.state = torch.zeros(heads, d_k, d_v)
            self._slot_ptrs = torch.zeros(max(horizon, 1), dtype=torch.int64)
        self.horizon = horizon
        self.snaps: dict[int, torch.Tensor] = {}     # committed length -> its slot
        self._free: list[torch.Tensor] = []
        self._pool = 0                               # slots allocated
        self._step: tuple[int, int, list[torch.Tensor], set | None] | None = None  # (pos, m, slots, filled)
        self.table_row = None

    def descriptor(self) -> tuple[int, ...]:
        return (self.conv.shape[0], self.conv.shape[1], self.state.shape[0],
                self.state.shape[1] * 65536 + self.state.shape[2])

    # -- slots -----------------------------------------------------------------------
    def _views(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.conv.numel()
        return slot[:w].view_as(self.conv), slot[w:].view_as(self.state)

    def _take(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        self._pool += 1
        with torch.inference_mode(False):
            return torch.empty(self.conv.numel() + self.state.numel())

    def _drop(self, keep) -> None:
        for p in [p for p in self.snaps if not keep(p)]:
            self._free.append(self.snaps.pop(p))

    def _set_entry(self, keep: int) -> None:
        if self.table_row is not None:
            self.table_row[2] = self._slot_ptrs.data_ptr() if keep else 0
            self.table_row[3] = keep

    def _fill(self, slot: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> None:
        c, s = self._views(slot)
        c.copy_(conv)
        s.copy_(state)

    # -- the step --------------------------------------------------------------------
    def reserve(self, pos: int, m: int) -> None:
        self._release_step()
        keep = min(m, self.horizon)
        if not keep:
            return
        if m == 1 and (pos + 1) % self.decode_stride:
            self._step = (pos, m, [], None)      # a decode step between strided snapshots
            return
        end = pos + m
        self._drop(lambda p: end - self.horizon < p <= pos)
        if m > 1 and 0 < pos not in self.snaps and end - self.horizon < pos:   # after strided decode:
            slot = self._take()                                      # the step can rewind to pos
            self._fill(slot, self.conv, self.state)
            self.snaps[pos] = slot
        slots = [self._take() for _ in range(keep)]
        for j, slot in enumerate(slots):
            self._slot_ptrs[j] = slot.data_ptr()
        self._step = (pos, m, slots, None)    # filled None: the native step writes every slot
        self._set_entry(keep)

    def _release_step(self) -> None:
        if self._step is not None:
            self._free.extend(self._step[2])
            self._step = None
        self._set_entry(0)

    def write(self, pos: int, conv: torch.Tensor, state: torch.Tensor, inner=()) -> None:
        """The torch mixer's result: the state after the step, and `inner` (length, conv,
        state) states inside it (those within the reserved kept lengths are kept)."""
        if conv.shape != self.conv.shape or state.shape != self.state.shape:
            raise KVCacheError(f"state {tuple(conv.shape)}/{tuple(state.shape)} does not fit "
                               f"{tuple(self.conv.shape)}/{tuple(self.state.shape)}")
        if conv is not self.conv:       # the native decode call updates the state in place
            self.conv.copy_(conv)
            self.state.copy_(state)
        if not self.horizon:
            return
        inner = [(n, c, s) for n, c, s in inner if n > pos]
        if self._step is None or self._step[0] != pos:    # written without a reservation
            self.reserve(pos, max([n for n, _, _ in inner], default=pos + 1) - pos)
        p0, m, slots, _ = self._step
        first = p0 + m - len(slots) + 1
        filled = set()
        for n, c, s in inner:
            if first <= n <= p0 + m:
                self._fill(slots[n - first], c, s)
                filled.add(n)
        self._step = (p0, m, slots, filled)

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.state

    def step_limit(self) -> int:
        return NO_LIMIT

    def commit(self, length: int) -> None:
        if not self.horizon:
            return
        step, self._step = self._step, None
        self._set_entry(0)
        if step is not None and step[0] + step[1] == length:
            _, _, slots, filled = step
            first = length - len(slots) + 1
            for j, slot in enumerate(slots):
                n = first + j
                if filled is not None and n not in filled:
                    if n != length:
                        self._free.append(slot)
                        continue
                    self._fill(slot, self.conv, self.state)
                self._drop(lambda p, n=n: p != n)   # a stale snapshot of the same length
                self.snaps[n] = slot
        else:                               # no step reserved (a copy, a restore): the state now
            if step is not None:
                self._free.extend(step[2])
            self._drop(lambda p: p != length)
            slot = self._take()
            self._fill(slot, self.conv, self.state)
            self.snaps[length] = slot
        self._drop(lambda p: length - self.horizon < p <= length)

    # -- rewinds ---------------------------------------------------------------------
    def can_truncate(self, keep: int, length: int) -> bool:
        return keep >= length or keep == 0 or keep in self.snaps

    def rewind_points(self) -> tuple[int, ...]:
        return tuple(sorted(self.snaps))

    def rewind_reach(self) -> int:
        return max(0, self.horizon - 1)    # snapshots kept: the last `horizon` lengths

    def truncate(self, keep: int) -> None:
        self._release_step()
        if keep == 0:
            self.conv.zero_()
            self.state.zero_()
            self._drop(lambda p: False)
            return
        conv, state = self._views(self.snaps[keep])
        self.conv.copy_(conv)
        self.state.copy_(state)
        self._drop(lambda p: p <= keep)

    def copy_from(self, src: "RecurrentState", start: int, end: int) -> None:
        if not isinstance(src, RecurrentState) or src.descriptor() != self.descriptor():
            raise KVCacheError("copy_rows: cache geometry or type differs")
        if end not in src.snaps:
            raise KVCacheError(f"copy_rows: the source state has no snapshot at {end}")
        conv, state = src._views(src.snaps[end])
        self.conv.copy_(conv)
        self.state.copy_(state)
        self.commit(end)

    def nbytes(self) -> int:
        return (self.conv.numel() + self.state.numel()) * 4 * (1 + self._pool)

    def bytes_per_position(self) -> int:
        return 0

    def parts(self) -> tuple[torch.Tensor, ...]:
        return ()

    def export(self, start: int, end: int) -> list[torch.Tensor]:
        return []

    def state_parts(self) -> list[torch.Tensor]:
        """What persistence stores once (not per position): the current state."""
        return [self.conv, self.state]

    def restore(self, n: int, parts: list[torch.Tensor]) -> None:
        pass    # kv_persist copies state_parts() in, then the cache commits n

    def native_entry(self) -> tuple[int, int, int, int]:
        """(window, state, snapshot slot table, keep): keep is set per step by reserve."""
        keep = len(self._step[2]) if self._step is not None else 0
        return (self.conv.data_ptr(), self.state.data_ptr(), self._slot_ptrs.data_ptr() if keep else 0, keep)
