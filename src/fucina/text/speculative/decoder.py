"""SpeculativeDecoder: several committed tokens per weight pass, the plain stream's tokens.

The lossless contract. Every draft source is deterministic (a one-hot proposal), so
rejection sampling reduces to running the FULL sampler (processor, penalties, top-k/p,
min-p, temperature, one seeded draw) on each verify row, conditioned on the committed
prefix, in the plain loop's order: accept while the sampled token equals the draft; at
the first mismatch the sampled token IS the correction; when every draft token is
accepted the last row gives a bonus token. Token ids are compared, never
probabilities. Each row goes through the very `ReplyDecoder.step` the plain loop uses,
so stop ids, stop strings, the token budget and the context limit end the row walk
exactly where the plain run would stop, and the sampler makes exactly one draw per
committed token (greedy makes none). Given verify rows bitwise equal to single steps,
the stream equals the plain run's: the batched verify runs only where `rows_invariant`
says the kernels give that (the native batch-invariant route, the default); elsewhere
it verifies row by row. `pin_rows=True` always verifies row by row (exact on any
kernels, no speedup: the reference the tests compare against).

State between steps: the last sampled token, and the span a grammar forced after it,
are "carried" (in history, not yet in the cache). A step forwards [carried..., draft...]
in one `forward_step_all_logits`, walks the rows, and `cache.truncate` drops the rows
of rejected drafts; on any error the cache is rewound to its length before the step.
Grammar-aware drafting: a draft is cut at its first token the grammar state forbids,
and after each accepted token the forced span is committed without a draw (as the plain
loop does) and accepted against the draft while the draft spells it.
At the end of a reply len(history) == cache.len, as after the plain loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Generator, Sequence

import torch

from fucina.errors import FucinaError
from fucina.kernels import first_max_rows
from fucina.text.generate import Reply, ReplyDecoder
from fucina.text.speculative.gate import MTP_BUCKET, CostGate, match_bucket, shared_costs
from fucina.text.speculative.source import DraftSource


@dataclass
class Stats:
    steps: int = 0            # forward passes (verify or plain)
    spec_steps: int = 0       # verify passes with a draft
    fallback_steps: int = 0   # plain steps: the draft was shorter than min_draft
    disabled_steps: int = 0   # plain steps: the cost gate had speculation off
    drafted: int = 0
    accepted: int = 0
    rejected_steps: int = 0   # verify passes that ended on a correction
    bonus: int = 0
    committed: int = 0
    by_draft: dict[int, int] = field(default_factory=dict)   # verify passes by draft length
    pos_drafted: list[int] = field(default_factory=list)    # draft tokens at each draft position
    pos_accepted: list[int] = field(default_factory=list)   # ... of them accepted

    def priced_speedup(self, cost) -> float:
        """Committed tokens per plain-step-equivalent, each verify pass of k draft tokens
        priced at cost(k) plain steps (a measured table): the speedup these decisions
        give on kernels with those costs, free of a noisy clock."""
        plain = self.steps - self.spec_steps
        total = plain + sum(n * cost(k) for k, n in self.by_draft.items())
        return self.committed / total if total else 0.0

    def tokens_per_step(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["tokens_per_step"] = round(self.tokens_per_step(), 4)
        d["acceptance_rate"] = round(self.acceptance_rate(), 4)
        return d

    def summary(self) -> str:
        return (f"speculative: {self.committed} tokens in {self.steps} steps "
                f"({self.tokens_per_step():.2f} tokens/step), drafted {self.drafted}, "
                f"accepted {self.accepted} ({self.acceptance_rate():.0%}), bonus {self.bonus}, "
                f"verify {self.spec_steps}, plain {self.fallback_steps + self.disabled_steps} "
                f"({self.disabled_steps} gated off)")


def pass_clock():
    """The clock verify passes are timed with (the cost gate's ratios): the calling
    thread's CPU time where the kernels run on it alone (a shared box's waits for a core
    are left out: the wall clock there said a 2-row pass cost 1.02 steps, and 1-token
    drafts at ~10% acceptance looked free), else the wall clock."""
    from fucina import kernels
    return time.thread_time if kernels.get_threads() == 1 else time.perf_counter


def rows_invariant(model, cache) -> bool:
    """Whether an m-row step of `model` on `cache` gives each row the bits of a single step:
    the native step serves this cache (not the torch blocks, not a q8_0 cache) and the
    kernels run their batch-invariant route."""
    from fucina import kernels
    native = getattr(model, "_native_cache", None)
    return kernels.batch_invariant() and native is not None and native(cache) is not None


@dataclass
class Verify:
    """A verify pass the decoder asks for: append `tokens` at `pos0` (the cache's length)
    and give their logits `rows` [len(tokens), n_vocab], row i after tokens[:i + 1];
    `seconds` (optional) is the pass's time, for the cost gate."""
    tokens: list[int]
    pos0: int
    rows: torch.Tensor | None = None
    seconds: float | None = None


class SpeculativeDecoder:
    def __init__(self, source: DraftSource, *, max_draft: int = 16, min_draft: int = 2,
                 topk_feedback: int = 1, gate: CostGate | None = None, pin_rows: bool = False,
                 enabled: bool = True):
        if max_draft < 0 or min_draft < 1:
            raise FucinaError(f"speculation needs max_draft >= 0 and min_draft >= 1 "
                              f"(got {max_draft}, {min_draft})")
        if source.wants_topk and topk_feedback <= 0:
            raise FucinaError("this draft source consumes top-k feedback: topk_feedback must be > 0")
        self.source, self.max_draft, self.min_draft = source, max_draft, min_draft
        self.topk_feedback, self.pin_rows, self.enabled = topk_feedback, pin_rows, enabled
        self.gate = gate if gate is not None else CostGate(max_draft=max_draft, min_draft=min_draft)
        self.strong_match = 8   # a match this long re-probes a gated-off decoder at once
        self.shared_rows = 0    # rows other streams put in this step's pass (set by the server)
        self._bucket = 0        # match_bucket of the pending draft's evidence
        self.clock = time.perf_counter   # pass_clock() from each reply's start
        self.stats = Stats()

    # -- one reply -------------------------------------------------------------------

    def drive(self, model, rd: ReplyDecoder, logits: torch.Tensor) -> Generator[str, None, Reply]:
        """The speculative counterpart of `generate.drive`: same ReplyDecoder, same
        pieces, same Reply, same final cache/history state. A grammar's forced spans
        (`rd.forced()`) are committed without a draw where the plain loop commits them,
        and a draft that spells them out is accepted through them."""
        steps = self.steps(model, rd, logits)
        try:
            while True:
                item = next(steps)
                if isinstance(item, Verify):
                    self.run_verify(model, rd.cache, item)
                else:
                    yield item
        except StopIteration as done:
            return done.value
        finally:
            steps.close()

    def steps(self, model, rd: ReplyDecoder, logits: torch.Tensor) -> Generator[str | Verify, None, Reply]:
        """`drive` with the verify passes left to the caller: yields text pieces and
        `Verify` requests; the caller fills a request's `rows` (its own pass, or rows of a
        shared batch pass that are bitwise the single steps) before the next `next()`."""
        self.source.bind(model, rd.cache)
        self.source.sync(rd.history)
        self.clock = pass_clock()
        self.gate.bind(shared_costs(model))
        try:
            tok, piece = rd.step(logits)
            if piece:
                yield piece
            if tok is not None:
                committed, ended = yield from self._forced(rd, [tok])
                self.stats.committed += len(committed)
                self._observe(committed)
                live = not ended
                while live:
                    live = yield from self._step(model, rd)
                self._cache_the_rest(model, rd)
        finally:
            rd.close()
        return rd.reply

    def run_verify(self, model, cache, req: "Verify") -> None:
        """Fill `req` with this stream's own verify pass (timed)."""
        t0 = self.clock()
        req.rows = self._verify(model, cache, req.tokens, req.pos0)
        req.seconds = self.clock() - t0

    @staticmethod
    def _forced(rd: ReplyDecoder, committed: list[int]):
        """After a sampled token: commit the span the grammar forces (no draw), as the
        plain loop does. Returns (committed, whether the reply ended inside the span)."""
        for f in rd.forced():
            ftok, piece = rd.accept(f)
            if piece:
                yield piece
            if ftok is None:
                return committed, True
            committed.append(ftok)
        return committed, rd.done

    @staticmethod
    def _cache_the_rest(model, rd: ReplyDecoder) -> None:
        # a reply that ended inside a forced span: the plain loop forwarded the span's
        # committed tokens, so the cache holds every committed token there too
        rest = rd.history[rd.cache.len:]
        if rest:
            model.forward_step(rd.cache, rest, rd.cache.len)

    def _step(self, model, rd: ReplyDecoder):
        """One verify (or plain) pass from the carried tokens (committed, not yet cached:
        the last sampled token and the span forced after it); False when the reply ended."""
        cache, history = rd.cache, rd.history
        base = cache.len
        carried = [int(t) for t in history[base:]]
        if not carried:
            raise FucinaError(f"speculative decode state broken: {len(history)} committed tokens, "
                              f"{base} cached (expected a carried token)")
        draft = self._draft(rd, model.config.n_vocab, len(carried))
        inputs, c = carried + draft, len(carried)
        req = Verify(inputs, base)
        try:
            yield req
            if req.rows is None or req.rows.shape[0] != len(inputs) or cache.len != base + len(inputs):
                raise FucinaError(f"speculative verify: {len(inputs)} rows asked at {base}, "
                                  f"{None if req.rows is None else req.rows.shape[0]} given, "
                                  f"the cache at {cache.len}")
        except BaseException:
            cache.truncate(base)
            raise
        rows = req.rows
        if c == 1 and req.seconds is not None:     # the gate's costs are of 1 + k rows
            self.gate.record(len(draft), req.seconds)
        committed: list[int] = []
        n_acc, ended, bonus = 0, False, False
        try:
            while True:
                # sample at the row after the last input that was committed
                tok, piece = rd.step(rows[c + n_acc - 1])
                if piece:
                    yield piece
                if tok is None:
                    ended = True
                    break
                bonus = n_acc == len(draft) and bool(draft)
                span, ended = yield from self._forced(rd, [tok])
                committed += span
                follows = True
                for t in span:
                    if follows and n_acc < len(draft) and t == draft[n_acc]:
                        n_acc += 1
                    else:
                        follows = False
                if ended or not follows:
                    break
        finally:
            # keep the rows whose input was committed: the carried tokens and accepted drafts
            cache.truncate(base + c + n_acc)
        if draft and self.source.wants_topk:     # verify passes only: a plain step stays plain
            self._feedback(inputs[:c + n_acc], rows[:c + n_acc])
        self._account(draft, committed, n_acc, bonus)
        return not ended

    def _draft(self, rd: ReplyDecoder, n_vocab: int, n_carried: int = 1) -> list[int]:
        s, history, cache = self.stats, rd.history, rd.cache
        s.steps += 1
        if not self.enabled:
            s.fallback_steps += 1
            return []
        if not self.gate.active():     # checked first: a gated-off step stays cheap
            s.disabled_steps += 1
            self.gate.tick(self.source.match_len() >= self.strong_match)
            return []
        bucket = self.source.bucket()
        self._bucket = match_bucket(self.source.match_len()) if bucket is None else bucket
        self.gate.set_draft_cost(self._draft_steps())
        limit = min(cache.capacity - cache.len - n_carried, rd.max_tokens - len(rd.reply.tokens) - 1)
        room = min(self.max_draft, self.gate.budget(self.shared_rows, self._bucket), limit)
        if room < self.min_draft and bucket == MTP_BUCKET:
            # the head does not pay here now: the other sources draft this step (else a weak
            # head, never drafting, would never be muted and would hold every short match back)
            self._bucket = match_bucket(self.source.match_len())
            self.source.pass_over_model()
            room = min(self.max_draft, self.gate.budget(self.shared_rows, self._bucket), limit)
        if room < self.min_draft:
            s.fallback_steps += 1
            return []
        draft = [int(t) for t in self.source.suggest(history, room)][:room]   # clamp a liar
        if len(draft) >= self.min_draft:   # the cache's own limits walk every layer: only for a draft
            reach = min(cache.rewind_reach(),  # a recurrent state rewinds only within its snapshots
                        cache.step_limit()) - n_carried   # one pass's rows (a window memory's slack)
            if len(draft) > reach:
                draft = draft[:max(0, reach)]
                self.source.truncate_pending(len(draft))
        draft = self._shape(rd, draft)
        if any(not 0 <= t < n_vocab for t in draft):
            draft = []
        if len(draft) < self.min_draft:
            self.source.truncate_pending(0)
            s.fallback_steps += 1
            return []
        s.spec_steps += 1
        s.drafted += len(draft)
        s.by_draft[len(draft)] = s.by_draft.get(len(draft), 0) + 1
        return draft

    def _draft_steps(self) -> float:
        """The source's own cost of a drafted token in plain steps (the MTP head's
        passes; a prior of 0.1 step until plain steps are timed)."""
        seconds = self.source.draft_seconds()
        if not seconds:
            return 0.0
        plain = self.gate.costs.plain_time
        return seconds / plain if plain else 0.1

    def _shape(self, rd: ReplyDecoder, draft: list[int]) -> list[int]:
        """A logit processor with structure (a grammar) cuts a draft at its first
        token the state forbids: that row would reject it anyway."""
        proc = rd.sampler.processor
        if draft and proc is not None and proc.has_structure():
            n = proc.valid_prefix_len(draft)
            if n is not None and n < len(draft):
                draft = draft[:max(0, n)]
                self.source.truncate_pending(len(draft))
        return draft

    def _verify(self, model, cache, tokens: list[int], pos0: int) -> torch.Tensor:
        """[len(tokens), n_vocab] logits, row i after tokens[:i + 1]."""
        # lossless first: a batched verify only where its rows are the single steps' bits
        if len(tokens) == 1:
            return model.forward_step(cache, tokens, pos0)[None]   # the plain step, call for call
        if self.pin_rows or not rows_invariant(model, cache):
            return torch.stack([model.forward_step(cache, [t], pos0 + i) for i, t in enumerate(tokens)])
        return model.forward_step_all_logits(cache, tokens, pos0)

    def _feedback(self, inputs: list[int], rows: torch.Tensor) -> None:
        """Top-k of the rows whose input was committed (a row after a rejected draft
        token speaks of a context that never happened). k = 1 (the default) is each
        row's first maximum (`kernels.first_max_rows`): the recycling chain drafts from a
        row's first slot only, which a top-1 feed fills as a top-8 one does, at a few us a
        row where torch.topk took ~70 (SmolLM2's 49k vocabulary; a 1-token draft's
        feedback was ~3% of a step)."""
        k = min(self.topk_feedback, rows.shape[-1])
        if k == 1:
            self.source.observe_topk(inputs, [[t] for t in first_max_rows(rows)])
            return
        self.source.observe_topk(inputs, torch.topk(rows.float(), k, dim=-1).indices.tolist())

    def _account(self, draft: list[int], committed: list[int], n_acc: int, bonus: bool) -> None:
        s = self.stats
        s.committed += len(committed)
        if draft:
            s.accepted += n_acc
            grow = len(draft) - len(s.pos_drafted)
            if grow > 0:
                s.pos_drafted += [0] * grow
                s.pos_accepted += [0] * grow
            for j in range(len(draft)):
                s.pos_drafted[j] += 1
                s.pos_accepted[j] += j < n_acc
            if bonus:
                s.bonus += 1
            elif n_acc < len(committed):
                s.rejected_steps += 1
            self.gate.settle(len(draft), n_acc, len(committed), self._bucket)
        self._observe(committed)

    def _observe(self, committed: Sequence[int]) -> None:
        if committed:
            self.source.observe(committed)
