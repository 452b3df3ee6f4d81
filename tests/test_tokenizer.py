"""Tokenizers against llama.cpp: committed goldens always, the live oracle when
$FUCINA_LLAMA_CPP is set; round trips and the stream decoder on the same corpus."""
from __future__ import annotations

import gzip
import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import VOCAB_DIR

from fucina.errors import TokenizerError
from fucina.text.tokenizer import StreamDecoder, Tokenizer
from fucina.text.tokenizer.core import _clean_spaces, lenient_utf8_decode
from fucina.text.tokenizer.special import SpecialSplitter
from fucina.text.tokenizer.spm import SPACE, merge
from fucina.text.tokenizer.unicode import BYTE_CHARS

DATA = Path(__file__).parent / "data" / "tokenizer"
CORPUS = sorted(p for p in (DATA / "corpus").iterdir() if p.is_file())
VOCABS = ["smollm2", "gemma3", "qwen3", "llama3", "o200k"]
_TOKS: dict[str, Tokenizer] = {}


@pytest.fixture(scope="session", params=VOCABS)
def vocab(request) -> tuple[str, Tokenizer]:
    name = request.param
    if name not in _TOKS:
        if name in ("smollm2", "gemma3"):
            path = request.getfixturevalue(f"{name}_path")
        else:
            path = VOCAB_DIR / f"vocab-{name}.gguf"
            if not path.exists():
                pytest.skip(f"{path} missing")
        _TOKS[name] = Tokenizer.from_gguf(path)
    return name, _TOKS[name]


def expected(name: str) -> dict[str, list[int]]:
    return json.loads(gzip.decompress((DATA / "expected" / f"{name}.json.gz").read_bytes()))


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check_case(tok: Tokenizer, case: str, want: list[int]) -> None:
    fname, _, variant = case.partition(":")
    data = (DATA / "corpus" / fname).read_bytes()
    got = tok.encode(data, add_special=not variant, parse_special=not variant)
    if got != want:
        i = _first_diff(got, want)
        pytest.fail(f"{case}: first difference at token {i}: got {got[i:i + 6]}, llama.cpp "
                    f"{want[i:i + 6]} (text {tok.decode(want[max(0, i - 4):i + 4])!r})")


def test_goldens(vocab):
    name, tok = vocab
    cases = expected(name)
    assert set(c.partition(":")[0] for c in cases) == {p.name for p in CORPUS}
    for case, want in cases.items():
        _check_case(tok, case, want)


def test_round_trip(vocab):
    _, tok = vocab
    # SmolLM2 has no token for some bytes (0x04, 0x13, 0xF5.., ...): llama.cpp drops them
    missing = set() if tok.kind == "spm" else {
        b for b in range(256) if tok.token_id(BYTE_CHARS[b]) is None}
    for p in CORPUS:
        data = p.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if missing.intersection(data):
            want = bytes(b for b in data if b not in missing)
            assert tok.decode_bytes(tok.encode_raw(text)) == want, p.name
            continue
        assert tok.decode(tok.encode_raw(text)) == text, p.name
        assert tok.decode_bytes(tok.encode_raw(text, parse_special=False)) == data, p.name


@pytest.mark.parametrize("skip_special", [False, True])
def test_stream_decoder_reproduces_decode(vocab, skip_special):
    _, tok = vocab
    for p in CORPUS:
        ids = tok.encode(p.read_bytes())
        sd = StreamDecoder(tok, skip_special=skip_special)
        pieces = [sd.push(i) for i in ids]
        pieces.append(sd.flush())
        assert "".join(pieces) == tok.decode(ids, skip_special=skip_special), p.name
        # never emits half a character
        assert all("\ufffd" not in x for x in pieces) or b"\xef\xbf\xbd" in p.read_bytes() \
            or p.name == "malformed.bin"


def test_stream_decoder_holds_split_characters(vocab):
    _, tok = vocab
    # a character with no token of its own comes out as byte pieces
    text = "\U0001f9d1\u200d\U0001f680 \u845b\U000e0100 \U00031350"
    ids = tok.encode_raw(text)
    sd = StreamDecoder(tok)
    outs = [sd.push(i) for i in ids] + [sd.flush()]
    assert "".join(outs) == text
    assert all("\ufffd" not in o for o in outs)
    assert "" in outs[:-1]          # some token ended mid-character and was held


