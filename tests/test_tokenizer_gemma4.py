"""The Gemma 4 tokenizer (`tokenizer.ggml.model = gemma4`, SentencePiece-style BPE)
against llama-tokenize, on a vocabulary the test trains on the tokenizer corpus: merges
across U+2581 (no word pre-split), byte fallback for characters left out, newline runs,
control tokens, BOS forced on."""
from __future__ import annotations

import functools
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fucina.errors import TokenizerError
from fucina.text.tokenizer import StreamDecoder, Tokenizer

CORPUS = Path(__file__).parent / "data" / "tokenizer" / "corpus"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<mask>"]
SP = "\u2581"


def _train(text: str, n_merges: int) -> tuple[list[str], list[str]]:
    """A toy BPE over the newline-free runs of `text` (spaces escaped): the tokens (chars
    seen 3+ times, then every merge) and the merges, most frequent pair first."""
    runs = [list(r) for r in text.replace(" ", SP).split("\n") if r]
    chars = Counter(c for r in runs for c in r)
    keep = sorted(c for c, k in chars.items() if k >= 3)
    tokens, merges = list(keep), []
    for _ in range(n_merges):
        pairs = Counter(p for r in runs for p in zip(r, r[1:]))
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        for r in runs:
            i = 0
            while i < len(r) - 1:
                if r[i] == a and r[i + 1] == b:
                    r[i:i + 2] = [a + b]
                i += 1
    return tokens, merges


def _corpus() -> str:
    return "".join(p.read_text("utf-8")[:1500] for p in sorted(CORPUS.glob("*.txt")))


@functools.cache
def _trained() -> tuple[tuple[str, ...], tuple[str, ...]]:
    tokens, merges = _train(_corpus(), 300)
    return tuple(tokens), tuple(merges)


def gemma4_meta() -> dict:
    tokens, merges = map(list, _trained())
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = SPECIALS + byte_tokens + ["\n", "\n\n", "\n\n\n"] + [t for t in dict.fromkeys(tokens)
                                                                  if t not in ("\n",)]
    types = [3] * len(SPECIALS) + [6] * 256 + [1] * (len(vocab) - len(SPECIALS) - 256)
    return {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": vocab,
            "tokenizer.ggml.token_type": np.array(types, dtype=np.int32), "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": False}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(gemma4_meta())


def test_spaces_escaped_and_merged_across_words(tok):
    ids = tok.encode("the the", add_special=False)
    pieces = [tok.token_text(i) for i in ids]
    assert "".join(pieces) == f"the{SP}the"
    assert "e" + SP in pieces                               # a merge spans the escaped space
    assert tok.decode(ids) == "the the"


def test_bos_forced_and_specials(tok):
    assert tok.add_bos and tok.bos_id == 2                 # llama.cpp overrides add_bos_token false
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert ids[0] == 2 and ids[1] == 4 and ids[-1] == 5
    assert tok.is_eog(1) and tok.is_eog(5)


def test_byte_fallback_round_trips(tok):
    text = "naïve 日本 \U0001F600"                          # characters the vocab lacks
    ids = tok.encode(text, add_special=False)
    assert any(7 <= i < 7 + 256 for i in ids)
    assert tok.decode(ids) == text
    sd = StreamDecoder(tok)
    assert "".join(sd.push(i) for i in ids) + sd.flush() == text


def test_newline_runs(tok):
    nl3 = tok.token_id("\n\n\n")
    assert tok.encode("a\n\n\nb", add_special=False)[1] == nl3
    assert tok.decode(tok.encode("x\n\n\n\n\ny", add_special=False)) == "x\n\n\n\n\ny"


def test_merges_required():
    meta = gemma4_meta()
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata(meta)


def _write_vocab_model(path: Path) -> str:
    """A tiny gemma4 model file carrying the vocabulary (llama-tokenize loads the model's
    vocabulary from it)."""
    import gguf
    from synth_gemma4 import write_gemma4
    meta = gemma4_meta()
    src = path.with_suffix(".vocab.gguf")
    w = gguf.GGUFWriter(str(src), "gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return write_gemma4(path, layers=2, hidden=64, head_dim=32, ple=0, vocab=str(src))


@pytest.mark.slow
@pytest.mark.oracle
def test_live_oracle(oracle, tmp_path):
    from oracle import run
    model = _write_vocab_model(tmp_path / "g4tok.gguf")
    tok = Tokenizer.from_gguf(model)
    texts = [p.read_text("utf-8") for p in sorted(CORPUS.glob("*.txt"))]
    rng = random.Random(4)
    pieces = []
    for _ in range(60):
        t = rng.choice(texts)
        a = rng.randrange(len(t))
        pieces.append(t[a:a + rng.randint(1, 200)])
    cases = ["".join(pieces), "the the  the\tthe\n\nthe", " leading", "trailing  ", "\n\n\n\n", "naïve 日本 \U0001F600",
             "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"] + texts
    for i, text in enumerate(cases):
        path = tmp_path / f"t{i}.txt"
        path.write_text(text, "utf-8")
        for flags, kw in (((), {}), (("--no-bos", "--no-parse-special"),
                                     dict(add_special=False, parse_special=False))):
            out = run("llama-tokenize", "-m", model, "-f", str(path), "--ids", "--log-disable", "--no-escape", *flags)
            want = json.loads(out.strip().splitlines()[-1])
            assert tok.encode(text, **kw) == want, (i, flags, text[:60])
