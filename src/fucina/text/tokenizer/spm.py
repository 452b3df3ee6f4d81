"""SentencePiece (BPE-by-score), as llama.cpp's llm_tokenizer_spm_session runs it.

Spaces become U+2581 ("▁"); the fragment is cut into UTF-8 characters; the adjacent
pair whose concatenation is the highest-scoring vocabulary token is merged (leftmost
first on a tie) until no pair forms a token; a final piece that is not a token falls
back to its bytes (<0xXX>).

llama.cpp merges over a whole fragment. A merge can only cross the boundary between
two characters if some token contains that character pair, so the pieces on either
side of such a boundary merge independently (the priority order between them is
irrelevant) and can be cached like BPE words. We cut with a regex before every "▁"
whose left neighbour never precedes "▁" inside a token (for Gemma-3 only ">" does,
in ">▁</"), and cut a new piece again wherever two neighbours sit together in no
token (Gemma-3 keeps punctuation apart from letters: "word," is "word" + ",").

With the `_merge` module built, the pieces a text adds to the cache merge whole in C++
(`_merge.Spm`: the same loop on the piece's bytes, no cutting needed); else in Python
(`encode_piece_py`).
"""
from __future__ import annotations

import re
from operator import add

import numpy as np

from fucina.errors import TokenizerError
from fucina.text.tokenizer import merge as _m
from fucina.text.tokenizer.merge import (
    LIST_MAX, NativePieces, Sym, encode_cached, heap_merge, list_merge)
from fucina.text.tokenizer.vocab import Vocab

SPACE = "\u2581"
_SEPARATORS = ("\ufdd0", "\ufdd1", "\U0010fffe", "\x00")   # rare first
_NONE = float("inf")   # "forms no token" key (list merging needs finite scores)
_SPACE_B = SPACE.encode()


