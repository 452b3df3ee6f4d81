"""The native merge loops (fucina.text.tokenizer._merge) against the pure-Python path:
the same ids on every vocabulary, on the corpus and on random Unicode; and the native
module refuses or declines bad input instead of crashing."""
from __future__ import annotations

import random

import numpy as np
import pytest

from fucina.errors import TokenizerError
from fucina.text.tokenizer import Tokenizer
from fucina.text.tokenizer.bpe import ByteBPE
from fucina.text.tokenizer.merge import LIST_MAX, NativePieces
from fucina.text.tokenizer.spm import SPACE, SentencePiece
from fucina.text.tokenizer.unicode import BYTE_CHARS

native = pytest.importorskip("fucina.text.tokenizer._merge")
from test_tokenizer import CORPUS, vocab  # noqa: E402,F401  (the shared vocabulary fixture)

_PY: dict[int, Tokenizer] = {}


@pytest.fixture
def pair(vocab) -> tuple[Tokenizer, Tokenizer]:
    """(native, pure Python) tokenizers over one vocabulary."""
    _, nat = vocab
    if not isinstance(nat._engine.encode_piece, NativePieces):
        pytest.skip("native merging switched off (FUCINA_TOKENIZER_NATIVE=0)")
    py = _PY.get(id(nat))
    if py is None:
        py = _PY[id(nat)] = Tokenizer(nat.vocab)
        engine = ByteBPE if nat.kind == "bpe" else SentencePiece
        py._engine = engine(nat.vocab, native=False)
    return nat, py


def _same(nat: Tokenizer, py: Tokenizer, texts, **kw) -> None:
    for text in texts:
        nat._engine.cache, py._engine.cache = {}, {}   # every piece a miss
        assert nat.encode(text, **kw) == py.encode(text, **kw), repr(text[:80])


def _random_text(rng: random.Random, n: int) -> str:
    """Random Unicode: ASCII-heavy, with Latin, CJK, combining marks, emoji, astral."""
    ranges = [(0x20, 0x7e)] * 6 + [(0x00, 0x1f), (0xa0, 0x24f), (0x300, 0x36f), (0x370, 0x3ff),
                                    (0x400, 0x4ff), (0x4e00, 0x9fff), (0xac00, 0xd7a3),
                                    (0x1f300, 0x1faff), (0x10000, 0x10ffff), (0xe000, 0xfffd)]
    out = []
    for _ in range(n):
        a, b = rng.choice(ranges)
        out.append(chr(rng.randint(a, b)))
    return "".join(out)


def _pieces(tok: Tokenizer, text: str) -> list:
    eng = tok._engine
    return eng.sequence(tok._splitter(True).split(text), text)


def test_corpus_encodes_identically(pair):
    data = [p.read_bytes() for p in CORPUS]
    _same(*pair, data)
    _same(*pair, data, add_special=False, parse_special=False)


def test_every_corpus_piece_merges_identically(pair):
    nat, py = pair
    pieces = set()
    for path in CORPUS:
        if path.suffix != ".bin":
            pieces.update(_pieces(nat, path.read_text("utf-8")))
    pieces = sorted(pieces, key=str)
    got = nat._engine.encode_piece.many(pieces)
    assert got == [py._engine.encode_piece(p) for p in pieces]


def test_random_unicode_encodes_identically(pair):
    rng = random.Random(11)
    texts = [_random_text(rng, rng.randint(1, 400)) for _ in range(40)]
    # few cuts: long pieces take the heap path
    texts += ["".join(rng.choice("ab1.-_x\u00e9\u4e00 ") for _ in range(rng.randint(LIST_MAX, 400)))
              for _ in range(20)]
    _same(*pair, texts)


def test_long_pieces_take_the_heap_path_identically(pair):
    nat, py = pair
    rng = random.Random(12)
    words = ["a" * 300, "ab" * 150, "the" * 100, "\u4e00\u4e8c" * 80, "=" * 129, "🙂" * 70,
             "".join(rng.choice("etaoinshr") for _ in range(500))]
    if nat.kind == "spm":
        words += [SPACE + w for w in words] + [SPACE * 200]
    got = nat._engine.encode_piece.many(words)
    assert got == [py._engine.encode_piece(w) for w in words]