def test_special_tokens_and_policy(vocab):
    name, tok = vocab
    facts = {
        "smollm2": (None, False, "<|im_end|>", "<|endoftext|>"),
        "gemma3": ("<bos>", True, "<eos>", "<end_of_turn>"),
        "qwen3": (None, False, "<|im_end|>", "<|im_end|>"),
        "llama3": ("<|begin_of_text|>", True, "<|eot_id|>", "<|eot_id|>"),
        "o200k": (None, False, "<|endoftext|>", "<|endoftext|>"),
    }[name]
    bos_text, add_bos, eos_text, eog_text = facts
    assert tok.add_bos is add_bos and tok.add_eos is False
    assert tok.token_text(tok.eos_id) == eos_text
    if bos_text:
        assert tok.token_text(tok.bos_id) == bos_text
        assert tok.encode("hi")[0] == tok.bos_id
    assert tok.encode("hi")[add_bos:] == tok.encode_raw("hi")
    assert tok.is_eog(tok.token_id(eog_text)) and tok.is_eog(tok.eos_id)
    assert tok.eot_id is None or tok.is_eog(tok.eot_id)
    assert not tok.is_eog(tok.encode_raw("hi")[0])
    assert tok.token_id("no such token, surely") is None
    assert tok.pre_mismatch is None
    assert tok.n_vocab == len(tok.vocab.tokens)
    with pytest.raises(TokenizerError):
        tok.token_text(tok.n_vocab)


def test_markers_mid_text(vocab):
    name, tok = vocab
    marker = {"gemma3": "<start_of_turn>", "llama3": "<|eot_id|>", "o200k": "<|endofprompt|>"}.get(
        name, "<|im_start|>")
    mid = tok.token_id(marker)
    ids = tok.encode_raw(f"abc{marker}def")
    assert mid in ids
    assert mid not in tok.encode_raw(f"abc{marker}def", parse_special=False)
    # a `<|`-shaped span opening no known marker is ordinary text
    fake = tok.encode_raw("<|im_sta <|foo|> <|")
    assert all(not tok.vocab.attrs[i] & 8 for i in fake)
    assert tok.decode(fake) == "<|im_sta <|foo|> <|"


def test_malformed_utf8_never_crashes(vocab):
    _, tok = vocab
    rng = random.Random(5)
    for _ in range(200):
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
        ids = tok.encode(data)
        assert all(0 <= i < tok.n_vocab for i in ids)
        tok.decode(ids)
    if tok.kind == "bpe":   # above U+10FFFF: llama.cpp's BPE aborts here, we read U+FFFD
        assert tok.encode_raw(b"\xf5\x80\x80\x80") == tok.encode_raw("\ufffd")


@pytest.mark.oracle
def test_live_oracle(vocab, oracle, tmp_path):
    from oracle import run
    name, tok = vocab
    rng = random.Random(len(name))
    texts = [p.read_text("utf-8") for p in CORPUS if p.suffix != ".bin"]
    # shuffled fragments of the corpus glued at random places: new boundaries every run
    pieces = []
    for _ in range(60):
        t = rng.choice(texts)
        a = rng.randrange(len(t))
        pieces.append(t[a:a + rng.randint(1, 200)])
    text = "".join(pieces)
    path = tmp_path / "live.txt"
    path.write_text(text, "utf-8")
    model = {"smollm2": None, "gemma3": None}.get(name, VOCAB_DIR / f"vocab-{name}.gguf")
    if model is None:
        from conftest import cached_model
        model = cached_model(name)
    for flags, kw in (((), {}), (("--no-bos", "--no-parse-special"), dict(add_special=False, parse_special=False))):
        out = run("llama-tokenize", "-m", str(model), "-f", str(path), "--ids", "--log-disable",
                  "--no-escape", *flags)
        want = json.loads(out.strip().splitlines()[-1])
        got = tok.encode(text, **kw)
        assert got == want, f"first difference at {_first_diff(got, want)}"


# ---- small synthetic vocabularies: behaviour that needs no model ----

def _bpe_meta(tokens, merges, types=None, pre="qwen2", **extra):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges}
    if types is not None:
        meta["tokenizer.ggml.token_type"] = np.array(types, dtype=np.int32)
    meta.update(extra)
    return meta


