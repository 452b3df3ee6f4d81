"""The inference side of the server: one worker thread, KV slots, lockstep batching.

Requests arrive as `Job`s (a `GenRequest` plus a sink the worker pushes events into:
`Piece` per streamed text piece, then exactly one `Finished`). The worker never waits
on a client: the sink only enqueues. `Job.cancel()` (client gone, or the handler has
what it needs) stops that stream at its next token; the other streams go on.

KV slots: each slot owns a cache and the ids it holds. A request takes the free slot
sharing the longest common token prefix with its prompt (else an empty one, else the
least recently used); only the rest is prefilled (`Reply.reused_tokens` is OpenAI's
cached_tokens). A longer prefix held by another slot is copied row for row first.
Slot caches are allocated on first use, and not at all when that would leave less
than a quarter of the machine's memory available (a warm slot is reused instead).

Batching (`batch > 1`): up to `batch` streams decode in lockstep, one batched
forward per step; queued jobs join the running batch between steps (each new stream
is prefilled on its own, then joins). Failures are per stream: a bad prompt, a
sampler error or a cancelled client finishes that stream alone; only a failing
batched forward finishes every stream in it.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fucina.errors import ContextFull, FucinaError
from fucina.models.cache_q8 import make_cache
from fucina.text.batch import forward_step_batch
from fucina.text.generate import Reply, ReplyDecoder, common_prefix, prefill
from fucina.text.sampler import Sampler, SamplingConfig

log = logging.getLogger("fucina.serve")

COPY_MIN = 16    # copy another slot's prefix only when it saves at least this many tokens


@dataclass
class GenRequest:
    ids: list[int]                      # the prompt, tokenized
    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: list[str] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None         # None: off; k: the chosen token's plus the top k
    processor: Any = None               # this request's own LogitProcessor (a grammar Constraint)


@dataclass
class Started:
    prompt_tokens: int
    reused_tokens: int


@dataclass
class Piece:
    text: str
    logprobs: list[tuple] = field(default_factory=list)   # (token, logprob, [(id, logprob)])


@dataclass
class Finished:
    reply: Reply | None
    error: BaseException | None = None
    logprobs: list[tuple] = field(default_factory=list)   # entries not sent with a Piece yet


class QueueFull(FucinaError):
    """The request queue is at its bound."""


class Job:
    def __init__(self, req: GenRequest, sink: Callable[[Any], None]):
        self.req, self.sink = req, sink
        self.cancelled = False
        self.enqueued = time.monotonic()

    def cancel(self) -> None:
        self.cancelled = True


class ServeSampler(Sampler):
    """The request's sampler, also recording log-probabilities (of the model's raw
    distribution, before penalties and truncation) when asked."""

    def __init__(self, config: SamplingConfig, top: int | None, processor=None):
        super().__init__(config, processor)
        self.top = top
        self.entries: list[tuple] = []

    def next(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        tok = super().next(logits, history)
        if self.top is not None:
            lp = torch.log_softmax(logits.detach().reshape(-1).float(), dim=-1)
            top: list[tuple[int, float]] = []
            if self.top > 0:
                v, i = torch.topk(lp, min(self.top, lp.shape[0]))
                top = list(zip(i.tolist(), v.tolist()))
            self.entries.append((tok, float(lp[tok]), top))
        return tok


class Slot:
    def __init__(self, index: int):
        self.index = index
        self.cache = None
        self.tokens: list[int] = []
        self.busy = False
        self.last_used = 0.0
        self.requests = 0


class SlotPool:
    """KV slots, touched by the worker thread only."""

    def __init__(self, model, n: int, capacity: int, cache_type: str = "f16"):
        if n < 1:
            raise FucinaError(f"slots must be at least 1, got {n}")
        self.model, self.capacity, self.cache_type = model, capacity, cache_type
        self.slots = [Slot(i) for i in range(n)]

    def acquire(self, ids: Sequence[int]) -> Slot:
        free = [s for s in self.slots if not s.busy]
        if not free:
            raise FucinaError("no free KV slot")

        def rank(s: Slot):
            n = common_prefix(s.tokens, ids)
            if n:          # among equal prefixes the most recent (its rows are the newest)
                return (n, False, s.last_used)
            return (0, s.cache is None, -s.last_used)     # else an empty slot, else the LRU
        slot = max(free, key=rank)
        if slot.cache is None and not self._room_for_cache():
            warm = [s for s in free if s.cache is not None]     # RAM guard: reuse, do not grow
            if warm:
                slot = max(warm, key=rank)
        if slot.cache is None:
            slot.cache = make_cache(self.model, self.capacity, self.cache_type)
        slot.busy = True
        slot.requests += 1
        self._borrow_prefix(slot, ids)
        return slot

    def cache_bytes(self) -> int:
        """Estimated bytes of one slot's cache (f16: 2 bytes per value; q8_0 ~1.06)."""
        geo = getattr(self.model, "kv_geometry", None)
        if geo is None:
            return 0
        heads, dims = geo()
        per_value = 2.0 if self.cache_type in ("f16", None) else 34 / 32
        return int(2 * sum(h * d for h, d in zip(heads, dims)) * self.capacity * per_value)

    def _room_for_cache(self) -> bool:
        """A new slot cache may be allocated while it leaves a quarter of the memory
        available now (Linux MemAvailable; unknown elsewhere: allowed)."""
        try:
            with open("/proc/meminfo") as fh:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}
        except (OSError, ValueError, IndexError):
            return True
        avail, total = info.get("MemAvailable"), info.get("MemTotal")
        if avail is None or total is None:
            return True
        return avail - self.cache_bytes() > total // 4

    def _borrow_prefix(self, slot: Slot, ids: Sequence[int]) -> None:
        """Copy a longer common prefix held by another slot (busy ones too: rows
        below a live stream's prompt never change) instead of prefilling it."""
        own = common_prefix(slot.tokens, ids)
        best, n = None, own
        for s in self.slots:
            if s is not slot and s.cache is not None:
                k = min(common_prefix(s.tokens, ids), s.cache.len, len(ids) - 1)
                if k > n:
                    best, n = s, k
        if best is None or n - own < COPY_MIN or not hasattr(slot.cache, "copy_rows"):
            return
        try:
            slot.cache.truncate(own)
            del slot.tokens[own:]
            slot.cache.copy_rows(best.cache, own, n)
            slot.tokens.extend(ids[own:n])
        except FucinaError:
            slot.cache.truncate(own)
            del slot.tokens[own:]

    def release(self, slot: Slot) -> None:
        slot.busy = False
        slot.last_used = time.monotonic()

    def stats(self) -> list[dict]:
        return [{"id": s.index, "busy": s.busy, "tokens": len(s.tokens), "requests": s.requests,
                 "allocated": s.cache is not None} for s in self.slots]


