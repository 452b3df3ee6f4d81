"""Gemma 4's tokenizer (`tokenizer.ggml.model = gemma4`): SentencePiece-style BPE, as
llama.cpp b11434 runs it (LLAMA_VOCAB_PRE_TYPE_GEMMA4).

Spaces become U+2581 first; the text is then cut only into runs of newlines and runs of
everything else (no word-level pre-split), and BPE merges run on each run's characters
(raw UTF-8, no byte-to-printable map), lowest merge rank first, leftmost on a tie. A run
of newlines that is itself a token is that token. A merged symbol that is not a token
falls back to its bytes as `<0xXX>` tokens (a byte without one is dropped, as in
llama.cpp). Decoding turns U+2581 back into spaces.
"""
from __future__ import annotations

import re

from fucina.text.tokenizer.bpe import bpe_merge
from fucina.text.tokenizer.vocab import Vocab

SPACE = "\u2581"
_RUNS = re.compile(r"[^\n]+|\n+")


class Gemma4BPE:
    def __init__(self, vocab: Vocab):
        self.token_to_id = vocab.token_to_id
        merges = vocab.merges
        # a pair listed twice keeps its first rank (llama.cpp's emplace)
        self.ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        self.cache: dict[str, tuple[int, ...]] = {}
        self.byte_ids = [self.token_to_id.get(f"<0x{b:02X}>") for b in range(256)]

    def split(self, text: str) -> list[str]:
        return _RUNS.findall(text.replace(" ", SPACE))

    def sequence(self, parts: list, text: str = "") -> list[str | int]:
        """[fragment, id, fragment, ...] -> runs and special ids, in order."""
        seq: list[str | int] = []
        for k, part in enumerate(parts):
            if k & 1:
                seq.append(part)
            elif part:
                seq.extend(self.split(part))
        return seq

    def encode_piece(self, run: str | int) -> tuple[int, ...]:
        if isinstance(run, int):
            return (run,)
        t2i = self.token_to_id
        if run[0] == "\n" or len(run) == 1:
            tid = t2i.get(run)
            if tid is not None:
                return (tid,)
        out: list[int] = []
        for sym in bpe_merge(run, self.ranks):
            tid = t2i.get(sym)
            if tid is not None:
                out.append(tid)
                continue
            for b in sym.encode("utf-8", "surrogatepass"):
                if self.byte_ids[b] is not None:
                    out.append(self.byte_ids[b])
        return tuple(out)
