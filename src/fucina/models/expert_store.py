"""Experts streamed from disk (issue 15): a RAM budget for a MoE model's expert stacks.

With a budget the experts are no longer read through the GGUF's mmap: the store owns a
fixed pool of slots (the budget's bytes, anonymous memory), one expert per slot (its rows
of each of its layer's stacks), and reads an expert into a slot with pread when a layer
chooses it and it is not resident. Before each MoE layer runs, its hook gets the experts
the router chose (the torch path from moe.mix, the native layer step from
csrc/generic/moe_impl.inc through a C callback, answered with a per-layer pointer table);
`Residency` decides which resident experts give up their slots. The bytes in a slot are
the file's bytes or, where a load would put the stack in 16-row groups (the K-quants, the
two-block units, MXFP4: kernels.stream_layout), those bytes packed into the groups as they
are read (one native pass, kernels.read_into), so streamed experts get the grouped decode
GEMV as resident ones do; the stack's kernel then names the slots' type
(kernels.StoredKernel). The matmuls are the same kernels on them: the output is bitwise the
resident run's. Prefetch: each layer's hook also asks the kernel to read ahead
(POSIX_FADV_WILLNEED) the next layer's previous choice that is not resident, so decode's
token-to-token expert reuse comes from the page cache instead of the disk.

The budget holds at every layer boundary: the experts one layer chose are all resident while
it runs, so the smallest budget is one layer's whole stack (a long prefill can choose every
expert of a layer). The residency policy: `heat` (default) evicts the expert with the lowest
decayed use count among those the current layer did not choose, the least recently used
first among equals; `lru` evicts the least recently used.
"""
from __future__ import annotations

import ctypes
import heapq
import math
import os
from dataclasses import dataclass, field
from typing import Hashable, Iterable

import torch

from fucina import kernels
from fucina.errors import FucinaError, InvalidArgument
from fucina.weights import LinearWeight
from fucina.weights.row_groups import as_grouped

POLICIES = ("heat", "lru")
GIB = 1 << 30


class Residency:
    """Which keys stay resident under a byte budget (pure bookkeeping; the store applies it).

    `acquire(keys)` makes the keys resident together and returns (loaded, evicted): the keys
    that were not resident, and the ones given up for them. `heat` scores a key by its
    decayed use count (each use adds 2 ** (t / half_life) at acquire number t, so older uses
    weigh half per half_life acquires); `lru` by its last use. Ties go to the older key."""

    def __init__(self, budget: int, sizes: dict[Hashable, int], policy: str = "heat", half_life: int = 64):
        if policy not in POLICIES:
            raise InvalidArgument(f"expert store: policy {policy!r} is not one of {', '.join(POLICIES)}")
        if budget <= 0:
            raise InvalidArgument(f"expert store: budget must be positive, got {budget} bytes")
        if half_life < 1:
            raise InvalidArgument(f"expert store: half_life must be >= 1, got {half_life}")
        self.budget, self.sizes, self.policy, self.half_life = budget, sizes, policy, half_life
        self.resident: set[Hashable] = set()
        self.used = 0                      # bytes of the resident keys
        self.score: dict[Hashable, float] = {}
        self.last: dict[Hashable, int] = {}
        self._heap: list[tuple[float, int, Hashable]] = []   # lazy: stale entries skipped
        self.clock = self._base = 0
        self.hits = self.misses = self.evictions = 0

    def acquire(self, keys: Iterable[Hashable]) -> tuple[list, list]:
        keys = list(dict.fromkeys(keys))
        loaded = [k for k in keys if k not in self.resident]
        if loaded:   # (all resident: they fit)
            want = sum(self._size(k) for k in keys)
            if want > self.budget:
                raise FucinaError(f"expert store: {want} bytes chosen at once exceed the budget of {self.budget}")
        self.clock += 1
        self.hits += len(keys) - len(loaded)
        self.misses += len(loaded)
        need = sum(self.sizes[k] for k in loaded)
        chosen, evicted = set(keys), []
        while self.used + need > self.budget:
            victim = self._pop_victim(chosen)
            self.resident.discard(victim)
            self.used -= self.sizes[victim]
            evicted.append(victim)
        self.evictions += len(evicted)
        for k in loaded:
            self.resident.add(k)
            self.used += self.sizes[k]
        self._touch(keys)
        return loaded, evicted

    def drop(self, k: Hashable) -> None:
        """Forget that k is resident (its load failed)."""
        if k in self.resident:
            self.resident.discard(k)
            self.used -= self.sizes[k]

    def _size(self, k: Hashable) -> int:
        try:
            return self.sizes[k]
        except KeyError:
            raise FucinaError(f"expert store: unknown expert {k!r}") from None

    def _touch(self, keys: list) -> None:
        # every call's hook lands here (a decode token: once a MoE layer), so the loop is lean
        add = None
        if self.policy != "lru":
            if (self.clock - self._base) > 512 * self.half_life:   # keep the weights finite
                self._rescale()
            add = 2.0 ** ((self.clock - self._base) / self.half_life)
        score, last, heap, t = self.score, self.last, self._heap, self.clock
        for k in keys:
            s = float(t) if add is None else score.get(k, 0.0) + add
            score[k], last[k] = s, t
            heapq.heappush(heap, (s, t, k))
        if len(heap) > 4 * len(self.resident) + 1024:
            self._rebuild()

    def _pop_victim(self, chosen: set) -> Hashable:
        while self._heap:
            s, t, k = heapq.heappop(self._heap)
            if k in self.resident and k not in chosen and self.last.get(k) == t and self.score.get(k) == s:
                return k
        raise FucinaError("expert store: nothing left to evict")   # unreachable while want <= budget

    def _rescale(self) -> None:
        f = 2.0 ** (-(self.clock - self._base) / self.half_life)
        self.score = {k: s * f for k, s in self.score.items()}
        self._base = self.clock
        self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self.score[k], self.last[k], k) for k in self.resident]
        heapq.heapify(self._heap)


