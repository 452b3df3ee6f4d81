"""Pipeline stages over torch.distributed: one model's layers split across processes
(hosts), each mapping only its own layers' bytes.

Launched by torchrun (`torchrun --nproc-per-node N -m fucina run|chat|serve|bench MODEL
--pipeline`), every rank opens the same GGUF and builds a *stage*: the family's own Model
over a contiguous layer range (`stage_tensors` renames `blk.{lo+j}.*` to `blk.{j}.*`, so
the family code runs unchanged on a shorter model). Rank 0 holds the tokenizer, the
embeddings, the sampler and the scheduler (everything above the Decoder contract: it sees
a `PipelineDecoder`); the last rank holds the head.

One step, rank 0 leading:
  1. rank 0 broadcasts a small header (the op, then per stream: cache id, capacity,
     storage, first position, rows, which logits are wanted);
  2. rank 0 embeds the ids and runs its layers; each stage sends its residual rows [m, n_embd]
     (f32, as the one-process step keeps them between layers) to the next, which runs its
     own layers; the last applies the head and sends the wanted logits to rank 0.
Every rank keeps its own caches, keyed by rank 0's cache ids. A stage's cache follows rank
0's from the headers alone: a step at position p first rewinds the stage's cache to p.
Rank 0 decides every rewind with a cache of the *whole* model's layer kinds, its own layers
real and the others shape-only (`PhantomKV`: the same rewind and window bookkeeping, no
rows), so what it rewinds to every stage can rewind to. The kernels are batch-invariant and
activations travel in their own dtype, so the output is bitwise the one-process output.

Faults: every collective and point-to-point call has the group's timeout
(`FUCINA_PIPELINE_TIMEOUT`, 20 s by default, or `timeout=`); a stage that dies or stops
answering turns the call in flight into a `PipelineError` on rank 0, which then refuses every
later call with the same error (the server answers 503, /health goes red) instead of
hanging. The group is not repaired in place: restart it (torchrun `--max-restarts`).
"""
from __future__ import annotations

import atexit
import itertools
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Sequence

import torch

from fucina.errors import FucinaError, InvalidArgument, KVCacheError, PipelineError
from fucina.gguf import GGUFFile
from fucina.models.base import DecoderBase, Ragged, Tokens, as_ids
from fucina.models.cache import KVCache, KVMemory, WindowKV, cache_capacity
from fucina.models.schema.base import Tensors

DEFAULT_TIMEOUT_S = float(os.environ.get("FUCINA_PIPELINE_TIMEOUT", "20"))

# families whose layers differ only by what config.layers says (a stage is then the same
# family over a slice); the others read a layer's global index or share state across layers
STAGE_FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe")

# the header: PREAMBLE int64s (op, count, op arguments), then `count` entries of ENTRY int64s
PREAMBLE, ENTRY = 8, 6
OP_STEP, OP_COPY, OP_FREE, OP_STOP, OP_CHECK = 1, 2, 3, 4, 5
WANT_NONE, WANT_LAST, WANT_ALL = 0, 1, 2
STORAGES = ("f16", "q8_0")
_BLK = re.compile(r"blk\.(\d+)\.(.*)")


# -- the split ---------------------------------------------------------------------------

def layer_bytes(f: GGUFFile, n_layer: int) -> list[int]:
    """Bytes of each layer's tensors in the file (what a stage maps)."""
    out = [0] * n_layer
    for name, t in f.tensors.items():
        m = _BLK.match(name)
        if m and int(m.group(1)) < n_layer:
            out[int(m.group(1))] += t.data.nbytes
    return out