def test_malformed_bytes_encode_identically(pair):
    rng = random.Random(13)
    _same(*pair, [bytes(rng.randrange(256) for _ in range(rng.randint(0, 80))) for _ in range(150)])


def test_surrogates_and_ints_in_a_batch(pair):
    nat, py = pair
    eng = nat._engine.encode_piece
    pieces = [7, True, "\ud800x", "\udcff", "a\udc80b", "plain"]
    if nat.kind == "spm":
        pieces += [b"\xe2\x96\x81ab", b"\xff\xfe", b"\xe2\x96"]
    want = [py._engine.encode_piece_py(p) if not isinstance(p, bytes) else None for p in pieces]
    got = eng.many(pieces)
    for p, g, w in zip(pieces, got, want):
        if w is not None:
            assert g == w, p
    assert got[0] == (7,) and got[1] == (True,)


# ---- the module's own contract: validate, refuse, decline; never crash ----

def _tiny_pair(meta, engine) -> tuple[Tokenizer, Tokenizer]:
    nat, py = Tokenizer.from_metadata(meta), Tokenizer.from_metadata(meta)
    nat._engine = engine(nat.vocab, native=True)
    py._engine = engine(py.vocab, native=False)
    return nat, py


def _tiny_bpe(tokens, merges, ignore=False):
    t2i = {t: i for i, t in enumerate(tokens)}
    return native.Bpe(list(BYTE_CHARS), merges, t2i, len(tokens), ignore)


def test_bpe_rules_on_a_tiny_vocabulary():
    # "a b" ranks before "b c"; "ab c" merges into a symbol that is no token: its ASCII
    # bytes fall back to one-byte tokens; a repeated merge keeps its first rank
    tokens = ["a", "b", "c", "ab", "bc"]
    bpe = _tiny_bpe(tokens, ["a b", "b c", "ab c", "b c", "bad", " x", "x ", "a b c"])
    assert bpe.encode_many(["abc", "bc", "ab", "cab", "", "d", 5]) == \
        [(0, 1, 2), (4,), (3,), (2, 3), (), (), (5,)]
    bpe2 = _tiny_bpe(tokens, ["b c", "a b"])
    assert bpe2.encode_many(["abc"]) == [(0, 4)]
    # ignore_merges: a word that is a token is that token, merges or not
    assert _tiny_bpe(tokens + ["abc"], [], ignore=True).encode_many(["abc", "ba"]) == [(5,), (1, 0)]


def test_bpe_matches_python_on_a_tiny_vocabulary():
    rng = random.Random(4)
    alphabet = "abcd"
    tokens = list(alphabet)
    merges = []
    for _ in range(80):
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        merges.append(f"{a} {b}")
        if rng.random() < 0.7 and a + b not in tokens:
            tokens.append(a + b)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges}
    nat, py = _tiny_pair(meta, ByteBPE)
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 150))) for _ in range(800)]
    assert nat._engine.encode_piece.many(words) == [py._engine.encode_piece(w) for w in words]


def test_spm_rules_on_a_tiny_vocabulary():
    tokens = ["<unk>", "a", "b", "ab", "bc", "abc", "<0x63>", "<0x64>"]
    scores = [0.0, 0.0, 0.0, 1.0, 2.0, 0.5, 0.0, 0.0]
    byte_ids = [-1] * 256
    byte_ids[0x63], byte_ids[0x64] = 6, 7
    spm = native.Spm({t: i for i, t in enumerate(tokens)}, scores, byte_ids)
    # "bc" outscores "ab", then a + bc forms the token "abc"; "bab": b + ab loses to the
    # leftmost pair only on a tie; "c", "d" are no tokens: their byte tokens
    assert spm.encode_many(["abc", "ab", "cd", b"ab", "", 3, "bab"]) == \
        [(5,), (3,), (6, 7), (3,), (), (3,), (2, 3)]
    assert spm.encode_many(["e", b"\xff"]) == [None, None]   # no byte token: declined


