"""Forced tool choice names a declared tool, never an invented one.

With `tool_choice: "required"` (Anthropic `{"type": "any"}`) and several tools, the
reply is primed with `<tool_call>\\n{"name": "` and `DeclaredName` masks the logits so
that what follows spells one of the declared names and the hermes `", "arguments": {`
after it (so the reply parses as a call to that tool however the arguments go on);
then it steps aside (the arguments are the model's, or a grammar's). With
one declared tool the prompt is primed with its name outright (prompt.render_chat).
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch

from fucina.text.logit_processor import LogitProcessor

ARGS_OPEN = '", "arguments": {'     # the arguments are a JSON object (hermes)

_PIECES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _pieces(tokenizer) -> list[bytes]:
    """Every token's text as bytes (control tokens empty), computed once per tokenizer."""
    try:
        return _PIECES[tokenizer]
    except (KeyError, TypeError):
        pass
    n = tokenizer.n_vocab
    out = [tokenizer.token_to_piece(i, special=False) for i in range(n)]
    try:
        _PIECES[tokenizer] = out
    except TypeError:
        pass
    return out


class DeclaredName(LogitProcessor):
    def __init__(self, tokenizer, names: Sequence[str]):
        if not names:
            raise ValueError("DeclaredName needs at least one name")
        self.pieces = _pieces(tokenizer)
        self.targets = [(n + ARGS_OPEN).encode("utf-8") for n in names]
        self.reset()

    def reset(self) -> None:
        self.done = b""
        self.active = True

    def _fits(self, text: bytes) -> bool:
        return any(t.startswith(text) or text.startswith(t) for t in self.targets)

    def process(self, logits: torch.Tensor, history: Sequence[int]) -> None:
        if not self.active:
            return
        done = self.done
        allowed = [i for i, p in enumerate(self.pieces) if p and self._fits(done + p)]
        keep = logits[allowed].clone()
        logits.fill_(float("-inf"))
        logits[allowed] = keep

    def commit(self, token: int) -> None:
        if not self.active:
            return
        self.done += self.pieces[token] if 0 <= token < len(self.pieces) else b""
        if any(self.done.startswith(t) for t in self.targets):
            self.active = False