def plan_split(sizes: Sequence[int], world: int, split: Sequence[int] | None = None,
               head_bytes: int = 0) -> list[tuple[int, int]]:
    """Contiguous layer ranges [lo, hi), one per rank: `split` gives the layer counts by
    hand; otherwise the ranges minimise the largest stage's bytes (the last stage also
    holds the head, `head_bytes`)."""
    n = len(sizes)
    if world < 2:
        raise InvalidArgument(f"a pipeline needs at least 2 ranks, got {world}")
    if world > n:
        raise InvalidArgument(f"{world} ranks for a model of {n} layers: at most one rank per layer")
    if split is not None:
        split = [int(s) for s in split]
        if len(split) != world or any(s < 1 for s in split) or sum(split) != n:
            raise InvalidArgument(f"--split {','.join(map(str, split))}: {world} positive layer counts "
                                  f"summing to {n} expected")
        bounds = list(itertools.accumulate(split, initial=0))
        return list(zip(bounds, bounds[1:]))
    prefix = list(itertools.accumulate(sizes, initial=0))

    def ranges(limit: int) -> list[tuple[int, int]] | None:
        """Greedy from the back (the last stage carries the head): the fewest stages under limit."""
        out, hi, extra = [], n, head_bytes
        while hi > 0:
            lo = hi - 1
            if prefix[hi] - prefix[lo] + extra > limit:
                return None
            while lo > 0 and prefix[hi] - prefix[lo - 1] + extra <= limit and (world - len(out) - 1) < lo:
                lo -= 1
            out.append((lo, hi))
            hi, extra = lo, 0
        return out[::-1] if len(out) <= world else None

    lo_b, hi_b = 0, prefix[n] + head_bytes
    while lo_b < hi_b:                       # the smallest largest-stage that fits in `world` stages
        mid = (lo_b + hi_b) // 2
        if ranges(mid) is None:
            lo_b = mid + 1
        else:
            hi_b = mid
    best = ranges(lo_b)
    while len(best) < world:                 # fewer stages fit: split the largest further
        i = max((j for j, (a, b) in enumerate(best) if b - a > 1), key=lambda j: prefix[best[j][1]] - prefix[best[j][0]])
        a, b = best[i]
        cut = a + (b - a) // 2
        best[i:i + 1] = [(a, cut), (cut, b)]
    return best


def stage_tensors(t: Tensors, lo: int, hi: int) -> Tensors:
    """The checked table of layers [lo, hi) as a model of hi - lo layers: `blk.{lo+j}.*`
    listed as `blk.{j}.*`, every global tensor kept, the config's layer list sliced."""
    c = t.config
    if not 0 <= lo < hi <= c.n_layer:
        raise InvalidArgument(f"stage layers [{lo}, {hi}) outside the model's {c.n_layer}")
    sub = Tensors(t.f, replace(c, n_layer=hi - lo, layers=list(c.layers[lo:hi])))
    for name, info in t._checked.items():
        m = _BLK.match(name)
        if m is None:
            sub._checked[name] = info
        elif lo <= int(m.group(1)) < hi:
            sub._checked[f"blk.{int(m.group(1)) - lo}.{m.group(2)}"] = info
    return sub


def build_stage(f: GGUFFile, checked: Tensors, lo: int, hi: int):
    """The family's Model over layers [lo, hi) only (their tensors are the only ones it reads)."""
    from fucina.models.registry import family
    arch = checked.config.arch
    if arch not in STAGE_FAMILIES:
        raise PipelineError(f"pipeline stages are not supported for the {arch} family yet "
                            f"(supported: {', '.join(STAGE_FAMILIES)})")
    model = family(arch).Model(f, stage_tensors(checked, lo, hi))
    model.gguf = f
    return model


# -- caches ------------------------------------------------------------------------------

class PhantomKV(KVMemory):
    """A layer another stage holds, as rank 0's cache sees it: the kind's rewind and window
    bookkeeping with rows of zero width (no bytes, no native entry)."""

    def native_entry(self):
        return None


class PhantomWindow(WindowKV):
    def native_entry(self):
        return None


class PipelineCache(KVCache):
    """Rank 0's cache: the whole model's layer kinds (its own layers real, the others
    phantom), identified to the other stages by `pid`; every other stage keeps a cache of
    its own layers under that id."""

    def stage_table(self, n_own: int):
        """The native pointer table of rank 0's own (leading) layers, or None."""
        entries = getattr(self, "_stage_table", None)
        if entries is None:
            sub = KVCache.of(self.memories[:n_own], self.capacity)
            entries = self._stage_table = sub.native_table() or False
        return entries or None

    def copy_rows(self, src: "KVCache", start: int, end: int) -> None:
        super().copy_rows(src, start, end)
        if self.group is not None:
            self.group.copy(self, src, start, end)


# -- the group ---------------------------------------------------------------------------

