"""Lossless draft-free speculative decoding (seed §13.9).

Drafts come from indexes over text the model has already seen (the conversation, the
reference documents a caller hands in, the verify passes' own top-k); a verify pass
scores [carried token, draft...] in one forward, and the full sampler at every row
decides what is committed. `Speculation` is the bundle a front end holds per stream.
"""
from __future__ import annotations

import os
from typing import Sequence

from fucina import kernels
from fucina.text.speculative.cascade import Gate, SpeculationIndex
from fucina.text.speculative.decoder import SpeculativeDecoder, Stats, Verify, rows_invariant
from fucina.text.speculative.gate import DEFAULT_COST_TABLE, CostGate, table_cost
from fucina.text.speculative.recycling import TokenRecycling
from fucina.text.speculative.sam import Cursor, SamIndex, SpeculationError
from fucina.text.speculative.source import DraftSource

__all__ = ["CostGate", "Cursor", "DEFAULT_COST_TABLE", "DraftSource", "Gate", "SamIndex",
           "Speculation", "SpeculationError", "SpeculationIndex", "SpeculativeDecoder", "Stats",
           "TokenRecycling", "Verify", "batch_invariant", "reference_ids", "rows_invariant", "table_cost"]


def reference_ids(tokenizer, ref) -> list[int]:
    """A reference document as ids: text is tokenized without specials (as it would
    appear inside a reply), ids pass through."""
    if isinstance(ref, str):
        return tokenizer.encode(ref, add_special=False, parse_special=False)
    return [int(t) for t in ref]


def batch_invariant() -> bool:
    """Whether the kernels promise that an m-row forward reproduces m single steps
    bitwise (then the speculative stream is the plain stream token for token). False
    until the kernels say otherwise."""
    probe = getattr(kernels, "batch_invariant", None)
    try:
        return bool(probe()) if callable(probe) else False
    except Exception:
        return False


class Speculation:
    """One stream's speculative state: the cascade index and the decoder over it."""

    # True: verify row by row, bitwise the plain steps on any kernels, no speedup (a check;
    # FUCINA_SPEC_EXACT=1 sets it for a process)
    pin_rows_default = os.environ.get("FUCINA_SPEC_EXACT", "0") == "1"

    def __init__(self, n_vocab: int, references: Sequence[Sequence[int]] = (), *, max_draft: int = 16,
                 min_draft: int = 1, pin_rows: bool | None = None, gate: CostGate | None = None):
        pin_rows = self.pin_rows_default if pin_rows is None else pin_rows
        self.index = SpeculationIndex(n_vocab, accounting_min_draft=min_draft)
        for ref in references:
            self.index.add_reference(ref)
        self.decoder = SpeculativeDecoder(self.index, max_draft=max_draft, min_draft=min_draft,
                                          pin_rows=pin_rows, gate=gate)

    @property
    def stats(self) -> Stats:
        return self.decoder.stats

    def add_reference(self, tokens: Sequence[int], anchored: bool = False) -> None:
        self.index.add_reference(tokens, anchored)

    def drive(self, model, rd, logits):
        return self.decoder.drive(model, rd, logits)

    def steps(self, model, rd, logits):
        """`drive` yielding `Verify` requests for the caller's pass (the server's batch)."""
        return self.decoder.steps(model, rd, logits)

    def batchable(self, model, cache) -> bool:
        """Whether this stream's verify rows may ride a shared batch pass: only where the
        kernels make every row the bits of a single step (else it verifies on its own)."""
        return not self.decoder.pin_rows and rows_invariant(model, cache)

    def prediction_counts(self) -> tuple[int, int]:
        """(accepted, rejected) draft tokens that came from the references since they
        were added (OpenAI's accepted/rejected_prediction_tokens)."""
        acc = sum(r.gate.total_accepted for r in self.index.refs)
        return acc, sum(r.gate.total_drafted for r in self.index.refs) - acc

    def summary(self) -> str:
        return f"{self.stats.summary()}\nsources: {self.index.source_summary()}"