def test_spm_tiny_vocabulary_through_the_tokenizer():
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"] + \
             [f"<0x{b:02X}>" for b in range(256)]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": np.array([0, 0, 0, -1, -2, -2, -1.5, -1, -0.5] + [0] * 256, np.float32),
            "tokenizer.ggml.token_type": np.array([2, 3, 3] + [1] * 6 + [6] * 256, np.int32)}
    nat, py = _tiny_pair(meta, SentencePiece)
    for text in ["ab", "a b ab", "ba", "abc é", "aaaa" * 40]:
        assert nat.encode(text) == py.encode(text), text
    # NaN scores: the native module refuses them, the engine stays in Python
    meta["tokenizer.ggml.scores"] = np.array([np.nan] * len(tokens), np.float32)
    nan_tok, _ = _tiny_pair(meta, SentencePiece)
    assert not isinstance(nan_tok._engine.encode_piece, NativePieces)
    assert nan_tok.encode("ab")   # the Python path still encodes


def test_a_declined_piece_goes_to_python():
    # no byte token for "z" (SentencePiece's unk default usually covers it): native code
    # declines the piece, and the Python path raises the typed error
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.scores": np.zeros(3, np.float32),
            "tokenizer.ggml.add_space_prefix": False}
    tok = Tokenizer.from_metadata(meta)
    eng = tok._engine
    eng._byte_ids = [-1] * 256
    eng.encode_piece = NativePieces(native.Spm(eng.token_to_id, eng.scores, eng._byte_ids),
                                    eng.encode_piece_py)
    assert tok.encode("ab", add_special=False) == [2]
    with pytest.raises(TokenizerError):
        tok.encode("abz", add_special=False)


def test_bad_arguments_raise_never_crash():
    t2i = {"a": 0}
    with pytest.raises((TypeError, ValueError)):
        native.Bpe(list(BYTE_CHARS)[:10], [], t2i, 1)
    with pytest.raises((TypeError, ValueError)):
        native.Bpe(["x"] * 256, [], t2i, 1)               # stand-ins must be distinct
    with pytest.raises(TypeError):
        native.Bpe(list(BYTE_CHARS), "a b", t2i, 1)
    with pytest.raises(ValueError):
        native.Bpe(list(BYTE_CHARS), [], {"a": 5}, 1)     # id out of range
    with pytest.raises(TypeError):
        native.Bpe(list(BYTE_CHARS), [], {1: 0}, 1)
    with pytest.raises(TypeError):
        native.Bpe(list(BYTE_CHARS), [], {"a": "0"}, 1)
    with pytest.raises(ValueError):
        native.Bpe(list(BYTE_CHARS), [], t2i, -1)
    with pytest.raises(TypeError):
        native.Spm(t2i, (0.0,), [-1] * 256)
    with pytest.raises(TypeError):
        native.Spm(t2i, [0.0], [-1] * 255)
    with pytest.raises(ValueError):
        native.Spm(t2i, [0.0], [3] + [-1] * 255)         # byte id out of range
    with pytest.raises(ValueError):
        native.Spm(t2i, [float("nan")], [-1] * 256)
    with pytest.raises(ValueError):
        native.Spm(t2i, [0.1], [-1] * 256)               # not a float32 value
    with pytest.raises(TypeError):
        native.Spm(t2i, ["x"], [-1] * 256)
    # objects never initialised, or initialised twice
    for cls in (native.Bpe, native.Spm):
        with pytest.raises(RuntimeError):
            cls.__new__(cls).encode_many(["a"])
    bpe = native.Bpe(list(BYTE_CHARS), [], t2i, 1)
    with pytest.raises(RuntimeError):
        bpe.__init__(list(BYTE_CHARS), [], t2i, 1)
    spm = native.Spm(t2i, [0.0], [-1] * 256)
    with pytest.raises(RuntimeError):
        spm.__init__(t2i, [0.0], [-1] * 256)
    # encode_many: a non-sequence is a TypeError; pieces of other types are declined
    with pytest.raises(TypeError):
        bpe.encode_many(5)
    assert bpe.encode_many([None, 1.5, b"a", ["a"], "a"]) == [None, None, None, None, (0,)]
    assert spm.encode_many([None, 1.5, bytearray(b"a"), "a", b"a"]) == [None, None, None, (0,), (0,)]
    assert bpe.encode_many(("a", "a")) == [(0,), (0,)]