class SentencePiece:
    def __init__(self, vocab: Vocab, native: bool | None = None):
        """native: merge in C++ (default: when built; see merge.use_native)."""
        if vocab.scores is None:
            raise TokenizerError("SentencePiece vocabulary without tokenizer.ggml.scores")
        # list merging marks "no token" with +inf: only exact while every score is finite
        self._finite = bool(np.isfinite(vocab.scores).all())
        self.vocab = vocab
        self.token_to_id = vocab.token_to_id
        self._scores: list[float] | None = None
        self.cache: dict[str, tuple[int, ...]] = {}
        unsafe = sorted({t[i - 1] for t in vocab.tokens if SPACE in t[1:]
                         for i in range(1, len(t)) if t[i] == SPACE and t[i - 1] != SPACE})
        self.unsafe = frozenset(unsafe)
        self.add_space_prefix = vocab.add_space_prefix
        self._u = "".join(re.escape(c) for c in unsafe)
        self._pieces = self._piece_regex("")
        self._by_sep: dict[str, re.Pattern[str]] = {}
        self._bytes_vocab: dict[bytes, int] | None = None
        self._pairs: frozenset[str] | None = None
        self._byte_ids: list[int] | None = None
        self.encode_piece = self.encode_piece_py
        self._native = None
        if _m.use_native(native):
            try:   # a vocabulary native code refuses (NaN scores, say) stays in Python
                self._native = _m.native.Spm(self.token_to_id, self.scores, self.byte_ids)
            except (TypeError, ValueError):
                self._native = None
            else:
                self.encode_piece = NativePieces(self._native, self.encode_piece_py)

    @property
    def scores(self) -> list[float]:
        if self._scores is None:
            self._scores = self.vocab.scores.tolist()
        return self._scores

    def _piece_regex(self, sep: str) -> re.Pattern[str]:
        """Pieces: a run of "▁" and what follows up to the next "▁" that starts a piece
        (none after an unsafe character); `sep` stands alone and breaks pieces."""
        u, x = self._u, re.escape(sep)
        if u:
            return re.compile(f"{x + '|' if x else ''}{SPACE}*(?:[^{SPACE}{u}{x}]+|[{u}]{SPACE}*)+|{SPACE}+")
        return re.compile(f"{x + '|' if x else ''}{SPACE}*[^{SPACE}{x}]+|{SPACE}+")

    def split(self, text: str) -> list[str]:
        """Independently mergeable pieces of a fragment whose spaces are escaped to "▁"."""
        return self._pieces.findall(text)

    def sequence(self, parts: list, text: str = "") -> list[str | int]:
        """[fragment, id, fragment, ...] -> pieces and special ids, in order.

        llama.cpp prefixes a space to every fragment that follows a special token (or
        starts the text) when add_space_prefix, then escapes spaces. Fragments are
        joined around a separator character absent from the text so that one regex
        pass cuts them all (Gemma's newlines and space runs are special tokens:
        thousands of fragments per page)."""
        frags = parts[0::2]
        if self.add_space_prefix:
            frags = [" " + f if f else f for f in frags]
        if len(parts) == 1:
            return self._pieces.findall(frags[0].replace(" ", SPACE))
        sep = next((c for c in _SEPARATORS if c not in text), None) if text else None
        if sep is None:
            return self._sequence_slow(frags, parts[1::2])
        pat = self._by_sep.get(sep)
        if pat is None:
            pat = self._by_sep[sep] = self._piece_regex(sep)
        pieces = pat.findall(sep.join(frags).replace(" ", SPACE))
        it = iter(parts[1::2])
        return [next(it) if p == sep else p for p in pieces]

    def _sequence_slow(self, frags: list[str], ids: list[int]) -> list[str | int]:
        seq: list[str | int] = []
        for k, frag in enumerate(frags):
            if k:
                seq.append(ids[k - 1])
            if frag:
                seq.extend(self.split(frag.replace(" ", SPACE)))
        return seq

    @property
    def pairs(self) -> frozenset[str]:
        """Every two-character string inside a token that has a character other than
        letters and "▁" (plus harmless extras around the separator). Pairs of two
        letters are never cut, so only those tokens can hold a pair we ask about."""
        if self._pairs is None:
            big = "\0".join([t for t in self.vocab.tokens if not t.replace(SPACE, "").isalpha()])
            self._pairs = frozenset(map(add, big, big[1:]))
        return self._pairs

    def encode(self, text: str, out: list[int]) -> None:
        """Encode one fragment whose spaces are already escaped to "▁"."""
        self.cache = encode_cached(self._pieces.findall(text), self.cache, self.encode_piece, out)

    def encode_piece_py(self, piece: str | int) -> tuple[int, ...]:
        if isinstance(piece, int):
            return (piece,)
        if len(piece) == 1:
            tid = self.token_to_id.get(piece)
            return (tid,) if tid is not None else self._merge_piece(piece)
        # Two neighbours that sit together in no token are never merged: cut there too
        # (Gemma-3 keeps punctuation apart from letters) and cache the parts.
        if piece.lstrip(SPACE).isalpha():
            return self._merge_piece(piece)
        pairs = self.pairs
        cuts = [i for i, (a, b) in enumerate(zip(piece, piece[1:]), 1)
                if a + b not in pairs and not (a.isalpha() and b.isalpha())
                and a != SPACE and b != SPACE]
        if not cuts:
            return self._merge_piece(piece)
        out: list[int] = []
        cache = self.cache
        start = 0
        for i in cuts + [len(piece)]:
            sub = piece[start:i]
            ids = cache.get(sub)
            if ids is None:
                ids = cache[sub] = self.encode_piece_py(sub)
            out.extend(ids)
            start = i
        return tuple(out)

    def _merge_piece(self, piece: str) -> tuple[int, ...]:
        t2i = self.token_to_id
        syms = merge(list(piece), t2i, self.scores, self._finite)
        ids = tuple(map(t2i.get, syms))
        if None not in ids:
            return ids
        out: list[int] = []
        for sym, tid in zip(syms, ids):
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.byte_token(b) for b in sym.encode("utf-8", "surrogatepass"))
        return tuple(out)

    @property
    def byte_ids(self) -> list[int]:
        """The token of each byte: <0xXX>, else (ASCII) the character, else unk; -1: none."""
        if self._byte_ids is None:
            ids = []
            unk = self.vocab.ids.get("unk")
            for x in range(256):
                tid = self.token_to_id.get(f"<0x{x:02X}>")
                if tid is None and x < 0x80:
                    tid = self.token_to_id.get(chr(x))
                if tid is None:
                    tid = -1 if unk is None else unk
                ids.append(tid)
            self._byte_ids = ids
        return self._byte_ids

    def byte_token(self, b: int) -> int:
        tid = self.byte_ids[b]
        if tid < 0:
            raise TokenizerError(f"vocabulary has no byte token for 0x{b:02X}")
        return tid

    def encode_bytes(self, data: bytes, out: list[int]) -> None:
        """Encode a fragment given as (possibly malformed) UTF-8, spaces escaped.

        llama.cpp cuts symbols by the lead byte alone (a bad lead byte may swallow the
        bytes after it), never validating; we do the same, on bytes.
        """
        syms: list[bytes] = []
        i = 0
        while i < len(data):
            n = _utf8_len(data[i])
            syms.append(data[i:i + n])
            i += n
        # cut before "▁" symbols whose left neighbour is a safe character
        segments: list[list[bytes]] = []
        start = 0
        for k in range(1, len(syms) + 1):
            if k < len(syms) and not (syms[k] == _SPACE_B and syms[k - 1] != _SPACE_B
                                      and syms[k - 1].decode("utf-8", "replace") not in self.unsafe):
                continue
            segments.append(syms[start:k])
            start = k
        # native code cuts a segment's bytes into the same symbols (by the lead byte)
        done = (self._native.encode_many([b"".join(seg) for seg in segments])
                if self._native is not None else [None] * len(segments))
        for seg, ids in zip(segments, done):
            if ids is not None:
                out.extend(ids)
            else:
                self._merge_bytes(seg, out)

    def _merge_bytes(self, syms: list[bytes], out: list[int]) -> None:
        if self._bytes_vocab is None:
            self._bytes_vocab = {t.encode("utf-8", "surrogatepass"): i
                                 for t, i in self.token_to_id.items()}
        for sym in merge(syms, self._bytes_vocab, self.scores, self._finite):
            tid = self._bytes_vocab.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.byte_token(b) for b in sym)


def _utf8_len(lead: int) -> int:
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[lead >> 4]


def merge(syms: list[Sym], t2i: dict[Sym, int], scores: list[float], finite: bool = True) -> list[Sym]:
    """Merge the adjacent pair forming the best-scoring token, leftmost on a tie."""
    get = t2i.get
    if len(syms) > LIST_MAX or not finite:
        def priority(a: Sym, b: Sym) -> float | None:
            tid = get(a + b)
            return None if tid is None else -scores[tid]
        return heap_merge(syms, priority)

    def key(a: Sym, b: Sym) -> float:
        tid = get(a + b)
        return _NONE if tid is None else -scores[tid]

    keys = [_NONE if t is None else -scores[t] for t in map(get, map(add, syms, syms[1:]))]
    return list_merge(syms, keys, key, _NONE)
