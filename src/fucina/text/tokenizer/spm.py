"""SentencePiece (BPE-by-score), as llama.cpp's llm_tokenizer_spm_session runs it.

Spaces become U+2581 ("▁"); the fragment is cut into UTF-8 characters; the adjacent
pair whose concatenation is the highest-scoring vocabulary token is merged (leftmost
first on a tie) until no pair forms a token; a final piece that is not a token falls
back to its bytes (<0xXX>).

llama.cpp merges over a whole fragment. A merge can only cross the boundary between
two characters if some token contains that character pair, so we cut fragments
before every "▁" whose left neighbour never precedes "▁" inside a token: the pieces
merge independently (the priority order between pieces is irrelevant), which makes
them cacheable like BPE words. For Gemma-3 the only character that precedes "▁"
inside a token is ">" (in ">▁</").
"""
from __future__ import annotations

import re

from fucina.errors import TokenizerError
from fucina.text.tokenizer.merge import Sym, encode_cached, heap_merge
from fucina.text.tokenizer.vocab import Vocab

SPACE = "\u2581"
_SPACE_B = SPACE.encode()


class SentencePiece:
    def __init__(self, vocab: Vocab):
        if vocab.scores is None:
            raise TokenizerError("SentencePiece vocabulary without tokenizer.ggml.scores")
        self.vocab = vocab
        self.token_to_id = vocab.token_to_id
        self._scores: list[float] | None = None
        self.cache: dict[str, tuple[int, ...]] = {}
        unsafe = sorted({t[i - 1] for t in vocab.tokens if SPACE in t[1:]
                         for i in range(1, len(t)) if t[i] == SPACE and t[i - 1] != SPACE})
        self.unsafe = frozenset(unsafe)
        if unsafe:
            u = "".join(re.escape(c) for c in unsafe)
            self._pieces = re.compile(f"{SPACE}*(?:[^{SPACE}{u}]|[{u}]{SPACE}*)+|{SPACE}+")
        else:
            self._pieces = re.compile(f"{SPACE}*[^{SPACE}]+|{SPACE}+")
        self._bytes_vocab: dict[bytes, int] | None = None
        self._byte_ids: list[int] | None = None

    @property
    def scores(self) -> list[float]:
        if self._scores is None:
            self._scores = self.vocab.scores.tolist()
        return self._scores

    def encode(self, text: str, out: list[int]) -> None:
        """Encode one fragment whose spaces are already escaped to "▁"."""
        encode_cached(self._pieces.findall(text), self.cache, self._encode_piece, out)

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        tid = self.token_to_id.get(piece)
        if tid is not None and len(piece) == 1:
            return (tid,)
        syms = merge(list(piece), self.token_to_id, self.scores)
        out: list[int] = []
        for sym in syms:
            tid = self.token_to_id.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.byte_token(b) for b in sym.encode("utf-8", "surrogatepass"))
        return tuple(out)

    def byte_token(self, b: int) -> int:
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
        tid = self._byte_ids[b]
        if tid < 0:
            raise TokenizerError(f"vocabulary has no byte token for 0x{b:02X}")
        return tid

    def encode_bytes(self, data: bytes, out: list[int]) -> None:
        """Encode a fragment given as (possibly malformed) UTF-8, spaces escaped.

        llama.cpp cuts symbols by the lead byte alone (a bad lead byte may swallow the
        bytes after it), never validating; we do the same, on bytes.
        """
        if self._bytes_vocab is None:
            self._bytes_vocab = {t.encode("utf-8", "surrogatepass"): i
                                 for t, i in self.token_to_id.items()}
        syms: list[bytes] = []
        i = 0
        while i < len(data):
            n = _utf8_len(data[i])
            syms.append(data[i:i + n])
            i += n
        # cut before "▁" symbols whose left neighbour is a safe character
        start = 0
        for k in range(1, len(syms) + 1):
            if k < len(syms) and not (syms[k] == _SPACE_B and syms[k - 1] != _SPACE_B
                                      and syms[k - 1].decode("utf-8", "replace") not in self.unsafe):
                continue
            for sym in merge(syms[start:k], self._bytes_vocab, self.scores):
                tid = self._bytes_vocab.get(sym)
                if tid is not None:
                    out.append(tid)
                else:
                    out.extend(self.byte_token(b) for b in sym)
            start = k


def _utf8_len(lead: int) -> int:
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[lead >> 4]


def merge(syms: list[Sym], t2i: dict[Sym, int], scores: list[float]) -> list[Sym]:
    """Merge the adjacent pair forming the best-scoring token, leftmost on a tie."""
    get = t2i.get

    def priority(a: Sym, b: Sym) -> float | None:
        tid = get(a + b)
        return None if tid is None else -scores[tid]

    return heap_merge(syms, priority)
