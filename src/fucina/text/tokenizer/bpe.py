"""Byte-level BPE (GPT-2 style), as llama.cpp's llm_tokenizer_bpe_session runs it.

Each pretoken is UTF-8 encoded, every byte mapped to its printable stand-in, and the
adjacent pair with the lowest merge rank merged (leftmost first on a tie) until no
ranked pair is left. A pretoken's ids never depend on its neighbours, so they are
cached by pretoken: on ordinary text nearly every word is a cache hit and encoding
is one regex pass plus dictionary lookups. The words a text adds to the cache merge in
C++ when the `_merge` module is built (`_merge.Bpe`: the same loop over interned symbol
ids), else in Python (`encode_piece_py`).
"""
from __future__ import annotations

from itertools import repeat

from fucina.text.tokenizer import merge as _m
from fucina.text.tokenizer.merge import LIST_MAX, NativePieces, encode_cached, heap_merge
from fucina.text.tokenizer.pretokenize import Splitter
from fucina.text.tokenizer.unicode import BYTE_CHARS, BYTES_TO_UNICODE
from fucina.text.tokenizer.vocab import Vocab

_NONE = 1 << 62   # "no such merge" rank


class ByteBPE:
    def __init__(self, vocab: Vocab, native: bool | None = None):
        """native: merge in C++ (default: when built; see merge.use_native)."""
        assert vocab.pre_spec is not None
        self.token_to_id = vocab.token_to_id
        merges = self.merges = vocab.merges
        self._ranks: dict[str, int] | None = None
        self.ignore_merges = vocab.ignore_merges
        self.splitter = Splitter(vocab.pre_spec.kind)
        self.cache: dict[str, tuple[int, ...]] = {}
        self.encode_piece = self.encode_piece_py
        if _m.use_native(native):
            try:   # a vocabulary native code refuses stays in Python
                nat = _m.native.Bpe(list(BYTE_CHARS), merges, self.token_to_id, vocab.n_vocab,
                                    self.ignore_merges)
            except (TypeError, ValueError):
                pass
            else:
                self.encode_piece = NativePieces(nat, self.encode_piece_py)
        if not isinstance(self.encode_piece, NativePieces):
            self.ranks   # at load, not in the first encode

    @property
    def ranks(self) -> dict[str, int]:
        """Merge "left right" -> its rank; a pair listed twice keeps its first rank
        (llama.cpp's emplace). The native path never needs it: built on first use then."""
        if self._ranks is None:
            m = self.merges
            self._ranks = dict(zip(reversed(m), range(len(m) - 1, -1, -1)))
        return self._ranks

    def split(self, text: str) -> list[str]:
        return self.splitter.split(text)

    def sequence(self, parts: list, text: str = "") -> list[str | int]:
        """[fragment, id, fragment, ...] -> pretokens and special ids, in order."""
        if len(parts) == 1:
            return self.splitter.split(parts[0])
        seq: list[str | int] = []
        split = self.splitter.split
        for k, part in enumerate(parts):
            if k & 1:
                seq.append(part)
            elif part:
                seq.extend(split(part))
        return seq

    def encode(self, text: str, out: list[int]) -> None:
        self.cache = encode_cached(self.splitter.split(text), self.cache, self.encode_piece, out)

    def encode_piece_py(self, word: str | int) -> tuple[int, ...]:
        if isinstance(word, int):
            return (word,)
        s = word.encode("utf-8", "surrogatepass").decode("latin-1").translate(BYTES_TO_UNICODE)
        t2i = self.token_to_id
        if self.ignore_merges or len(s) == 1:
            tid = t2i.get(s)
            if tid is not None:
                return (tid,)
        syms = bpe_merge(s, self.ranks)
        ids = tuple(map(t2i.get, syms))
        if None not in ids:
            return ids
        out: list[int] = []
        for sym, tid in zip(syms, ids):
            if tid is not None:
                out.append(tid)
                continue
            # llama.cpp looks each byte of the symbol up as a one-byte token; only ASCII
            # can match, the rest is dropped
            for b in sym.encode("utf-8"):
                tid = t2i.get(chr(b)) if b < 0x80 else None
                if tid is not None:
                    out.append(tid)
        return tuple(out)


def bpe_merge(s: str, ranks: dict[str, int]) -> list[str]:
    """Merge the lowest-ranked adjacent pair (leftmost on a tie) until none is ranked."""
    syms = list(s)
    get = ranks.get
    if len(syms) > LIST_MAX:
        return heap_merge(syms, lambda a, b: get(a + " " + b))
    ranks_of = list(map(get, map(" ".join, zip(syms, syms[1:])), repeat(_NONE)))
    # list_merge, inlined: this loop is most of a cold encode's time
    while ranks_of:
        r = min(ranks_of)
        if r == _NONE:
            break
        i = ranks_of.index(r)
        merged = syms[i] + syms.pop(i + 1)
        syms[i] = merged
        del ranks_of[i]
        if i:
            ranks_of[i - 1] = get(syms[i - 1] + " " + merged, _NONE)
        if i < len(ranks_of):
            ranks_of[i] = get(merged + " " + syms[i + 1], _NONE)
    return syms
