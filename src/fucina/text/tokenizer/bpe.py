"""Byte-level BPE (GPT-2 style), as llama.cpp's llm_tokenizer_bpe_session runs it.

Each pretoken is UTF-8 encoded, every byte mapped to its printable stand-in, and the
adjacent pair with the lowest merge rank merged (leftmost first on a tie) until no
ranked pair is left. A pretoken's ids never depend on its neighbours, so they are
cached by pretoken: on ordinary text nearly every word is a cache hit and encoding
is one regex pass plus dictionary lookups.
"""
from __future__ import annotations

from fucina.text.tokenizer.merge import encode_cached, heap_merge
from fucina.text.tokenizer.pretokenize import Splitter
from fucina.text.tokenizer.unicode import BYTES_TO_UNICODE
from fucina.text.tokenizer.vocab import Vocab

_SHORT = 40   # words up to this many bytes use the simple quadratic loop


class ByteBPE:
    def __init__(self, vocab: Vocab):
        assert vocab.pre_spec is not None
        self.token_to_id = vocab.token_to_id
        merges = vocab.merges
        # "left right" -> rank; a pair listed twice keeps its first rank (llama.cpp's emplace)
        self.ranks: dict[str, int] = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
        self.ignore_merges = vocab.ignore_merges
        self.splitter = Splitter(vocab.pre_spec.kind)
        self.cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        encode_cached(self.splitter.split(text), self.cache, self.encode_word, out)

    def encode_word(self, word: str) -> tuple[int, ...]:
        s = word.encode("utf-8", "surrogatepass").decode("latin-1").translate(BYTES_TO_UNICODE)
        t2i = self.token_to_id
        if self.ignore_merges or len(s) == 1:
            tid = t2i.get(s)
            if tid is not None:
                return (tid,)
        if len(s) <= _SHORT:
            syms = merge_short(s, self.ranks)
        else:
            get = self.ranks.get
            syms = heap_merge(list(s), lambda a, b: get(a + " " + b))
        out: list[int] = []
        for sym in syms:
            tid = t2i.get(sym)
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


def merge_short(s: str, ranks: dict[str, int]) -> list[str]:
    """Repeatedly merge the lowest-ranked adjacent pair, leftmost on a tie."""
    syms = list(s)
    get = ranks.get
    while len(syms) > 1:
        best_rank = None
        best = 0
        for i in range(len(syms) - 1):
            r = get(syms[i] + " " + syms[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best_rank = r
                best = i
        if best_rank is None:
            break
        syms[best:best + 2] = [syms[best] + syms[best + 1]]
    return syms
