import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from oracle import oracle_dir  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VOCAB_DIR = SHARED / "data" / "vocab"


SIZES = {"smollm2": "98 MB", "gemma3": "253 MB"}


def present_model(name: str) -> Path:
    """A packaged model already in the cache ($FUCINA_CACHE or ~/.cache/fucina), for
    tests that should not download: skips when absent."""
    from fucina.models.hub import PACKAGED, cache_dir

    p = cache_dir() / PACKAGED[name].filename
    if not p.exists():
        pytest.skip(f"{name} GGUF not in {cache_dir()} (the slow tests fetch it)")
    return p


def cached_model(name: str, announce=print) -> Path | None:
    """A packaged real model from the user cache, fetched on demand with an announcement
    (None if impossible)."""
    from fucina.errors import FucinaError
    from fucina.models.hub import PACKAGED, cache_dir, pull

    if not (cache_dir() / PACKAGED[name].filename).exists():
        announce(f"fucina tests: downloading the {name} GGUF ({SIZES.get(name, '?')}) into {cache_dir()} "
                 f"(set FUCINA_CACHE to put it elsewhere; -m 'not slow' skips the tests that need it)")
    try:
        return pull(PACKAGED[name], log=announce)
    except FucinaError:
        return None


def _model_fixture(name: str):
    @pytest.fixture(scope="session")
    def path(pytestconfig):
        reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
        say = (lambda s: reporter.write_line(s)) if reporter is not None else print
        p = cached_model(name, say)
        if p is None:
            pytest.skip(f"{name} GGUF unavailable")
        return p
    return path


smollm2_path = _model_fixture("smollm2")
gemma3_path = _model_fixture("gemma3")


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


def _isas():
    import fucina.kernels as K
    return K.supported_isas()


@pytest.fixture(params=_isas())
def isa(request):
    """Run a kernel test once per instruction set this CPU supports."""
    import fucina.kernels as K
    before = K.isa()
    K.set_isa(request.param)
    yield request.param
    K.set_isa(before)
