"""The draft-source contract the decoder drives.

A source proposes continuation tokens for the committed context and is told what was
actually committed. Drafts never decide what is committed (the verify pass does), so a
source can only cost speed, never correctness; it must still be deterministic (a
function of what it has observed), and the decoder clamps one that returns too much.
"""
from __future__ import annotations

from typing import Sequence


class DraftSource:
    """No-op defaults; override what you need."""

    def suggest(self, context: Sequence[int], n: int) -> list[int]:
        """Up to n continuation tokens for `context` (the committed history); [] = none."""
        return []

    def observe(self, committed: Sequence[int]) -> None:
        """Tokens newly committed after `context` (in order, once each)."""

    def observe_topk(self, tokens: Sequence[int], topk: Sequence[Sequence[int]]) -> None:
        """Verification feedback: after input token tokens[r], the model's top-k next
        candidates were topk[r]. Called only when `wants_topk` is True."""

    wants_topk = False

    def match_len(self) -> int:
        """How long an exact match the source's best draft would follow (0: unknown);
        a long one lets a gated-off decoder probe at once."""
        return 0

    def truncate_pending(self, new_len: int) -> None:
        """The draft just returned was cut to its first new_len tokens before verifying."""

    def bind(self, model, cache) -> None:
        """The model and the cache the stream decodes with (each reply's start)."""

    def bucket(self) -> int | None:
        """The gate's evidence bucket for the next draft (None: by `match_len`)."""
        return None

    def pass_over_model(self) -> None:
        """The next draft must not come from a model-based source (its bucket does not pay)."""

    def draft_seconds(self) -> float:
        """Wall time a drafted token costs the source itself (a model-based source's
        forward passes; index lookups: 0), which the cost gate adds to its verify rows."""
        return 0.0

    def sync(self, history: Sequence[int]) -> None:
        """Make the source's view of the stream equal `history` (a reply start: after a
        prefill, a rewind, a new turn). Sources without stream state ignore it."""