@dataclass
class Entry:
    """One stream of a step: its cache, where it starts, how many rows, which logits."""
    cache_id: int
    capacity: int
    storage: int
    pos0: int
    m: int
    want: int

    def ints(self) -> list[int]:
        return [self.cache_id, self.capacity, self.storage, self.pos0, self.m, self.want]


def _wanted_rows(entries: Sequence[Entry]) -> list[int]:
    rows, at = [], 0
    for e in entries:
        if e.want == WANT_ALL:
            rows += range(at, at + e.m)
        elif e.want == WANT_LAST:
            rows.append(at + e.m - 1)
        at += e.m
    return rows


class Stage:
    """This process's part of the group: its rank, its layers [lo, hi), its model, and the
    calls every rank makes in the same order."""

    def __init__(self, model, rank: int, world: int, lo: int, hi: int, n_layer: int, timeout: float):
        self.model, self.rank, self.world, self.lo, self.hi = model, rank, world, lo, hi
        self.n_layer, self.timeout = n_layer, timeout
        self.first, self.last = rank == 0, rank == world - 1
        self.caches: dict[int, KVCache] = {}      # other ranks: rank 0's cache id -> this stage's cache

    # -- transport: every call bounded by the group's timeout -----------------------------
    def _wait(self, work) -> None:
        if not work.wait(timedelta(seconds=self.timeout)):
            raise PipelineError(f"pipeline stage did not answer within {self.timeout:g} s")

    def broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist
        self._wait(dist.broadcast(t, 0, async_op=True))

    def send(self, t: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist
        self._wait(dist.isend(t.contiguous(), dst))

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        import torch.distributed as dist
        self._wait(dist.irecv(t, src))
        return t

    def header(self, op: int, entries: Sequence[Sequence[int]] = (), args: Sequence[int] = ()) -> None:
        pre = torch.zeros(PREAMBLE, dtype=torch.int64)
        pre[0], pre[1] = op, len(entries)
        pre[2:2 + len(args)] = torch.tensor(list(args), dtype=torch.int64)
        self.broadcast(pre)
        if entries:
            self.broadcast(torch.tensor([list(e) for e in entries], dtype=torch.int64).reshape(-1))

    def read_header(self) -> tuple[int, list[int], list[list[int]]]:
        pre = torch.zeros(PREAMBLE, dtype=torch.int64)
        self.broadcast(pre)
        op, n, args = int(pre[0]), int(pre[1]), pre[2:].tolist()
        rows = []
        if n:
            body = torch.zeros(n * ENTRY if op == OP_STEP else n, dtype=torch.int64)
            self.broadcast(body)
            rows = body.reshape(n, ENTRY).tolist() if op == OP_STEP else [[v] for v in body.tolist()]
        return op, args, rows

    # -- the layers of this stage ---------------------------------------------------------
    def run_layers(self, x: torch.Tensor, caches: Sequence[KVCache], entries: Sequence[Entry]) -> torch.Tensor:
        """This stage's layers over the rows of `entries` (their caches already reserved):
        one stream of m rows, or one row per stream."""
        model = self.model
        if len(entries) == 1:
            cache, e = caches[0], entries[0]
            table = self._table(cache)
            if table is not None:
                x = x.contiguous()
                model.native_plan.run(x, table, e.pos0, [t.table(e.pos0 + e.m) for t in model.rope_tables(cache.capacity)])
                return x
            for i in range(model.config.n_layer):
                x = model.block(i, x, cache, e.pos0)
            return x
        if any(e.m != 1 for e in entries):
            raise PipelineError("a pipeline step takes one stream of many rows or one row per stream")
        tables = [self._table(c) for c in caches]
        if all(t is not None for t in tables):
            x = x.contiguous()
            end = max(e.pos0 for e in entries) + 1
            model.native_plan.run_batch(x, tables, [e.pos0 for e in entries],
                                        [t.table(end) for t in model.rope_tables(max(c.capacity for c in caches))])
            return x
        batch = Ragged(caches)
        for i in range(model.config.n_layer):
            x = model.block(i, x, batch, 0)
        return x

    def _table(self, cache: KVCache):
        model = self.model
        if model.native_plan is None or not model.use_native_step:
            return None
        table = cache.stage_table(self.hi - self.lo) if isinstance(cache, PipelineCache) else cache.native_table()
        return table if table is not None and model.native_plan.fits(table) else None

    # -- one step, on every rank -----------------------------------------------------------
    def step(self, x: torch.Tensor | None, caches: Sequence[KVCache], entries: Sequence[Entry]) -> torch.Tensor | None:
        """Rank 0 passes the embedded rows; the others receive theirs. Returns the wanted
        logits on rank 0, None elsewhere."""
        rows = sum(e.m for e in entries)
        if x is None:
            x = self.recv(torch.empty(rows, self.model.config.n_embd), self.rank - 1)
        for c, e in zip(caches, entries):
            c.reserve(e.m)
        with torch.inference_mode():
            x = self.run_layers(x, caches, entries)
        for c, e in zip(caches, entries):
            c.advance(e.m)
        if not self.last:
            self.send(x, self.rank + 1)
        else:
            want = _wanted_rows(entries)
            with torch.inference_mode():
                logits = self.model.head(x[want]).float().contiguous() if want else torch.empty(0)
            if want:
                self.send(logits, 0)
        if self.first:
            want = _wanted_rows(entries)
            if not want:
                return None
            return self.recv(torch.empty(len(want), self.model.config.n_vocab), self.world - 1)
        return None

    # -- ranks other than 0: follow the headers --------------------------------------------
    def _cache_for(self, e: Entry) -> KVCache:
        c = self.caches.get(e.cache_id)
        if c is None or c.capacity != e.capacity:
            c = self.caches[e.cache_id] = self.model.init_cache(e.capacity, cache_type=STORAGES[e.storage])
        if c.len > e.pos0:
            c.truncate(e.pos0)
        if c.len != e.pos0:
            raise PipelineError(f"stage {self.rank}: cache {e.cache_id} holds {c.len} positions, "
                                f"the step starts at {e.pos0}")
        return c

    def serve_group(self) -> None:
        """Serve until rank 0 stops the group; when the group breaks, re-form it if this rank
        was started on its own (its caches start empty again), else leave with the error."""
        while True:
            try:
                return self.serve()
            except (PipelineError, RuntimeError) as e:
                if not self.member.can_reform:
                    raise PipelineError(f"pipeline stage {self.rank}: the group failed: {_first_line(e)}") from None
                self.caches.clear()
                self.member.reform()
                agree(self.timeout, self.rank, self.world, self.facts)

    def serve(self) -> None:
        """The loop of every rank but 0: one header at a time, until rank 0 stops the group."""
        while True:
            op, args, rows = self.read_header()
            if op == OP_STOP:
                return
            if op == OP_CHECK:
                continue
            if op == OP_FREE:
                for (cid,) in rows:
                    self.caches.pop(cid, None)
            elif op == OP_COPY:
                dst_id, src_id, start, end, capacity, storage = args[:6]
                dst = self._cache_for(Entry(dst_id, capacity, storage, start, 0, 0))
                dst.copy_rows(self.caches[src_id], start, end)
            elif op == OP_STEP:
                entries = [Entry(*r) for r in rows]
                self.step(None, [self._cache_for(e) for e in entries], entries)
            else:
                raise PipelineError(f"stage {self.rank}: unknown pipeline op {op}")


class PipelineDecoder:
    """Rank 0's Decoder: the whole model as the generic layers see it (config, caches,
    steps), computed by the group. Once a stage fails, every call raises the PipelineError."""

    supports_batch = True
    native_plan = None            # text.batch's ragged pass takes the per-segment route
    use_native_step = True

    def __init__(self, stage: Stage, config, f: GGUFFile, ranges: list[tuple[int, int]]):
        self.stage, self.config, self.gguf, self.ranges = stage, config, f, ranges
        self.window_slack = stage.model.window_slack
        self.native_chunk = stage.model.native_chunk
        self._ids = itertools.count(1)
        self._freed: list[int] = []
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self.failure: PipelineError | None = None
        self.stopped = False
        self._last_call = time.monotonic()
        # an idle group still exchanges a header every quarter timeout (the stages' waits for
        # the next header stay bounded, a dead stage shows at once); after a failure the same
        # thread re-forms the group when the ranks were started on their own
        threading.Thread(target=self._keep, name="fucina-pipeline", daemon=True).start()

    # -- the contract ------------------------------------------------------------------------
    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16", rewindable: bool = False) -> PipelineCache:
        cap = cache_capacity(capacity, self.config.n_ctx_train, cache_type)   # a type of STORAGES
        own = self.stage.model.init_cache(cap, dtype, cache_type, rewindable).memories
        mems = list(own)
        for s in self.config.layers[len(own):]:
            geo = (cap, 0, s.head_dim, s.v_dim, cache_type, dtype)
            mems.append(PhantomWindow(*geo, window=s.window, slack=self.window_slack)
                        if s.window and not rewindable else PhantomKV(*geo))
        cache = PipelineCache.of(mems, cap)
        cache.pid, cache.group, cache.storage = next(self._ids), self, STORAGES.index(cache_type)
        weakref.finalize(cache, self._freed.append, cache.pid)
        self._live.add(cache)
        return cache

    def kv_bytes(self, capacity: int, cache_type: str = "f16") -> int:
        """The whole model's KV bytes (every stage together; each holds its layers' share)."""
        return DecoderBase.kv_bytes(self, capacity, cache_type)

    def kv_geometry(self):
        return [s.n_head_kv for s in self.config.layers], [s.head_dim for s in self.config.layers]

    def forward_step(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        return self._forward(cache, tokens, pos0, WANT_LAST)[0]

    def forward_step_all_logits(self, cache: KVCache, tokens: Tokens, pos0: int) -> torch.Tensor:
        return self._forward(cache, tokens, pos0, WANT_ALL)

    def forward_last_logits(self, tokens: Tokens) -> torch.Tensor:
        return self.forward_step(self.init_cache(max(len(tokens), 1)), tokens, 0)

    def forward_step_batch(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        if len(caches) != len(tokens) or not caches:
            raise FucinaError(f"forward_step_batch: {len(caches)} caches for {len(tokens)} tokens")
        if len({id(c) for c in caches}) != len(caches):
            raise KVCacheError("forward_step_batch: the same cache appears twice")
        ids = as_ids(tokens, self.config.n_vocab)
        for c in caches:
            self._check_cache(c)
            c.check_room(1)
        entries = [Entry(c.pid, c.capacity, c.storage, c.len, 1, WANT_LAST) for c in caches]
        return self._call(lambda: self._step(ids, caches, entries))

    # -- steps -------------------------------------------------------------------------------
    def _check_cache(self, cache) -> None:
        if not isinstance(cache, PipelineCache) or cache.group is not self:
            raise KVCacheError("a pipeline model steps only caches it made (init_cache)")

    def _forward(self, cache: KVCache, tokens: Tokens, pos0: int, want: int) -> torch.Tensor:
        self._check_cache(cache)
        if cache.len != pos0:
            raise FucinaError(f"forward_step: cache holds {cache.len} positions, pos0 is {pos0}")
        ids = as_ids(tokens, self.config.n_vocab)
        m = ids.numel()
        cache.check_room(m)

        def run():
            step, outs = min(self.native_chunk, cache.step_limit()), []
            for s in range(0, m, step):       # the one-process chunking (models.base._hidden)
                n = min(step, m - s)
                last = s + n == m
                e = Entry(cache.pid, cache.capacity, cache.storage, pos0 + s, n,
                          want if want == WANT_ALL or last else WANT_NONE)
                out = self._step(ids[s:s + n], [cache], [e])
                if out is not None:
                    outs.append(out)
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        return self._call(run)

    def _step(self, ids: torch.Tensor, caches, entries: list[Entry]) -> torch.Tensor:
        st = self.stage
        self._flush_freed()
        st.header(OP_STEP, [e.ints() for e in entries])
        with torch.inference_mode():
            x = st.model.embed(ids).float().contiguous()
        return st.step(x, caches, entries)

    def copy(self, dst: PipelineCache, src: PipelineCache, start: int, end: int) -> None:
        """Mirror rank 0's copy_rows on every stage."""
        self._check_cache(src)
        self._call(lambda: self.stage.header(OP_COPY, args=(dst.pid, src.pid, start, end, dst.capacity, dst.storage)))

    def _flush_freed(self) -> None:
        if self._freed:
            ids, self._freed[:] = list(self._freed), []
            self.stage.header(OP_FREE, [[i] for i in ids])

    def _call(self, fn):
        with self._lock:
            if self.failure is not None:
                raise self.failure
            if self.stopped:
                raise PipelineError("the pipeline group has been stopped")
            self._last_call = time.monotonic()
            try:
                return fn()
            except PipelineError as e:
                self.failure = e
                raise
            except RuntimeError as e:         # gloo: a peer closed its connection, a timeout
                self.failure = PipelineError(f"a pipeline stage failed: {_first_line(e)}")
                raise self.failure from None

    # -- health and shutdown ------------------------------------------------------------------
    def check(self) -> None:
        """One header round trip to every stage (raises the PipelineError if one is gone)."""
        self._call(lambda: self.stage.header(OP_CHECK))

    def stop(self) -> None:
        """Release every stage (they return from `serve`); idempotent."""
        with self._lock:
            if self.stopped or self.failure is not None:
                self.stopped = True
                return
            self.stopped = True
            try:
                self.stage.header(OP_STOP)
            except Exception:   # noqa: BLE001 (a stage already gone has nothing to release)
                pass

    def _keep(self) -> None:
        period = self.stage.timeout / 4
        member = getattr(self.stage, "member", None)
        while not self.stopped:
            time.sleep(period / 4)
            if self.failure is None:
                if time.monotonic() - self._last_call >= period and not self.stopped:
                    try:
                        self.check()
                    except FucinaError:
                        pass
            elif member is not None and member.can_reform:
                try:
                    member.reform()
                    agree(self.stage.timeout, 0, self.stage.world, self.stage.facts)
                except (FucinaError, RuntimeError):
                    continue
                with self._lock:          # every stage starts the new group with empty caches
                    for c in list(self._live):
                        c.truncate(0)
                    self.failure, self._last_call = None, time.monotonic()
            else:
                return

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self.stopped

    def describe(self) -> dict:
        return {"world": self.stage.world, "layers": [list(r) for r in self.ranges],
                "healthy": self.healthy, "error": str(self.failure) if self.failure else None}


# -- joining a group -----------------------------------------------------------------------

def parse_split(text: str | None) -> list[int] | None:
    if text is None or text == "":
        return None
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise InvalidArgument(f"--split {text!r}: layer counts like 10,12 expected") from None


class Membership:
    """How this process belongs to its group. Under torchrun the agent owns the group (a
    failed rank restarts or ends all of them: `--max-restarts`); ranks started on their own
    (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE in the environment, no agent) re-form it
    instead: rank 0 keeps answering (503) while a stage is down, and the group is re-formed,
    generation by generation, over rank 0's TCPStore once every rank is back."""

    def __init__(self, timeout: float):
        import torch.distributed as dist

        self.timeout = timeout
        self.agent = "TORCHELASTIC_RUN_ID" in os.environ
        missing = [k for k in ("RANK", "WORLD_SIZE") + (() if self.agent else ("MASTER_ADDR", "MASTER_PORT"))
                   if k not in os.environ]
        if missing:
            raise PipelineError(f"--pipeline needs a torch.distributed environment ({', '.join(missing)} not "
                                f"set): torchrun --nproc-per-node N -m fucina ... --pipeline")
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not 0 <= self.rank < self.world:
            raise PipelineError(f"RANK {self.rank} outside WORLD_SIZE {self.world}")
        self.generation, self.store = 0, None
        if self.agent:
            if not dist.is_initialized():
                dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
            return
        from torch.distributed import TCPStore
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        try:
            self.store = TCPStore(host, port, None, self.rank == 0, timedelta(seconds=max(timeout, 60)),
                                  wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            raise PipelineError(f"cannot reach the pipeline's rank 0 at {host}:{port}: {e}") from None
        if self.rank == 0:
            self.store.set("fucina/generation", "1")
        self.form(1 if self.rank == 0 else self._next_generation(0))

    def _next_generation(self, after: int) -> int:
        """The generation this rank joins: the current one unless it is already formed (a
        restarted rank then waits for rank 0 to open the next)."""
        while True:
            g = int(self.store.get("fucina/generation"))
            if g > after and not self.store.check([f"g{g}/formed"]):
                return g
            time.sleep(0.2)

    def form(self, g: int) -> None:
        import torch.distributed as dist

        self.store.set(f"g{g}/here/{self.rank}", "1")
        if self.rank == 0:           # everyone present, then go: no init waits on an absent rank
            while not self.store.check([f"g{g}/here/{r}" for r in range(self.world)]):
                time.sleep(0.1)
            self.store.set(f"g{g}/go", "1")
        else:
            while not self.store.check([f"g{g}/go"]):
                if int(self.store.get("fucina/generation")) != g:
                    return self.form(self._next_generation(g))
                time.sleep(0.1)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"g{g}", self.store), rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=self.timeout))
        self.generation = g

    def formed(self) -> None:
        if self.store is not None and self.rank == 0:
            self.store.set(f"g{self.generation}/formed", "1")

    @property
    def can_reform(self) -> bool:
        return self.store is not None

    def reform(self) -> None:
        """After a failure: leave the broken group and form the next generation (rank 0 opens it)."""
        _shutdown()
        if self.rank == 0:
            g = self.generation + 1
            self.store.set("fucina/generation", str(g))
            self.form(g)
        else:
            self.form(self._next_generation(self.generation))


def agree(stage_timeout: float, rank: int, world: int, facts: list[int], problem: str = "") -> None:
    """Every rank states what it would run; all must agree, or every rank raises alike."""
    import torch.distributed as dist

    mine = torch.tensor(facts + [int(bool(problem))], dtype=torch.int64)
    seen = [torch.zeros_like(mine) for _ in range(world)]
    Stage(None, rank, world, 0, 0, 0, stage_timeout)._wait(dist.all_gather(seen, mine, async_op=True))
    if problem:
        raise PipelineError(problem)
    bad = [r for r, v in enumerate(seen) if not torch.equal(v, seen[0])]
    if bad:
        raise PipelineError(f"pipeline ranks disagree on the model or the split (ranks {bad} differ from "
                            f"rank 0): every rank must open the same GGUF with the same --split")


def join(path, *, split: Sequence[int] | None = None, timeout: float | None = None,
         checked: Tensors | None = None) -> tuple[Stage, list[tuple[int, int]], Tensors]:
    """Join the group this process was started in (torchrun's environment, or the standard
    MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE) as one stage of `path`. Every rank checks
    that the group agrees on the model file, the split and the layer count before any layer
    runs: a mismatch is a PipelineError on every rank, not a hang."""
    from fucina.models.registry import check

    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    if timeout <= 0:
        raise InvalidArgument(f"pipeline timeout must be positive, got {timeout}")
    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    checked = checked if checked is not None else check(f)
    c = checked.config
    member = Membership(timeout)
    sizes = layer_bytes(f, c.n_layer)
    head = f.tensors.get("output.weight") or f.tensors.get("token_embd.weight")
    problem = ""
    try:
        ranges = plan_split(sizes, member.world, split, head_bytes=head.data.nbytes if head is not None else 0)
    except FucinaError as e:
        ranges, problem = [], str(e)
    facts = [c.n_layer, sum(t.data.nbytes for t in f.tensors.values()), len(f.tensors), sum(sizes),
             hash(tuple(ranges)) % (1 << 62)]
    try:
        agree(timeout, member.rank, member.world, facts, problem)
    except BaseException:
        # release the group before the error leaves: a process exiting with gloo's threads
        # still running aborts ("terminate called without an active exception"), exit code -6
        _shutdown()
        member.store = None
        raise
    member.formed()
    lo, hi = ranges[member.rank]
    stage = Stage(build_stage(f, checked, lo, hi), member.rank, member.world, lo, hi, c.n_layer, timeout)
    stage.member, stage.facts = member, facts
    return stage, ranges, checked


def start(path, *, split: Sequence[int] | None = None, timeout: float | None = None,
          checked: Tensors | None = None) -> PipelineDecoder:
    """Join the group. Rank 0 gets the PipelineDecoder (the group stops when it is
    stopped, or at exit); every other rank serves rank 0's steps until then and exits."""
    stage, ranges, checked = join(path, split=split, timeout=timeout, checked=checked)
    if stage.rank != 0:
        try:
            stage.serve_group()
        finally:
            _shutdown()
        raise SystemExit(0)
    dec = PipelineDecoder(stage, checked.config, stage.model.gguf, ranges)
    atexit.register(lambda: (dec.stop(), _shutdown()))
    return dec


def _first_line(e: BaseException) -> str:
    """A gloo error's first line, without the C++ source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\] ", "", text).split(". This is typically")[0]


def _shutdown() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:   # noqa: BLE001 (a broken group has nothing left to release)
            pass