# -- the store: a fixed pool of expert slots, filled by pread ----------------------------

HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32), ctypes.c_int64)
_ALIGN = 64


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class _Stack:
    """Where one expert stack's rows live in the file, and how one expert's rows look."""
    fd: int
    offset: int          # file offset of expert 0
    size: int            # bytes per expert
    rows: int
    weight: LinearWeight  # the whole stack (qtype, in_features, name)
    groups: int | None    # the row-group type a slot holds this stack's rows in; None: the file's rows


@dataclass
class StoreStats:
    acquires: int = 0
    read_bytes: int = 0
    prefetched: int = 0          # experts whose file range was read ahead for the next layer
    errors: list[str] = field(default_factory=list)


class ExpertStore:
    """One model's streamed experts: `budget` bytes of slots, each holding one expert's rows
    of every stack of its layer (gate, up, down or gate_up, down), read from the file on a miss.
    Per layer a pointer table [n_stacks, n_expert] (int64; 0 = not resident) tells the native
    step where each resident expert's rows are; the torch path gets LinearWeight views."""

    def __init__(self, f, layers: dict, budget: int, policy: str = "heat", prefetch: bool = True,
                 groups: bool = True):
        self._fds: dict[str, int] = {}
        try:
            self.stacks = {i: [self._locate(f, s, groups) for s in ex.stacks + (ex.down,)] for i, ex in layers.items()}
        except FucinaError:
            self.close()
            raise
        self.n_expert = {i: ex.n_expert for i, ex in layers.items()}
        self.slot_bytes = max(sum(_up(s.size) for s in st) for st in self.stacks.values())
        self.total = sum(ex.nbytes for ex in layers.values())
        self.min_budget = max(self.n_expert.values()) * self.slot_bytes
        if budget < self.min_budget:
            self.close()
            raise InvalidArgument(f"expert store: a budget of {budget / GIB:.3f} GiB is below one layer's experts "
                                  f"({self.min_budget / GIB:.3f} GiB of {self.total / GIB:.3f} GiB); raise --moe-ram")
        self.n_slots = min(budget // self.slot_bytes, sum(self.n_expert.values()))
        keys = [(i, e) for i, n in self.n_expert.items() for e in range(n)]
        self.policy = Residency(self.n_slots * self.slot_bytes, dict.fromkeys(keys, self.slot_bytes), policy)
        self.pool = kernels.huge_empty(self.n_slots * self.slot_bytes)   # pages come on first write
        self._pool_np = self.pool.numpy()
        self.readers = max(1, kernels.get_threads()) if kernels.available() else 1
        packed = max((s.size for st in self.stacks.values() for s in st if s.groups is not None), default=0)
        self._stage = torch.empty(self.readers * packed, dtype=torch.uint8)   # a reader's read before its packing
        self.free = list(range(self.n_slots - 1, -1, -1))
        self.slot_of: dict[tuple[int, int], int] = {}
        self.views: dict[tuple[int, int], tuple[LinearWeight, ...]] = {}
        self.tables = {i: torch.zeros(len(st), self.n_expert[i], dtype=torch.int64) for i, st in self.stacks.items()}
        self.layers = sorted(layers)
        self._next = {a: b for a, b in zip(self.layers, self.layers[1:])}
        self.prefetch = prefetch
        self.last_choice: dict[int, list[int]] = {}
        self.stats = StoreStats()
        self._hook = HOOK(self._native_use)      # kept alive: the plan holds its address
        self.hook_address = ctypes.cast(self._hook, ctypes.c_void_p).value

    def _locate(self, f, stack, groups: bool) -> _Stack:
        t = f.tensors.get(stack.name)
        if t is None or t.nbytes != stack.nbytes:
            raise FucinaError(f"expert store: {stack.name!r} is not a tensor of {f.path}")
        path = f.part_path(t)   # opened again for pread
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        size, rows = stack.nbytes // stack.n_expert, stack.out_features
        pseudo = kernels.stream_layout(stack.whole, rows) if groups else None
        return _Stack(self._fds[path], t.offset, size, rows, stack.whole, pseudo)

    @property
    def budget(self) -> int:
        return self.policy.budget

    def use(self, layer: int, experts: list[int]) -> dict[int, tuple[LinearWeight, ...]]:
        """Layer `layer` is about to run `experts`: read the missing ones into slots (evicting
        by the policy); their weights, per expert, in the stacks' order."""
        self.make_resident(layer, experts)
        return {e: self._views((layer, e)) for e in experts}

    def make_resident(self, layer: int, experts: list[int]) -> None:
        """The native step's half of `use`: the slots and the pointer table only."""
        loaded, evicted = self.policy.acquire((layer, e) for e in experts)
        self.stats.acquires += 1
        for k in evicted:
            self.free.append(self.slot_of.pop(k))
            self.tables[k[0]][:, k[1]] = 0
            self.views.pop(k, None)
        if loaded:
            self._read_all([(k, self.free.pop()) for k in loaded])
        self.last_choice[layer] = experts
        nxt = self._next.get(layer)
        if self.prefetch and nxt is not None and nxt in self.last_choice:
            self._read_ahead(nxt, [e for e in self.last_choice[nxt] if (nxt, e) not in self.slot_of])

    def _read_all(self, jobs: list[tuple[tuple[int, int], int]]) -> None:
        """Read each (key, slot), all of them over the kernels' threads (kernels.read_into: each
        thread with its own stage for the packed stacks), then the bookkeeping. A key with a
        failed read is not resident and its slot is free again; the first failure is raised."""
        reads, whose, base = [], [], self.pool.data_ptr()
        for i, ((layer, e), slot) in enumerate(jobs):
            at = slot * self.slot_bytes
            for s in self.stacks[layer]:
                reads.append((s.fd, s.offset + e * s.size, s.size, s.groups, s.rows, at))
                whose.append((i, s, e))
                at += _up(s.size)
        if kernels.available():
            got = kernels.read_into([(fd, off, size, g, n, base + at) for fd, off, size, g, n, at in reads],
                                    self._stage, self.readers)
        else:   # no native module: the file's rows, one read at a time
            got = [os.preadv(fd, [memoryview(self._pool_np[at:at + size])], off) for fd, off, size, _, _, at in reads]
        failed: dict[int, Exception] = {}
        for (i, s, e), n in zip(whose, got):
            if n != s.size and i not in failed:
                failed[i] = (OSError(-n, f"expert store: reading {s.weight.name}[{e}]: {os.strerror(-n)}") if n < 0 else
                             FucinaError(f"expert store: short read of {s.weight.name}[{e}] ({n} of {s.size} bytes)"))
        for i, ((layer, e), slot) in enumerate(jobs):
            if i in failed:
                self.free.append(slot)
                self.policy.drop((layer, e))
                continue
            at = slot * self.slot_bytes
            for j, s in enumerate(self.stacks[layer]):
                self.tables[layer][j, e] = self.pool.data_ptr() + at
                at += _up(s.size)
            self.stats.read_bytes += sum(s.size for s in self.stacks[layer])
            self.slot_of[(layer, e)] = slot
        if failed:
            raise failed[min(failed)]

    def _views(self, key: tuple[int, int]) -> tuple[LinearWeight, ...]:
        """The resident expert's weights over its slot (made on first use, dropped on eviction)."""
        views = self.views.get(key)
        if views is None:
            (layer, e), at, out = key, self.slot_of[key] * self.slot_bytes, []
            for s in self.stacks[layer]:
                w = LinearWeight(self.pool[at:at + s.size], s.weight.qtype, s.rows, s.weight.in_features,
                                 f"{s.weight.name}[{e}]")
                if s.groups is None:
                    kernels.attach(w)
                else:
                    kernels.read_groups(w, s.groups)
                    w = as_grouped(w)
                out.append(w)
                at += _up(s.size)
            views = self.views[key] = tuple(out)
        return views

    def _read_ahead(self, layer: int, experts: list[int]) -> None:
        if not experts or not hasattr(os, "posix_fadvise"):
            return
        self.stats.prefetched += len(experts)
        for e in experts:
            for s in self.stacks[layer]:
                os.posix_fadvise(s.fd, s.offset + e * s.size, s.size, os.POSIX_FADV_WILLNEED)

    def hook(self, layer: int):
        """The torch path's callback (moe.Experts.on_use)."""
        return lambda experts: self.use(layer, experts)

    def plan_fields(self, layer: int) -> dict:
        """What the native plan's MoE layer needs to call the store (csrc/generic/moe_impl.inc)."""
        return dict(moe_hook=self.hook_address, moe_hook_ctx=layer, moe_table=self.tables[layer].data_ptr())

    def _native_use(self, layer: int, ids, n: int) -> int:
        # called from the native step with the GIL re-taken: nothing may raise through C, so a
        # failure is recorded and answered with 1 (the step stops, its table entries stay 0)
        try:
            n_expert = self.n_expert.get(layer, 0)
            experts = ids[:n]
            if experts and (min(experts) < 0 or max(experts) >= n_expert):
                raise FucinaError(f"expert store: layer {layer} chose experts outside [0, {n_expert})")
            self.make_resident(layer, experts)
            return 0
        except Exception as e:   # noqa: BLE001 - reported, see above
            if len(self.stats.errors) < 16:
                self.stats.errors.append(f"{type(e).__name__}: {e}")
            return 1

    def report(self) -> dict:
        p = self.policy
        return dict(budget=p.budget, total=self.total, slots=self.n_slots, resident=p.used, policy=p.policy,
                    hits=p.hits, misses=p.misses, evictions=p.evictions, read_bytes=self.stats.read_bytes,
                    prefetched=self.stats.prefetched, errors=list(self.stats.errors))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __del__(self):
        self.close()


def parse_budget(value, total: int) -> int:
    """--moe-ram / moe_ram: GiB (a number) or a share of the experts' bytes ('50%') -> bytes."""
    text = str(value).strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if not (math.isfinite(share) and 0 < share <= 100):
                raise ValueError
            return max(1, int(total * share / 100))
        gib = float(text)
        if not (math.isfinite(gib) and gib > 0):
            raise ValueError
        return int(gib * GIB)
    except ValueError:
        raise InvalidArgument(f"moe_ram: expected GiB > 0 or a share like '50%', got {value!r}") from None


def stream_experts(model, moe_ram, policy: str = "heat", prefetch: bool = True, groups: bool = True) -> ExpertStore:
    """Put `model`'s expert stacks under a RAM budget (`moe_ram`: GiB or 'N%' of the experts'
    bytes); the native plan, if any, is rebuilt to call the store. Returns the store.
    `groups=False` keeps the file's rows in the slots where they would be packed into row
    groups (benchmarks/expert_groups.py compares the two)."""
    from fucina.models.moe import Experts

    layers = {i: L.experts for i, L in enumerate(getattr(model, "layers", ()))
              if isinstance(getattr(L, "experts", None), Experts)}
    if not layers:
        raise InvalidArgument(f"moe_ram: the {type(model).__module__.rsplit('.', 1)[-1]} model has no expert stacks")
    from fucina.weights import ExpertStack
    if any(not isinstance(st, ExpertStack) for ex in layers.values() for st in ex.stacks + (ex.down,)):
        # gemma4's fused gate_up stack is read as two row views of one tensor (its halves)
        raise InvalidArgument("moe_ram: this file's expert stacks are views of a fused tensor, which the expert "
                              "store does not stream yet; load it without --moe-ram")
    for ex in layers.values():   # stacks a load put in row groups: back to the file's rows the store reads
        for st in ex.stacks + (ex.down,):
            if kernels.group_rows(getattr(st.whole, "kernel", None)):
                kernels.attach(st.whole)
    total = sum(ex.nbytes for ex in layers.values())
    store = ExpertStore(model.gguf, layers, parse_budget(moe_ram, total), policy, prefetch, groups)
    for s in (s for st in store.stacks.values() for s in st if s.groups is not None):
        s.weight.kernel = kernels.StoredKernel(s.weight, s.groups)   # the type the plan's steps read
    for i, ex in layers.items():
        ex.on_use = store.hook(i)
    model.expert_store = store
    for ex in layers.values():   # the mapping's expert pages are no longer read: drop any it holds
        for st in ex.stacks + (ex.down,):
            model.gguf.release(model.gguf.tensors[st.name])
    if hasattr(model, "refresh_plans"):
        model.refresh_plans()   # the native plans point at the weights they were built from
    return store
