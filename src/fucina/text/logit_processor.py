"""The logit-processor seam: an injectable transform run on the logits row before the
sampler's own pipeline (grammar masks, bias lists, banned tokens, watermarks).

A processor is single-stream state, like the sampler that hosts it:

- `process(logits, history)` mutates one float32 [n_vocab] row in place (a mask writes
  -inf over forbidden tokens);
- `commit(token)` observes the selected token, exactly once per `Sampler.next`, on
  every path (greedy included);
- `reset()` re-arms state for a fresh constrained region (a Conversation calls it at
  every turn start);
- the structural hooks `forced_tokens()` (the unique legal continuation, possibly
  empty) and `valid_prefix_len(tokens)` (how many leading tokens of a candidate the
  state accepts) are pure lookaheads; a processor without a state machine returns
  None from both, and `has_structure()` says whether both are real.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch


class LogitProcessor:
    """Base class with the no-op defaults; subclass and override what you need."""

    def process(self, logits: torch.Tensor, history: Sequence[int]) -> None:
        pass

    def commit(self, token: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def forced_tokens(self) -> list[int] | None:
        return None

    def allows(self, token: int) -> bool | None:
        """For a processor whose `process` only forbids tokens (a mask): whether `token`
        is allowed, so the sampler can test its first choice instead of masking the row.
        None: not a pure mask (the sampler always calls `process`)."""
        return None

    def valid_prefix_len(self, tokens: Sequence[int]) -> int | None:
        return None

    def has_structure(self) -> bool:
        return (type(self).forced_tokens is not LogitProcessor.forced_tokens
                and type(self).valid_prefix_len is not LogitProcessor.valid_prefix_len)


class LogitBias(LogitProcessor):
    """Add a fixed bias per token id (OpenAI `logit_bias`; -inf bans the token)."""

    def __init__(self, bias: Mapping[int, float]):
        self.ids = torch.tensor(list(bias.keys()), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def process(self, logits: torch.Tensor, history: Sequence[int]) -> None:
        if self.ids.numel():
            logits.index_add_(0, self.ids, self.values)


class BanTokens(LogitBias):
    def __init__(self, ids: Iterable[int]):
        super().__init__({int(i): float("-inf") for i in ids})


class ProcessorChain(LogitProcessor):
    """Several processors applied in order; commit/reset reach every one."""

    def __init__(self, processors: Sequence[LogitProcessor]):
        self.processors = list(processors)

    def process(self, logits: torch.Tensor, history: Sequence[int]) -> None:
        for p in self.processors:
            p.process(logits, history)

    def commit(self, token: int) -> None:
        for p in self.processors:
            p.commit(token)

    def reset(self) -> None:
        for p in self.processors:
            p.reset()
