"""SamIndex: an online suffix automaton over a token stream, the exact-match drafter.

After each append the automaton's `last` state is the whole stream and its suffix link
is the longest suffix that also ends EARLIER: its length is the self-excluded match
length, and drafting copies what followed its most recent earlier occurrence. Each
state remembers the latest end position it was seen at (refreshed along the suffix
path, at most `refresh_depth` states per append, so the cost stays O(1); a deeper state
keeps an older occurrence, which is still a true one: stale, never wrong).

Frozen mode serves reference documents: `freeze()` ends appends, and each conversation
walks the document with its own `Cursor` (the longest suffix of the conversation that
occurs in the document). A failed append poisons the index: every query answers 0
from then on, because a half-applied extension must never serve drafts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from fucina.errors import FucinaError


class SpeculationError(FucinaError):
    """Misuse of the speculative layer (appending to a frozen index, a bad option)."""


@dataclass
class Cursor:
    state: int = 0
    len: int = 0


class SamIndex:
    max_stream_len = 1 << 29
    refresh_depth = 32    # suffix-path states whose latest occurrence each append refreshes

    def __init__(self, min_match: int = 2, max_draft: int = 16):
        self.min_match, self.max_draft = min_match, max_draft
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.latest: list[int] = [-1]   # an end position (index of the last token) of the state
        self.last = 0
        self.frozen = False
        self.poisoned = False
        self._prior_end = -1            # where the current match's latest earlier occurrence ends

    # -- building ------------------------------------------------------------------

    def append(self, new_tokens: Iterable[int]) -> None:
        if self.frozen:
            raise SpeculationError("append to a frozen SamIndex")
        if self.poisoned:
            raise SpeculationError("append to a poisoned SamIndex (an earlier append failed)")
        try:
            for t in new_tokens:
                self._extend(int(t))
        except BaseException:
            self.poisoned = True
            raise

    def _extend(self, c: int) -> None:
        i = len(self.tokens)
        if i >= self.max_stream_len:
            raise SpeculationError(f"SamIndex holds at most {self.max_stream_len} tokens")
        nxt, link, length, latest = self.next, self.link, self.length, self.latest
        cur = len(length)
        nxt.append({})
        length.append(length[self.last] + 1)
        link.append(0)
        latest.append(i)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                length.append(length[p] + 1)
                link.append(link[q])
                latest.append(latest[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.tokens.append(c)
        self.last = cur
        s = link[cur]
        self._prior_end = latest[s] if s > 0 else -1
        for _ in range(self.refresh_depth):
            if s <= 0:
                break
            latest[s] = i
            s = link[s]

    def freeze(self) -> None:
        self.frozen = True

    # -- the conversation query -----------------------------------------------------

    def match_len(self) -> int:
        """Length of the longest suffix of the stream that also ends earlier."""
        if self.poisoned or not self.tokens:
            return 0
        return self.length[self.link[self.last]]

    def draft(self, n: int | None = None, periodic: bool = False, min_match: int | None = None) -> list[int]:
        """The tokens that followed the match's latest earlier occurrence (at most n).
        `periodic`: where they run out at the stream's end, continue into the draft
        itself, LZ77-style (a loop of period p drafts n tokens, not just p).
        `min_match`: the least match that drafts (default: the index's)."""
        n = self.max_draft if n is None else n
        if self.match_len() < (self.min_match if min_match is None else min_match) or self._prior_end < 0:
            return []
        start = self._prior_end + 1
        out = self.tokens[start:start + n]
        period = len(self.tokens) - start
        while periodic and len(out) < n:
            out.append(out[len(out) - period])
        return out

    # -- frozen documents -----------------------------------------------------------

    def advance(self, cursor: Cursor, token: int) -> None:
        """Extend the cursor's match by one conversation token (falling back along
        suffix links when the document cannot continue it)."""
        if self.poisoned:
            cursor.state = cursor.len = 0
            return
        s, n = cursor.state, cursor.len
        while s > 0 and token not in self.next[s]:
            s = self.link[s]
            n = self.length[s]
        if token in self.next[s]:
            cursor.state, cursor.len = self.next[s][token], n + 1
        else:
            cursor.state, cursor.len = 0, 0

    def draft_from(self, cursor: Cursor, n: int | None = None, min_match: int | None = None) -> list[int]:
        n = self.max_draft if n is None else n
        if self.poisoned or cursor.len < (self.min_match if min_match is None else min_match):
            return []
        start = self.latest[cursor.state] + 1
        return self.tokens[start:start + n]

    # -- sizes ------------------------------------------------------------------------

    def token_count(self) -> int:
        return len(self.tokens)

    def state_count(self) -> int:
        return len(self.length)

    def transition_count(self) -> int:
        return sum(len(d) for d in self.next)


def frozen_index(tokens: Sequence[int], min_match: int = 2) -> SamIndex:
    sam = SamIndex(min_match=min_match)
    sam.append(tokens)
    sam.freeze()
    return sam