class _Stream:
    """One job being decoded in a slot."""

    def __init__(self, engine: "Engine", job: Job, slot: Slot):
        self.engine, self.job, self.slot = engine, job, slot
        req = job.req
        self.sampler = ServeSampler(req.sampling, req.logprobs, req.processor)
        logits, reused = prefill(engine.model, slot.cache, slot.tokens, req.ids)
        self.logits = logits
        self.rd = ReplyDecoder(slot.cache, slot.tokens, self.sampler, engine.tokenizer,
                               max_tokens=req.max_tokens, stop_ids=req.stop_ids, stop=req.stop,
                               reply=Reply(prompt_tokens=len(req.ids), reused_tokens=reused))
        self.sent = 0           # logprob entries already handed out
        job.sink(Started(len(req.ids), reused))

    @property
    def cache(self):
        return self.slot.cache

    def step(self) -> int | None:
        if self.job.cancelled:
            return None
        tok, piece = self.rd.step(self.logits)
        if piece:
            n = len(self.rd.reply.tokens)
            lps = self.sampler.entries[self.sent:n] if self.sampler.top is not None else []
            self.sent = max(self.sent, n)
            self.job.sink(Piece(piece, lps))
        return tok


class Engine:
    """Model + tokenizer + template + slots; `run` is the worker loop."""

    def __init__(self, model, tokenizer, template, *, n_ctx: int | None = None, slots: int = 1,
                 batch: int = 1, cache_type: str = "f16", name: str | None = None):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.n_ctx = n_ctx or min(model.config.n_ctx_train, 4096)
        self.batch = max(1, batch)
        self.pool = SlotPool(model, max(slots, self.batch), self.n_ctx, cache_type)
        self.name = name or "model"
        self.stop_ids = frozenset(template.stop_ids(tokenizer))
        self.stats = collections.Counter()

    # -- worker ------------------------------------------------------------------
    def run(self, take: Callable[[int, bool], list[Job] | None]) -> None:
        """The worker loop: `take(n, block)` yields up to n queued jobs (None: stop)."""
        live: list[_Stream] = []
        while True:
            jobs = take(self.batch - len(live), not live)
            if jobs is None:
                for s in live:
                    s.job.cancel()
                    self._finish(s)
                return
            for job in jobs:
                s = self._start(job)
                if s is not None:
                    live.append(s)
            if live:
                live = self._step(live)

    def _start(self, job: Job) -> _Stream | None:
        if job.cancelled:
            job.sink(Finished(None))
            return None
        slot = None
        try:
            slot = self.pool.acquire(job.req.ids)
            return _Stream(self, job, slot)
        except Exception as e:             # isolated: this request fails alone
            if slot is not None:
                self.pool.release(slot)
            self.stats["failed"] += 1
            if not isinstance(e, FucinaError):
                log.exception("prefill failed")
            job.sink(Finished(None, e))
            return None

    def _finish(self, s: _Stream, error: BaseException | None = None) -> None:
        reply = s.rd.close()
        self.pool.release(s.slot)
        self.stats["failed" if error else "cancelled" if s.job.cancelled else "completed"] += 1
        self.stats["tokens"] += len(reply.tokens)
        left = s.sampler.entries[s.sent:len(reply.tokens)] if s.sampler.top is not None else []
        try:
            s.job.sink(Finished(reply, error, left))
        except Exception:                  # a broken sink must not take the worker down
            log.exception("a request's sink failed")

    def _step(self, live: list[_Stream]) -> list[_Stream]:
        forward: list[tuple[_Stream, int]] = []
        for s in live:
            try:
                tok = s.step()
            except Exception as e:
                if not isinstance(e, FucinaError):
                    log.exception("decode step failed")
                self._finish(s, e)
                continue
            if tok is None:
                self._finish(s)
            else:
                forward.append((s, tok))
        if not forward:
            return []
        streams = [s for s, _ in forward]
        try:
            if len(forward) == 1:
                s, tok = forward[0]
                s.logits = self.model.forward_step(s.cache, [tok], s.cache.len)
            else:
                out = forward_step_batch(self.model, [s.cache for s in streams], [t for _, t in forward])
                for row, s in enumerate(streams):
                    s.logits = out[row]
        except Exception as e:             # a shared forward failed: its streams end
            log.exception("forward failed")
            for s in streams:
                self._finish(s, e)
            return []
        return streams


