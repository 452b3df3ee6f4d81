"""StreamDecoder: token ids in, complete UTF-8 text out, one token at a time.

A token can end inside a multi-byte character (byte-fallback tokens always do); the
decoder holds such a tail until a later token completes it. What it emits, joined,
equals `Tokenizer.decode` of the same ids with the same `skip_special` (decode's
optional `clean_spaces` rewrite is not available here).
"""
from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fucina.text.tokenizer.core import Tokenizer


class StreamDecoder:
    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tok = tokenizer
        self.skip_special = skip_special
        self.reset()

    def reset(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True
        self._strip_space = self.tok.add_space_prefix
        self._held_eos = False

    def push(self, token_id: int) -> str:
        """Feed one token; return the text it completes (possibly "")."""
        tok = self.tok
        out = ""
        if self._held_eos:                      # an EOS followed by more tokens is not the last
            self._held_eos = False
            out = self._feed(tok.token_to_piece(tok.eos_id, special=not self.skip_special))
        if self.skip_special:
            if self._first and tok.add_bos and token_id == tok.bos_id:
                self._first = False
                self._strip_space = False
                return out
            if tok.add_eos and token_id == tok.eos_id:
                self._held_eos = True
                return out
        return out + self._feed(tok.token_to_piece(token_id, special=not self.skip_special))

    def _feed(self, piece: bytes) -> str:
        if self._first:
            self._first = False
            if self._strip_space and piece[:1] == b" ":
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Emit whatever is held (an incomplete character becomes U+FFFD) and reset."""
        text = self._utf8.decode(b"", final=True)
        self.reset()
        return text