def test_tiny_bpe_merges_markers_round_trip():
    tok = Tokenizer.from_metadata(_bpe_meta(["<|im_end|>", "h", "i", "hi"], ["h i"], [3, 1, 1, 1],
                                            **{"tokenizer.ggml.eos_token_id": 0}))
    assert tok.encode("hi<|im_end|>") == [3, 0]
    assert tok.decode([3, 0]) == "hi<|im_end|>"
    assert tok.decode([3, 0], skip_special=True) == "hi"
    assert tok.is_eog(0) and tok.eos_id == 0
    assert tok.bos_id is None            # llama.cpp's BPE default (11) is out of range


def test_unknown_pre_falls_back_to_qwen2_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="fucina.tokenizer"):
        tok = Tokenizer.from_metadata(_bpe_meta(["a", "b", "ab"], ["a b"], pre="brand-new-pre"))
    assert tok.pre_mismatch == "brand-new-pre"
    assert any("brand-new-pre" in r.message for r in caplog.records)
    assert tok.encode("ab") == [2]


def test_bad_metadata_is_a_typed_error():
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata({})
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": "abc",
                                 "tokenizer.ggml.merges": []})


def test_special_overlap_uses_llama_cpp_order():
    # "bcd" is longer, so llama.cpp claims it first although "ab" starts earlier
    specials = [("bcd", 1, 8), ("ab", 0, 8)]
    sp = SpecialSplitter(specials)
    assert sp.exact
    assert sp.split("abcd") == ["a", 1, ""]
    # runs of one character may overlap each other and still take the fast path
    runs = SpecialSplitter([("\n" * k, k, 16) for k in range(3, 0, -1)])
    assert not runs.exact
    assert runs.split("x\n\n\n\n\ny") == ["x", 3, "", 2, "y"]


def test_spm_pieces_merge_like_the_whole_fragment(vocab):
    name, tok = vocab
    if tok.kind != "spm":
        pytest.skip("SentencePiece only")
    eng = tok._engine
    rng = random.Random(9)
    texts = [p.read_text("utf-8") for p in CORPUS if p.suffix != ".bin"]
    for _ in range(40):
        t = rng.choice(texts)
        a = rng.randrange(len(t))
        frag = t[a:a + rng.randint(1, 300)].replace(" ", SPACE)
        whole = merge(list(frag), eng.token_to_id, eng.scores)
        want: list[int] = []
        for sym in whole:
            tid = eng.token_to_id.get(sym)
            want.extend([tid] if tid is not None else
                        [eng.byte_token(b) for b in sym.encode("utf-8", "surrogatepass")])
        got: list[int] = []
        eng.encode(frag, got)
        assert got == want


def test_lenient_utf8_decode_matches_llama_cpp():
    assert lenient_utf8_decode(b"a\xc3\xa9") == "aé"
    assert lenient_utf8_decode(b"\x80") == "\ufffd"
    assert lenient_utf8_decode(b"\xc1\x81") == "A"              # overlong, unchecked
    assert lenient_utf8_decode(b"\xed\xa0\x80") == "\ud800"     # surrogate, unchecked
    assert lenient_utf8_decode(b"\xe4AB") == "\ufffdAB"         # resumes after the bad lead
    assert lenient_utf8_decode(b"\xe2\x82") == "\ufffd\ufffd"


def test_clean_spaces_matches_llama_detokenize():
    assert _clean_spaces(b"Hello , world ! Is it ? Yes .") == b"Hello, world! Is it? Yes."
    assert _clean_spaces(b"it ' s") == b"it's"
    assert _clean_spaces(b"he 's I 'm we 're they 've you 'll I 'd") == \
        b"he's I'm we're they've you 'll I 'd"


def test_cache_overflow_starts_a_new_cache(vocab, monkeypatch):
    import fucina.text.tokenizer.merge as merge_mod
    _, tok = vocab
    text = (DATA / "corpus" / "prose_en.txt").read_text("utf-8")
    tok._engine.cache = {}
    want = tok.encode(text)                                       # the cache: this text only
    cache = tok._engine.cache
    del cache[max((k for k in cache if isinstance(k, str)), key=len)]   # force a miss
    snapshot = dict(cache)
    monkeypatch.setattr(merge_mod, "CACHE_MAX", 8)
    assert tok.encode(text) == want
    assert tok._engine.cache is not cache and cache == snapshot   # replaced, never cleared
