"""SpeculationIndex: the cascade behind one DraftSource.

(1) an online SamIndex over every committed token of the conversation, (2) frozen
SamIndex reference documents (the RAG seam: a prediction, a file to edit, retrieved
text), (3) the token-recycling table as the fallback and the consumer of verification
top-k; with a multi-token-prediction head attached to the model (models/mtp.py), (4) the
head's chained drafts wherever no exact match of MTP_DEFERS_TO tokens exists (the
recycling chain then only where the head is muted). The source with the longest current match drafts (ties go to the conversation,
then to the first-added reference), with a budget of min(n, beta * (1 + match)); a match
shorter than min_match falls back to the recycling top-1 chain.

Each source keeps a rolling acceptance gate over its last GATE_WINDOW verified draft
tokens (judged from GATE_DECIDE_AFTER on), settled at the suggest -> observe seam
(longest common prefix of the draft and what was committed next). Below
`mute_acceptance` a source is muted for `mute_commits` committed tokens, then
re-probed; a muted source keeps observing so it stays in sync.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from fucina.text.generate import common_prefix
from fucina.text.speculative.gate import MTP_BUCKET, match_bucket
from fucina.text.speculative.mtp import MTPDrafter
from fucina.text.speculative.recycling import TokenRecycling
from fucina.text.speculative.sam import Cursor, SamIndex, frozen_index
from fucina.text.speculative.source import DraftSource

GATE_WINDOW = 64
GATE_DECIDE_AFTER = 16
RECYCLING_IDLE = 64   # committed tokens without a recycling draft before its top-k feed pauses
ANCHORED_MATCH = 16   # the evidence an aligned anchored document (a prediction) counts as
# the recycling chain is judged from this many drafted tokens: its drafts are one or two
# tokens at ~10% on SmolLM2, and 16 of them were ~10 losing verify passes a story
RECYCLING_DECIDE_AFTER = 4
MTP_DEFERS_TO = 2     # an exact match this long drafts instead of the MTP head (min_match: every one)


class Gate:
    """Rolling acceptance of one source over its last `window` drafted tokens; muted for
    a while when it stops paying, judged from `decide_after` drafted tokens on (a source
    drafting at ~10% costs more verify rows than it saves, and a 160-token reply cannot
    wait a 64-token window for the verdict)."""

    def __init__(self, mute_acceptance: float, mute_commits: int, window: int = GATE_WINDOW,
                 decide_after: int = GATE_DECIDE_AFTER):
        self.mute_acceptance, self.mute_commits = mute_acceptance, mute_commits
        self.window, self.decide_after = window, decide_after
        self.outcomes: deque[tuple[int, int]] = deque()   # (drafted, accepted) per draft
        self.drafted = self.accepted = 0
        self.muted_for = 0
        self.total_drafted = self.total_accepted = 0

    def muted(self) -> bool:
        return self.muted_for > 0

    def settle(self, drafted: int, accepted: int) -> None:
        self.outcomes.append((drafted, accepted))
        self.drafted += drafted
        self.accepted += accepted
        self.total_drafted += drafted
        self.total_accepted += accepted
        while self.drafted - self.outcomes[0][0] >= self.window:
            d, a = self.outcomes.popleft()
            self.drafted -= d
            self.accepted -= a
        if self.drafted >= self.decide_after and self.accepted < self.mute_acceptance * self.drafted:
            self.muted_for = self.mute_commits
            self.outcomes.clear()
            self.drafted = self.accepted = 0

    def tick(self, committed: int) -> None:
        if self.muted_for:
            self.muted_for = max(0, self.muted_for - committed)

    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class FrozenRef:
    def __init__(self, index: SamIndex, gate: Gate, anchored: bool = False):
        self.index, self.gate, self.anchored = index, gate, anchored
        self.cursor = Cursor()
        self.anchor: int | None = None    # anchored: where the reply so far ends in the document


class SpeculationIndex(DraftSource):
    @property
    def wants_topk(self) -> bool:
        """Top-k feedback feeds only the recycling table; while it is muted, or has not
        drafted for RECYCLING_IDLE committed tokens (the exact matches serve), the verify
        rows' top-k is skipped: ~0.2 ms a row on a 262k vocabulary, a few % of a step.
        Its committed bigrams are still promoted."""
        return self.recycling is not None and not self.rec_gate.muted() and self._rec_idle < RECYCLING_IDLE

    def __init__(self, n_vocab: int, *, beta: int = 2, min_match: int = 2, recycling_chain: int = 8,
                 mute_acceptance: float = 0.20, mute_commits: int = 128, accounting_min_draft: int = 2,
                 recycling: bool = True, short_matches: bool = False):
        self.beta, self.min_match, self.recycling_chain = beta, min_match, recycling_chain
        self.mute_acceptance, self.mute_commits = mute_acceptance, mute_commits
        self.accounting_min_draft = accounting_min_draft
        self.conv = SamIndex(min_match=min_match)
        self.conv_gate = self._gate()
        self.refs: list[FrozenRef] = []
        self.recycling = TokenRecycling(n_vocab) if recycling else None
        self.rec_gate = Gate(mute_acceptance, mute_commits, decide_after=RECYCLING_DECIDE_AFTER)
        self.short_matches = short_matches
        self.short_gate = Gate(mute_acceptance, mute_commits, decide_after=RECYCLING_DECIDE_AFTER)
        self._rec_idle = 0     # committed tokens since the recycling table last drafted
        self._pending: tuple[Gate, list[int]] | None = None
        self.mtp: MTPDrafter | None = None      # set by bind() when the model has a head
        self.mtp_gate = Gate(mute_acceptance, mute_commits, decide_after=RECYCLING_DECIDE_AFTER)
        self._pass_head = False    # this step's draft is not the head's (its bucket does not pay)

    def _gate(self) -> Gate:
        return Gate(self.mute_acceptance, self.mute_commits)

    # -- references -------------------------------------------------------------------

    def add_reference(self, tokens: Sequence[int], anchored: bool = False) -> None:
        """Index a document the reply may copy from; its cursor is caught up over the
        stream observed so far, so it can match at once. `anchored`: the document is
        the expected reply itself (a Predicted Output): while the reply follows it, it
        drafts from where the reply has got to."""
        if not tokens:
            return
        ref = FrozenRef(frozen_index([int(t) for t in tokens], self.min_match), self._gate(), anchored)
        for t in self.conv.tokens[-4096:]:
            ref.index.advance(ref.cursor, t)
        self.refs.append(ref)

    def clear_references(self) -> None:
        self.refs.clear()

    # -- DraftSource ------------------------------------------------------------------

    def suggest(self, context: Sequence[int], n: int) -> list[int]:
        self._pending = None
        if n <= 0:
            return []
        best_len, best = 0, None
        if not self.conv_gate.muted():
            best_len, best = self.conv.match_len(), None
        for ref in self.refs:
            if ref.anchor is not None and ref.anchor < ref.index.token_count() and not ref.gate.muted():
                self._pending = (ref.gate, ref.index.tokens[ref.anchor:ref.anchor + n])
                return list(self._pending[1])
            if not ref.gate.muted() and ref.cursor.len > best_len:
                best_len, best = ref.cursor.len, ref
        draft: list[int] = []
        gate = None
        # a one-token match (off by default): what followed the token's latest earlier
        # occurrence (the prompt's next word after a word the reply shares with it), on its
        # own gate. One thread, 10 pairs, SmolLM2 edit 1.04x / copy 1.02x with it; two
        # threads, 5 pairs, grounded summary 0.94x (its one-token drafts took passes the long
        # matches would have drafted further: 2.39 -> 2.29 tokens a step)
        short = best_len == 1 < self.min_match and self.short_matches and not self.short_gate.muted()
        drafts_head = self._mtp_drafts(best_len)
        self._pass_head = False
        if drafts_head:
            draft = self.mtp.suggest(context, n)
            if draft:
                self._pending = (self.mtp_gate, draft)
            return draft
        if best_len >= self.min_match or short:
            budget = min(n, self.beta * (1 + best_len))
            if best is None:
                draft, gate = self.conv.draft(budget, periodic=not short, min_match=best_len), self.conv_gate
            else:
                draft, gate = best.index.draft_from(best.cursor, budget, min_match=best_len), best.gate
            if short:
                gate = self.short_gate
        if not draft and self.recycling is not None and not self.rec_gate.muted() and context:
            draft = self.recycling.draft_chain(context[-1], min(n, self.recycling_chain))
            gate, self._rec_idle = self.rec_gate, 0
        if draft:
            self._pending = (gate, draft)
        return draft

    def _mtp_drafts(self, best_len: int) -> bool:
        return (self.mtp is not None and best_len < MTP_DEFERS_TO and not self.mtp_gate.muted()
                and not self._pass_head and self.mtp.usable())

    def pass_over_model(self) -> None:
        self._pass_head = True

    def bind(self, model, cache) -> None:
        head = getattr(model, "mtp", None)
        if head is None:
            self.mtp = None
            return
        if self.mtp is None or self.mtp.head is not head:
            self.mtp = MTPDrafter(head)
        self.mtp.bind(cache)

    def _best_exact(self) -> int:
        best = 0 if self.conv_gate.muted() else self.conv.match_len()
        for r in self.refs:
            if not r.gate.muted():
                if r.anchor is not None and r.anchor < r.index.token_count():
                    return ANCHORED_MATCH
                best = max(best, r.cursor.len)
        return best

    def bucket(self) -> int | None:
        """The MTP head's own bucket when it would draft next, else by the match."""
        best = self._best_exact()
        return MTP_BUCKET if self._mtp_drafts(best) else match_bucket(best)

    def draft_seconds(self) -> float:
        if self.mtp is not None and self._mtp_drafts(self._best_exact()):
            return self.mtp.seconds_per_token or 0.0
        return 0.0

    def match_len(self) -> int:
        """The longest exact match a draft would follow; an anchored document the reply
        is following counts as a long one (its draft is the reply to come)."""
        best = 0 if self.conv_gate.muted() else self.conv.match_len()
        for r in self.refs:
            if not r.gate.muted():
                aligned = r.anchor is not None and r.anchor < r.index.token_count()
                best = max(best, ANCHORED_MATCH if aligned else r.cursor.len)
        return best

    def truncate_pending(self, new_len: int) -> None:
        if self._pending is not None:
            gate, draft = self._pending
            self._pending = (gate, draft[:new_len]) if new_len > 0 else None

    def observe(self, committed: Sequence[int]) -> None:
        self._pass_head = False
        committed = [int(t) for t in committed]
        if not committed:
            return
        if self._pending is not None:
            gate, draft = self._pending
            self._pending = None
            if len(draft) >= self.accounting_min_draft:
                gate.settle(len(draft), common_prefix(draft, committed))
        self._append(committed)

    def observe_topk(self, tokens: Sequence[int], topk: Sequence[Sequence[int]]) -> None:
        if self.recycling is not None:
            self.recycling.observe_topk(tokens, topk)

    def sync(self, history: Sequence[int]) -> None:
        """Mirror `history`: append what is new, or rebuild when history was rewound or
        edited (a suffix automaton cannot forget)."""
        self._pending = None
        seen = self.conv.tokens
        if self.conv.poisoned or len(seen) > len(history) or common_prefix(seen, history) != len(seen):
            self.conv = SamIndex(min_match=self.min_match)
            for ref in self.refs:
                ref.cursor = Cursor()
            seen = self.conv.tokens
            if self.recycling is not None:
                self.recycling.sync(history[:0])
        self._append([int(t) for t in history[len(seen):]])
        for ref in self.refs:     # after the catch-up: an anchored document is the reply to come
            ref.anchor = 0 if ref.anchored else None
        if self.mtp is not None:
            self.mtp.sync(history)

    def _append(self, tokens: list[int]) -> None:
        if not tokens:
            return
        if not self.conv.poisoned:
            try:
                self.conv.append(tokens)
            except Exception:
                pass    # degraded: the poisoned index answers 0 from now on
        n = len(tokens)
        for ref in self.refs:
            doc = ref.index.tokens
            for t in tokens:
                ref.index.advance(ref.cursor, t)
                if ref.anchor is not None:
                    ref.anchor = ref.anchor + 1 if ref.anchor < len(doc) and doc[ref.anchor] == t else None
            ref.gate.tick(n)
        if self.recycling is not None:
            self.recycling.observe(tokens)
            self._rec_idle += n
        self.conv_gate.tick(n)
        self.rec_gate.tick(n)
        self.short_gate.tick(n)
        self.mtp_gate.tick(n)

    def source_summary(self) -> str:
        def one(name, g):
            rate = g.total_accepted / g.total_drafted if g.total_drafted else 0.0
            return f"{name} {g.total_accepted}/{g.total_drafted} ({rate:.0%}){' muted' if g.muted() else ''}"
        parts = [one("conversation", self.conv_gate), one("one-token matches", self.short_gate),
                 one("recycling", self.rec_gate)]
        if self.mtp is not None:
            parts.append(one("mtp head", self.mtp_gate))
        parts += [one(f"ref{i}", r.gate) for i, r in enumerate(self.refs)]
        return ", ".join(parts)
