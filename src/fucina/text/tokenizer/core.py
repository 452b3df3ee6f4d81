"""Tokenizer: the public face — built from GGUF metadata, token-ID-exact with llama.cpp."""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from fucina.errors import TokenizerError
from fucina.text.tokenizer.merge import encode_cached
from fucina.text.tokenizer.special import SpecialSplitter
from fucina.text.tokenizer.unicode import BYTE_OF_CHAR
from fucina.text.tokenizer.vocab import (
    ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED, Vocab)

_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL
_RENDERED = _SPECIAL | ATTR_USER_DEFINED


class Tokenizer:
    """Encode/decode with one GGUF vocabulary (byte-level BPE or SentencePiece).

    encode()/encode_raw() accept str or bytes; bytes that are not valid UTF-8 are
    handled the way llama.cpp handles them (see `_encode_malformed`).
    """

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.kind = vocab.kind
        if vocab.kind == "bpe":
            from fucina.text.tokenizer.bpe import ByteBPE
            self._engine: Any = ByteBPE(vocab)
        elif vocab.kind == "gemma4":
            from fucina.text.tokenizer.gemma4 import Gemma4BPE
            self._engine = Gemma4BPE(vocab)
        else:
            from fucina.text.tokenizer.spm import SentencePiece
            self._engine = SentencePiece(vocab)
        self._splitters: dict[bool, SpecialSplitter] = {}
        self._pieces: list[bytes | None] = [None] * vocab.n_vocab
        self._plain_pieces: dict[int, bytes] = {}

    # ---- construction ----
    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        return cls(Vocab(meta))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        from fucina.gguf import GGUFFile
        return cls.from_metadata(GGUFFile(path).metadata)

    # ---- vocabulary facts ----
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self.vocab.ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.ids["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.ids["eot"]

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.vocab.eog_ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    @property
    def add_space_prefix(self) -> bool:
        return self.vocab.add_space_prefix

    @property
    def clean_spaces(self) -> bool:
        """Whether llama_detokenize would rewrite " ," -> "," etc. for this vocabulary."""
        return self.vocab.clean_spaces

    @property
    def pre(self) -> str | None:
        return self.vocab.pre

    @property
    def pre_mismatch(self) -> str | None:
        """The `tokenizer.ggml.pre` we do not implement (encoded with qwen2 rules), if any."""
        return self.vocab.pre_mismatch

    def token_text(self, token_id: int) -> str:
        self._check_id(token_id)
        return self.vocab.tokens[token_id]

    def token_id(self, text: str) -> int | None:
        return self.vocab.token_to_id.get(text)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab.n_vocab:
            raise TokenizerError(f"token id {token_id} out of range [0, {self.vocab.n_vocab})")

    # ---- encoding ----
    def encode(self, text: str | bytes, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids; with add_special, BOS/EOS as the vocabulary's policy says."""
        v = self.vocab
        out: list[int] = []
        if add_special and v.add_bos:
            if v.ids["bos"] is None:
                raise TokenizerError("vocabulary asks for BOS but has no BOS token")
            out.append(v.ids["bos"])
        self._encode(text, parse_special, out)
        if add_special and v.add_eos:
            if v.ids["eos"] is None:
                raise TokenizerError("vocabulary asks for EOS but has no EOS token")
            out.append(v.ids["eos"])
        return out

    def encode_raw(self, text: str | bytes, parse_special: bool = True) -> list[int]:
        """Token ids without BOS/EOS (chat templates own the structure)."""
        out: list[int] = []
        self._encode(text, parse_special, out)
        return out

    def _splitter(self, parse_special: bool) -> SpecialSplitter:
        sp = self._splitters.get(parse_special)
        if sp is None:
            sp = self._splitters[parse_special] = SpecialSplitter(self.vocab.special_tokens(parse_special))
        return sp

    def _encode(self, text: str | bytes, parse_special: bool, out: list[int]) -> None:
        if not isinstance(text, str):
            data = bytes(text)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                self._encode_malformed(data, parse_special, out)
                return
        if not text:
            return
        engine = self._engine
        seq = engine.sequence(self._splitter(parse_special).split(text), text)
        engine.cache = encode_cached(seq, engine.cache, engine.encode_piece, out)

    def _encode_malformed(self, data: bytes, parse_special: bool, out: list[int]) -> None:
        """Bytes that are not valid UTF-8, as llama.cpp treats them.

        Special tokens are found in the raw bytes. Byte-level BPE then decodes each
        fragment leniently: a byte that starts no complete sequence becomes U+FFFD,
        while overlong and surrogate sequences decode to their (invalid) code points,
        unchecked. SentencePiece cuts raw bytes into characters by the lead byte only.
        Deviation: llama.cpp aborts on a 4-byte sequence above U+10FFFF (lead F5..F7 or
        F4 90+); we read it as U+FFFD.
        """
        text = data.decode("utf-8", "surrogateescape")   # invalid bytes -> U+DC80..U+DCFF
        engine = self._engine
        for k, part in enumerate(self._splitter(parse_special).split(text)):
            if k & 1:
                out.append(part)
                continue
            raw = part.encode("utf-8", "surrogateescape")
            if self.kind == "spm":
                if self.vocab.add_space_prefix and raw:
                    raw = b" " + raw
                engine.encode_bytes(raw.replace(b" ", "\u2581".encode()), out)
            elif raw:
                engine.cache = encode_cached(engine.split(lenient_utf8_decode(raw)), engine.cache,
                                             engine.encode_piece, out)

    # ---- decoding ----
    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token stands for; control tokens render as their text only
        when `special` (llama_token_to_piece)."""
        self._check_id(token_id)
        attr = self.vocab.attrs[token_id]
        if not special and attr & _SPECIAL:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id, attr)
        return piece

    def _make_piece(self, token_id: int, attr: int) -> bytes:
        text = self.vocab.tokens[token_id]
        if attr & _RENDERED:
            return text.encode("utf-8", "surrogatepass")
        if attr & ATTR_NORMAL:
            if self.vocab.escape_whitespaces:   # SentencePiece and Gemma 4: U+2581 is a space
                return text.replace("\u2581", " ").encode("utf-8", "surrogatepass")
            out = bytearray()
            for ch in text:
                b = BYTE_OF_CHAR.get(ch)
                if b is not None:
                    out.append(b)
                else:   # llama_decode_text's marker for a character outside the byte map
                    out += f"[UNK_BYTE_0x{ch.encode('utf-8').hex()}{text}]".encode()
            return bytes(out)
        if attr & ATTR_BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b""
        return b""

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """llama_detokenize(remove_special=skip_special, unparse_special=not skip_special),
        before its optional space clean-up."""
        ids = list(ids)
        v = self.vocab
        strip = v.add_space_prefix
        if skip_special and v.add_bos and ids and ids[0] == v.ids["bos"]:
            strip = False
            ids = ids[1:]
        if skip_special and v.add_eos and ids and ids[-1] == v.ids["eos"]:
            ids = ids[:-1]
        special = not skip_special
        pieces = [self.token_to_piece(i, special) for i in ids]
        if strip and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        return b"".join(pieces)

    def decode(self, ids: Iterable[int], skip_special: bool = False, clean_spaces: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD. clean_spaces=self.clean_spaces
        reproduces llama_detokenize exactly; the default keeps decode lossless."""
        data = self.decode_bytes(ids, skip_special)
        if clean_spaces:
            data = _clean_spaces(data)
        return data.decode("utf-8", "replace")


def lenient_utf8_decode(data: bytes) -> str:
    """llama.cpp's unicode_cpts_from_utf8: no overlong or surrogate checks; a byte that
    starts no complete sequence is U+FFFD and decoding resumes at the next byte."""
    out = []
    i, n = 0, len(data)
    while i < n:
        b0 = data[i]
        if b0 < 0x80:
            out.append(b0)
            i += 1
            continue
        need = 1 if b0 & 0xE0 == 0xC0 else 2 if b0 & 0xF0 == 0xE0 else 3 if b0 & 0xF8 == 0xF0 else 0
        if not need or i + need >= n:
            out.append(0xFFFD)
            i += 1
            continue
        tail = data[i + 1:i + 1 + need]
        if any(b & 0xC0 != 0x80 for b in tail):
            out.append(0xFFFD)
            i += 1
            continue
        cp = b0 & (0x1F, 0x0F, 0x07)[need - 1]
        for b in tail:
            cp = (cp << 6) | (b & 0x3F)
        out.append(cp if cp < 0x110000 else 0xFFFD)
        i += 1 + need
    return "".join(map(chr, out))


def _clean_spaces(text: bytes) -> bytes:
    """llama_detokenize's clean_up_tokenization_spaces: its three in-place passes."""
    t = bytearray(text)
    n = len(t)
    # " ?", " !", " .", " ,": drop the space
    total = 1 if n else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    # " ' ": drop both spaces
    n, total = total, 1 if total else 0
    i = 1
    while i < n:
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    # " 's", " 'm", " 're", " 've": drop the space
    n, total = total, 1 if total else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm" or (i + 2 < n and t[i + 1:i + 3] in (b"re", b"ve")):
                total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])
