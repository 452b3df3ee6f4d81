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
the stream equals the plain run's; whether the kernels give that is
`fucina.text.speculative.verify_is_exact()` (until then: same distribution, near-ties
may flip). `pin_rows=True` verifies row by row: exact on any kernels, no speedup (the
reference the tests compare against).

State between steps: the last committed token is "carried" (in history, not yet in
the cache): len(history) == cache.len + 1. A step forwards [carried, draft...] in one
`forward_step_all_logits`, walks the rows, and `cache.truncate` drops the rows of
rejected drafts; on any error the cache is rewound to its length before the step.
At the end of a reply len(history) == cache.len, as after the plain loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Sequence

import torch

from fucina.errors import FucinaError
from fucina.text.generate import Reply, ReplyDecoder, drive
from fucina.text.speculative.gate import CostGate
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


def rows_invariant(model, cache) -> bool:
    """Whether an m-row step of `model` on `cache` gives each row the bits of a single step:
    the native step serves this cache (not the torch blocks, not a q8_0 cache) and the
    kernels run their batch-invariant route."""
    from fucina import kernels
    native = getattr(model, "_native_cache", None)
    return kernels.batch_invariant() and native is not None and native(cache) is not None


class SpeculativeDecoder:
    def __init__(self, source: DraftSource, *, max_draft: int = 16, min_draft: int = 2,
                 topk_feedback: int = 8, gate: CostGate | None = None, pin_rows: bool = False,
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
        self.stats = Stats()

    # -- one reply -------------------------------------------------------------------

    def drive(self, model, rd: ReplyDecoder, logits: torch.Tensor) -> Generator[str, None, Reply]:
        """The speculative counterpart of `generate.drive`: same ReplyDecoder, same
        pieces, same Reply, same final cache/history state. A grammar that fast-forwards
        forced spans (`rd.forced()`) keeps the plain loop: grammar-aware drafting is not
        built yet, and the plain loop commits forced tokens without a draw."""
        if getattr(rd.sampler.processor, "fast_forward", None) is not None:
            return (yield from drive(model, rd, logits))
        self.source.sync(rd.history)
        try:
            tok, piece = rd.step(logits)
            if piece:
                yield piece
            if tok is not None:
                self.stats.committed += 1
                self._observe([tok])
            while tok is not None:
                tok = yield from self._step(model, rd)
        finally:
            rd.close()
        return rd.reply

    def _step(self, model, rd: ReplyDecoder):
        """One verify (or plain) pass from the carried token; returns the new carried
        token, or None when the reply ended (the cache then holds every committed token)."""
        cache, history = rd.cache, rd.history
        base = cache.len
        if len(history) != base + 1:
            raise FucinaError(f"speculative decode state broken: {len(history)} committed tokens, "
                              f"{base} cached (expected one carried token)")
        draft = self._draft(rd, model.config.n_vocab)
        t0 = time.perf_counter()
        try:
            rows = self._verify(model, cache, [history[-1]] + draft, base)
        except BaseException:
            cache.truncate(base)
            raise
        self.gate.record(len(draft), time.perf_counter() - t0)
        if draft and self.source.wants_topk:     # verify passes only: a plain step stays plain
            self._feedback(history[-1], draft, rows)
        committed: list[int] = []
        carried, n_acc = None, 0
        try:
            for i in range(len(rows)):
                tok, piece = rd.step(rows[i])
                if tok is not None:
                    committed.append(tok)
                    if i < len(draft) and tok == draft[i]:
                        n_acc += 1
                    else:
                        carried = tok    # the correction, or the bonus after a full accept
                if piece:
                    yield piece
                if tok is None or carried is not None:
                    break
        finally:
            # keep the rows whose input was committed: the carried token and accepted drafts
            cache.truncate(base + 1 + n_acc)
        self._account(draft, committed, n_acc)
        return carried

    def _draft(self, rd: ReplyDecoder, n_vocab: int) -> list[int]:
        s, history, cache = self.stats, rd.history, rd.cache
        s.steps += 1
        room = min(self.max_draft, self.gate.budget(), cache.capacity - cache.len - 1,
                   rd.max_tokens - len(rd.reply.tokens) - 1,
                   cache.rewind_reach() - 1)   # a recurrent state rewinds only within its snapshots
        if not self.enabled or room < self.min_draft:
            s.fallback_steps += 1
            return []
        if not self.gate.active():
            s.disabled_steps += 1
            self.gate.tick(self.source.match_len() >= self.strong_match)
            return []
        draft = [int(t) for t in self.source.suggest(history, room)][:room]   # clamp a liar
        draft = self._shape(rd, draft)
        if any(not 0 <= t < n_vocab for t in draft):
            draft = []
        if len(draft) < self.min_draft:
            self.source.truncate_pending(0)
            s.fallback_steps += 1
            return []
        s.spec_steps += 1
        s.drafted += len(draft)
        return draft

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

    def _verify(self, model, cache, tokens: list[int], pos0: int) -> list[torch.Tensor]:
        # lossless first: a batched verify only where its rows are the single steps' bits
        if len(tokens) == 1:
            return [model.forward_step(cache, tokens, pos0)]   # the plain step, call for call
        if self.pin_rows or not rows_invariant(model, cache):
            return [model.forward_step(cache, [t], pos0 + i) for i, t in enumerate(tokens)]
        return list(model.forward_step_all_logits(cache, tokens, pos0))

    def _feedback(self, carried: int, draft: list[int], rows: list[torch.Tensor]) -> None:
        k = min(self.topk_feedback, rows[0].shape[-1])
        top = torch.topk(torch.stack(rows).float(), k, dim=-1).indices.tolist()
        self.source.observe_topk([carried] + draft, top)

    def _account(self, draft: list[int], committed: list[int], n_acc: int) -> None:
        s = self.stats
        s.committed += len(committed)
        if draft:
            s.accepted += n_acc
            if len(committed) > len(draft):
                s.bonus += 1
            elif n_acc < len(committed):
                s.rejected_steps += 1
            self.gate.settle(len(draft), n_acc, len(committed))
        self._observe(committed)

    def _observe(self, committed: Sequence[int]) -> None:
        if committed:
            self.source.observe(committed)