def check_fits(ids: Sequence[int], n_ctx: int) -> None:
    if len(ids) >= n_ctx:
        raise ContextFull(f"the prompt has {len(ids)} tokens; the context holds {n_ctx} "
                          f"(prompt plus at least one generated token)")
    if not ids:
        raise FucinaError("the prompt is empty")


class Scheduler:
    """A bounded FIFO in front of the engine's single worker thread."""

    def __init__(self, engine: Engine, max_queue: int = 64):
        self.engine, self.max_queue = engine, max_queue
        self._q: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fucina-worker", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self.engine.run(self._take)
        except BaseException:              # never expected; keep the server answering
            log.exception("the inference worker stopped")
            raise

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stop:
                raise QueueFull("the server is shutting down")
            if len(self._q) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            self._q.append(job)
            self._cv.notify()

    @property
    def depth(self) -> int:
        return len(self._q)

    def _take(self, n: int, block: bool) -> list[Job] | None:
        with self._cv:
            while block and not self._q and not self._stop:
                self._cv.wait()
            if self._stop:
                out = list(self._q)
                self._q.clear()
                for job in out:
                    job.sink(Finished(None, QueueFull("the server is shutting down")))
                return None
            out = []
            while self._q and len(out) < n:
                job = self._q.popleft()
                if job.cancelled:
                    job.sink(Finished(None))
                    continue
                out.append(job)
            return out
