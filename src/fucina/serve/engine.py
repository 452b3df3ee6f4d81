"""The inference side of the server: one worker thread, KV slots, continuous batching.

Requests arrive as `Job`s (a `GenRequest` plus a sink the worker pushes events into:
`Started` once its prompt is in the cache, `Piece` per streamed text piece, then
exactly one `Finished`). The worker never waits on a client: the sink only enqueues.
`Job.cancel()` (client gone, or the handler has what it needs) stops that stream at
the next step; the other streams go on.

KV slots: each slot owns a cache and the ids it holds. A request takes the free slot
sharing the longest common token prefix with its prompt (else an empty one, else the
least recently used); only the rest is computed (`Reply.reused_tokens` is OpenAI's
cached_tokens). A longer prefix held by another slot is copied row for row first, and
a request whose prompt shares a long prefix with one still being prefilled waits for
those rows and copies them, so a system prompt that N arrivals share is computed once.
Slot caches are allocated on first use, and not at all when that would leave less
than a quarter of the machine's memory available (a warm slot is reused instead).

Scheduling (continuous batching): up to `batch` streams run at once. Every step is
ONE model pass over all of them (`fucina.text.batch.ragged_step`): a row per decoding
stream plus prompt chunks of the streams still prefilling, those chunks together at
most `chunk` rows, so a long prompt arriving costs the decoding streams one bounded
pass per step and never a stall. Streams join (admitted from the queue) and leave
(finished, cancelled) between steps. Admission is by KV budget: a stream reserves
min(prompt + max_tokens, n_ctx) positions and waits in the queue while the running
streams' reservations would exceed `kv_budget`. Sampling is per stream (its own
sampler and logits row), so a stream's tokens do not depend on its neighbours beyond
what the batched kernels do (bit-equal rows where the kernels are batch-invariant).
A speculative stream (serve --spec, a request's `speculative`, a prediction) adds its
verify rows [carried, draft...] to the same pass and walks them at the next step (the
decoder's `steps` protocol); where rows are not invariant it verifies on its own.

Failures are per stream: a bad prompt, a sampler error, a cancelled client or a
segment that fails on the torch path finishes that stream alone; only a failing
shared native pass finishes every stream in it.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fucina.errors import ContextFull, FucinaError
from fucina.kernels import first_max
from fucina.models.cache_q8 import make_cache
from fucina.serve.metrics import Metrics
from fucina.text.batch import SegmentError, ragged_step
from fucina.text.generate import Reply, ReplyDecoder, common_prefix
from fucina.text.sampler import Sampler, SamplingConfig, as_row
from fucina.text.speculative.decoder import pass_clock
from fucina.weights.ram import available_ram

log = logging.getLogger("fucina.serve")

COPY_MIN = 16         # copy another slot's prefix only when it saves at least this many tokens
CHUNK = 128           # prompt rows per pass, all prefilling streams together
MAX_AUTO_STREAMS = 32


@dataclass
class GenRequest:
    ids: list[int]                      # the prompt, tokenized
    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: list[str] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None         # None: off; k: the chosen token's plus the top k
    processor: Any = None               # this request's own LogitProcessor (a grammar Constraint)
    speculative: bool | None = None     # None: the engine's default (serve --spec)
    references: list[list[int]] = field(default_factory=list)   # drafts may copy these (a prediction)
    prefix: int = 0                     # leading ids that stand for a cartridge's rows (not prompt tokens)
    diffusion: Any = None               # a diffusion model's text.diffusion.DiffusionConfig (serve.diffusion)
    cartridge: Any = None               # a text.cartridge.Prefix this request starts behind (serve --fleet),
                                        # or a callable that returns one on the engine's thread (retrieval)


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
        # plain greedy: the argmax of the row itself, without the base class's copy of
        # the row (a 1 MiB pass per stream and step on a 262k vocabulary)
        self.fast = config.greedy and not config.penalties_on and self.processor is None

    @staticmethod
    def _plain_argmax(logits: torch.Tensor) -> int | None:
        """The greedy token, or None when the row needs the full checks (NaN, +-inf at
        the top: torch's argmax ranks NaN highest, so a NaN row always lands here)."""
        best, top = first_max(as_row(logits))
        return best if math.isfinite(top) else None

    def next(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        tok = self._plain_argmax(logits) if self.fast else None
        if tok is None:
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
        self.tokens: list[int] = []     # the ids the cache holds, always len(tokens) == cache.len
        self.busy = False
        self.last_used = 0.0
        self.requests = 0
        self.copied = 0                 # rows the last acquire copied from another slot


def copy_prefix(slot: Slot, donor: Slot, ids: Sequence[int], start: int, end: int) -> int:
    """Make `slot` hold ids[:end], rows [start, end) copied from `donor` (which holds
    them); returns the rows copied (0 when the copy is refused: slot keeps ids[:start])."""
    try:
        slot.cache.truncate(start)
        del slot.tokens[start:]
        slot.cache.copy_rows(donor.cache, start, end)
        slot.tokens.extend(ids[start:end])
        return end - start
    except FucinaError:
        slot.cache.truncate(start)
        del slot.tokens[start:]
        return 0


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
        slot.copied = self._borrow_prefix(slot, ids)
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

    def kv_bytes_per_token(self) -> float:
        return self.cache_bytes() / self.capacity

    def _borrow_prefix(self, slot: Slot, ids: Sequence[int]) -> int:
        """Copy a longer common prefix held by another slot (busy ones too: rows
        below a live stream's prompt never change) instead of prefilling it; returns
        the rows copied."""
        own = slot.cache.truncate_point(common_prefix(slot.tokens, ids))
        best, n = None, own
        for s in self.slots:
            if s is not slot and s.cache is not None:
                k = min(common_prefix(s.tokens, ids), s.cache.len, len(ids) - 1)
                if k > n:
                    best, n = s, k
        if best is None or n - own < COPY_MIN:
            return 0
        return copy_prefix(slot, best, ids, own, n)

    def release(self, slot: Slot) -> None:
        slot.busy = False
        slot.last_used = time.monotonic()

    def stats(self) -> list[dict]:
        return [{"id": s.index, "busy": s.busy, "tokens": len(s.tokens), "requests": s.requests,
                 "allocated": s.cache is not None} for s in self.slots]


class _Stream:
    """One job in the running batch: prefilling while `pending` (prompt ids not yet in
    the cache) is non-empty, then decoding from `logits`."""

    def __init__(self, engine: "Engine", job: Job, slot: Slot):
        self.engine, self.job, self.slot = engine, job, slot
        req = job.req
        if len(req.ids) > slot.cache.capacity:
            raise ContextFull(f"prompt of {len(req.ids)} tokens exceeds the context of {slot.cache.capacity}")
        p = 0
        self.prefix = engine.prefix_of(req)
        if self.prefix is not None:        # a cartridge: seat it unless the slot keeps it
            self.prefix.ensure(slot.cache, slot.tokens, req.ids)
            p = self.prefix.p
        keep = slot.cache.truncate_point(min(common_prefix(slot.tokens, req.ids), len(req.ids) - 1))
        slot.cache.truncate(keep)
        del slot.tokens[keep:]
        self.copied = min(slot.copied, keep)
        self.reused = keep - self.copied
        self.p = p
        self.pending: list[int] = [int(i) for i in req.ids[keep:]]
        self.reserve = min(len(req.ids) + req.max_tokens, engine.n_ctx)
        self.donor: _Stream | None = None     # a stream prefilling the prefix this one shares
        self.share = 0                        # ... up to this position
        self.sampler = ServeSampler(req.sampling, req.logprobs, req.processor)
        self.rd = ReplyDecoder(slot.cache, slot.tokens, self.sampler, engine.tokenizer,
                               max_tokens=req.max_tokens, stop_ids=req.stop_ids, stop=req.stop,
                               reply=Reply(prompt_tokens=len(req.ids) - p))
        self.logits: torch.Tensor | None = None
        self.sent = 0           # logprob entries already handed out
        self.live = True
        self.spec, self.gen = None, None   # speculative: the decoder's generator
        self.verify = None                 # its verify request riding this step's pass
        self.batched = False               # True: verify rows ride the ragged pass
        if req.references or (engine.spec if req.speculative is None else req.speculative):
            self.spec = engine.slot_speculation(slot, req.references, self.prefix)
            self.batched = self.spec.batchable(engine.model, slot.cache)

    @property
    def cache(self):
        return self.slot.cache

    def wait_for_donor(self) -> bool:
        """True while the shared prefix is still being computed by the donor; once it
        is there, copy it (then this stream prefills only the rest)."""
        d = self.donor
        if d is None:
            return False
        if not d.live or d.cache.len < self.share and not d.pending:
            self.donor = None        # it left (or cannot get there): compute the prefix here
            return False
        if d.cache.len < self.share:
            return True
        have = self.cache.len
        n = copy_prefix(self.slot, d.slot, self.job.req.ids, have, self.share)
        self.copied += n
        del self.pending[:n]
        self.donor = None
        return False

    def prefilled(self, logits: torch.Tensor) -> None:
        p = self.p                        # cartridge rows are not prompt tokens
        self.rd.reply.reused_tokens = max(0, self.reused + self.copied - p)
        self.engine.metrics.prompt(len(self.job.req.ids) - p, max(0, self.reused - p), self.copied)
        self.job.sink(Started(len(self.job.req.ids) - p, max(0, self.reused + self.copied - p)))
        self.logits = logits

    def spec_step(self) -> bool | None:
        """Run the speculative decoder (its own verify passes, row by row where rows are
        not invariant) to its next piece; None when the reply is over."""
        if self.gen is None:
            self.gen = self.spec.drive(self.engine.model, self.rd, self.logits)
            self.logits = None
        try:
            self._emit(next(self.gen))
        except StopIteration:
            self._predicted()
            return None
        return True

    def spec_segment(self) -> list[int] | None:
        """Advance the speculative decoder to its next verify request, streaming what it
        commits on the way (the rows of the last pass are walked here); the request's
        [carried, draft...] tokens ride this step's ragged pass. None: the reply is over."""
        if self.gen is None:
            self.gen = self.spec.steps(self.engine.model, self.rd, self.logits)
            self.logits = None
        self.verify = None
        try:
            while True:
                item = next(self.gen)
                if not isinstance(item, str):
                    self.verify = item
                    return item.tokens
                self._emit(item)
        except StopIteration:
            self._predicted()
            return None

    def _predicted(self) -> None:
        if self.job.req.references:
            self.rd.reply.prediction = self.spec.prediction_counts()

    def _emit(self, piece: str) -> None:
        n = len(self.rd.reply.tokens)
        lps = self.sampler.entries[self.sent:n] if self.sampler.top is not None else []
        self.sent = max(self.sent, n)
        self.job.sink(Piece(piece, lps))

    def sample(self) -> int | None:
        """Sample the next token from `logits` and stream its text; None: the reply is over."""
        first = not self.rd.reply.tokens
        tok, piece = self.rd.step(self.logits)
        self.logits = None
        if first:
            self.engine.metrics.first_token(time.monotonic() - self.job.enqueued)
        if piece:
            self._emit(piece)
        return tok


class Engine:
    """Model + tokenizer + template + slots; `run` is the worker loop.

    `batch`: streams run at once (None: as many n_ctx-sized reservations as the KV
    budget holds, at most MAX_AUTO_STREAMS); `kv_budget`: positions all running
    streams may reserve together (None: a quarter of the memory available now, at
    most 4 GiB of KV, and at least one full context); `chunk`: prompt rows per pass."""

    def __init__(self, model, tokenizer, template, *, n_ctx: int | None = None, slots: int = 1,
                 batch: int | None = None, cache_type: str = "f16", name: str | None = None,
                 chunk: int = CHUNK, kv_budget: int | None = None, spec: bool = False,
                 spec_max: int = 16, prefix=None):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.prefix = prefix   # text.cartridge.Prefix: every conversation starts behind a cartridge
        self.spec, self.spec_max = spec, spec_max   # speculative decoding by default (serve --spec)
        self.n_ctx = n_ctx or min(model.config.n_ctx_train, 4096)
        if chunk < 1:
            raise FucinaError(f"chunk must be at least 1, got {chunk}")
        self.chunk = chunk
        probe = SlotPool(model, 1, self.n_ctx, cache_type)
        self.kv_budget = max(kv_budget or default_kv_budget(probe.kv_bytes_per_token()), self.n_ctx)
        self.batch = max(1, batch) if batch else max(1, min(MAX_AUTO_STREAMS, self.kv_budget // self.n_ctx))
        self.pool = SlotPool(model, max(slots, self.batch), self.n_ctx, cache_type)
        self.name = name or "model"
        self.stop_ids = frozenset(template.stop_ids(tokenizer))
        self.stats = collections.Counter()
        self.metrics = Metrics()

    # -- worker ------------------------------------------------------------------
    def run(self, take: Callable[[int, bool, Callable[[Job], bool]], list[Job] | None]) -> None:
        """The worker loop: `take(n, block, fits)` yields up to n queued jobs, in order,
        while `fits(job)` admits them (None: stop)."""
        live: list[_Stream] = []
        while True:
            jobs = take(self.batch - len(live), not live, self._admission(live))
            if jobs is None:
                for s in live:
                    s.job.cancel()
                    self._finish(s)
                self.metrics.idle()
                return
            for job in jobs:
                s = self._start(job, live)
                if s is not None:
                    live.append(s)
            if live:
                live = self._step(live)
            if not live:
                self.metrics.idle()

    def prefix_of(self, req: GenRequest):
        """The cartridge a request starts behind: its own (a fleet's), else the server's.
        A callable one (a fleet retrieval) is called here: this thread alone runs the model."""
        if callable(req.cartridge):
            req.cartridge = req.cartridge()
        return req.cartridge or self.prefix

    def slot_speculation(self, slot: Slot, references: Sequence[Sequence[int]], prefix=None):
        """The slot's speculative state (its index mirrors the slot's tokens), armed
        with this request's references (predictions: aligned with the reply's start)."""
        from fucina.text.speculative import Speculation
        if getattr(slot, "spec", None) is None:
            slot.spec = Speculation(self.model.config.n_vocab, max_draft=self.spec_max)
        slot.spec.index.clear_references()
        for ref in references:
            slot.spec.add_reference(ref, anchored=True)
        if prefix is not None and prefix.cart.corpus:
            slot.spec.add_reference(prefix.cart.corpus)   # the cartridge's document
        return slot.spec

    def _admission(self, live: list[_Stream]) -> Callable[[Job], bool]:
        reserved = sum(s.reserve for s in live)

        def fits(job: Job) -> bool:
            nonlocal reserved
            need = min(len(job.req.ids) + job.req.max_tokens, self.n_ctx)
            if reserved + need > self.kv_budget and reserved:
                return False
            reserved += need
            return True
        return fits

    def _start(self, job: Job, live: list[_Stream]) -> _Stream | None:
        if job.cancelled:
            job.sink(Finished(None))
            return None
        slot = None
        try:
            prefix = self.prefix_of(job.req)
            if prefix is not None and not job.req.prefix:   # positions 0..p-1: the cartridge
                job.req.ids, job.req.prefix = prefix.add(job.req.ids), prefix.p
            slot = self.pool.acquire(job.req.ids)
            s = _Stream(self, job, slot)
        except Exception as e:             # isolated: this request fails alone
            if slot is not None:
                self.pool.release(slot)
            self.stats["failed"] += 1
            self.metrics.finished("failed")
            if not isinstance(e, FucinaError):
                log.exception("admission failed")
            job.sink(Finished(None, e))
            return None
        self._find_donor(s, live)
        return s

    def _find_donor(self, s: _Stream, live: list[_Stream]) -> None:
        """A stream still prefilling a longer shared prefix: wait for its rows and copy."""
        ids, have = s.job.req.ids, s.cache.len
        for d in live:
            if not d.pending:
                continue
            k = min(common_prefix(d.job.req.ids, ids), len(ids) - 1)
            if k - have >= COPY_MIN and k > s.share:
                s.donor, s.share = d, k

    def _finish(self, s: _Stream, error: BaseException | None = None) -> None:
        s.live = False
        if s.gen is not None:
            s.gen.close()                          # the decoder rewinds its rows
        if s.cache.len > len(s.slot.tokens):        # a segment failed after writing rows
            keep = s.cache.truncate_point(len(s.slot.tokens))
            s.cache.truncate(keep)
            del s.slot.tokens[keep:]
        reply = s.rd.close()
        self.pool.release(s.slot)
        outcome = "failed" if error else "cancelled" if s.job.cancelled else "completed"
        self.stats[outcome] += 1
        self.stats["tokens"] += len(reply.tokens)
        self.metrics.finished(outcome)
        left = s.sampler.entries[s.sent:len(reply.tokens)] if s.sampler.top is not None else []
        try:
            s.job.sink(Finished(reply, error, left))
        except Exception:                  # a broken sink must not take the worker down
            log.exception("a request's sink failed")

    def _step(self, live: list[_Stream]) -> list[_Stream]:
        """One pass: sample every decoding stream, then one ragged forward of their
        new tokens plus the prefill chunks that fit in `chunk` rows."""
        keep: list[_Stream] = []
        segments: list[tuple[_Stream, list[int]]] = []
        sampled = 0
        # rows this pass will carry besides a speculative stream's own (its draft budget
        # weighs them: past 4 rows a pass costs a step more): one per other decoding
        # stream, or its segment once planned, and the prefill rows that fit
        decoding = sum(s.logits is not None or s.gen is not None for s in live)
        prefill_rows = min(self.chunk, sum(len(s.pending) for s in live))
        for s in live:
            if s.job.cancelled:
                self._finish(s)
                continue
            if s.logits is not None or s.gen is not None:
                decoding -= 1
                if s.batched:
                    s.spec.decoder.shared_rows = sum(len(t) for _, t in segments) + decoding + prefill_rows
                had = len(s.rd.reply.tokens)
                try:   # a speculative stream's verify rows ride this pass when `batched`
                    if s.spec is None:
                        tok = s.sample()
                    else:
                        tok = s.spec_segment() if s.batched else s.spec_step()
                except Exception as e:
                    if not isinstance(e, FucinaError):
                        log.exception("decode step failed")
                    self._finish(s, e)
                    continue
                if s.spec is not None:
                    sampled += len(s.rd.reply.tokens) - had
                    if not had and s.rd.reply.tokens:
                        self.metrics.first_token(time.monotonic() - s.job.enqueued)
                if tok is None:
                    self._finish(s)
                    continue
                if s.spec is None:
                    sampled += 1
                    segments.append((s, [tok]))
                elif s.batched:
                    segments.append((s, tok))
            keep.append(s)
        if sampled:
            self.metrics.generated(sampled)
        room = self.chunk
        for s in keep:
            if s.pending and room > 0 and not s.wait_for_donor() and s.pending:
                segments.append((s, s.pending[:room]))
                room -= len(segments[-1][1])
        if not segments:
            return keep
        want = [not s.pending or len(t) == len(s.pending) for s, t in segments]
        every = [s.verify is not None and not s.pending for s, _ in segments]
        verify = [every] if any(every) else []       # a plain batch makes the plain call
        clock = pass_clock()     # a verify riding alone is timed for its stream's cost gate
        t0 = clock()
        try:
            out = ragged_step(self.model, [s.cache for s, _ in segments], [t for _, t in segments], want, *verify)
        except Exception as e:             # the shared pass failed: its streams end
            log.exception("forward failed")
            failed = {id(s) for s, _ in segments}
            for s, _ in segments:
                self._finish(s, e)
            return [s for s in keep if id(s) not in failed]
        for (s, toks), o in zip(segments, out):
            if isinstance(o, SegmentError):
                if not isinstance(o.cause, FucinaError):
                    log.error("a stream's forward failed: %r", o.cause)
                self._finish(s, o.cause)
            elif s.pending:
                s.slot.tokens.extend(toks)
                del s.pending[:len(toks)]
                if not s.pending:
                    s.prefilled(o)
            elif s.verify is not None:
                s.verify.rows = o          # walked by the decoder at the next step
                if len(segments) == 1:     # timed only alone: a shared pass is not its cost
                    s.verify.seconds = clock() - t0
            else:
                s.logits = o
        keep = [s for s in keep if s.live]
        self.metrics.step(sum(len(t) for _, t in segments), len(keep), sum(bool(s.pending) for s in keep))
        return keep


def default_kv_budget(bytes_per_token: float) -> int:
    """Positions of KV the running streams may reserve: a quarter of the memory
    available now (`weights.ram.available_ram`), at most 4 GiB (1 GiB where unknown)."""
    room = available_ram()
    avail = 1 << 30 if room is None else min(room // 4, 4 << 30)
    return int(avail / bytes_per_token) if bytes_per_token > 0 else 1 << 20

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

    def _take(self, n: int, block: bool, fits: Callable[[Job], bool] | None = None) -> list[Job] | None:
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
                job = self._q[0]
                if job.cancelled:
                    self._q.popleft()
                    job.sink(Finished(None))
                    continue
                if fits is not None and not fits(job):
                    break                      # FIFO: the head waits for room, so do the rest
                out.append(self._q.popleft())
            return out
