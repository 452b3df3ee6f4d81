"""Perplexity as llama-perplexity computes it, within 1% of llama.cpp's figure.

The text is the first 14 kB of the GPL-3 (real English prose, ~3k tokens: 5 chunks of
512). llama-perplexity's figures on it (b11434, `-c 512 -t 2`) are committed below.
"""
from pathlib import Path

import pytest

from fucina.models import load_model
from fucina.text.evaluate import perplexity
from fucina.text.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "ppl.txt"
LLAMA_PPL = {"smollm2": 18.3746, "gemma3": 14.9187}


def _ours(path):
    model = load_model(path)
    tok = Tokenizer.from_metadata(model.gguf.metadata)
    ids = tok.encode(TEXT.read_text(), add_special=True, parse_special=False)
    ppl, chunks = perplexity(model, ids, 512, tok.bos_id if tok.add_bos else None)
    assert chunks == 5
    return ppl


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_perplexity_matches_llama_cpp(request, name):
    path = request.getfixturevalue(f"{name}_path")
    ours = _ours(path)
    ref = LLAMA_PPL[name]
    assert abs(ours / ref - 1) < 0.01, (ours, ref)


def test_perplexity_needs_two_contexts():
    from fucina.errors import FucinaError

    with pytest.raises(FucinaError, match="at least"):
        perplexity(None, list(range(100)), 512, None)
