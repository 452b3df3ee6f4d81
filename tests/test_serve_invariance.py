"""Batch invariance at the HTTP level (issue 10's contract, seen by a client).

The same greedy request returns the same tokens, and the same logprobs to the bit, when
it is sent alone, among 4 concurrent requests under `fucina serve --batch 4`, and right
after a request that shares its prefix (its prompt rows then come from the prefix
cache, computed in another prefill split). A live server on loopback drives the whole
stack: dialect, scheduler, ragged batch passes, the native layer step, the sampler.
The fast variant runs a tiny synthetic model; the slow one SmolLM2.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import fucina.kernels as kernels
import fucina.serve.engine as engine_mod
from fucina.serve import Server
from synth import write_model
from live_server import live

pytestmark = pytest.mark.skipif(not kernels.batch_invariant(),
                                reason="needs the native kernels on their canonical (batch-invariant) route")

GEN = 12


def prompt(seed: int, n: int, n_vocab: int) -> list[int]:
    return [(seed * 37 + 11 * j) % (n_vocab - 2) + 1 for j in range(n)]


class PassSpy:
    """Records how many streams each batch pass carried; a short pause per pass keeps
    a tiny model's requests in flight long enough to share passes."""

    def __init__(self, monkeypatch, pause: float):
        self.widths: list[int] = []
        real = engine_mod.ragged_step

        def spy(model, caches, tokens, want):
            self.widths.append(len(caches))
            time.sleep(pause)
            return real(model, caches, tokens, want)
        monkeypatch.setattr(engine_mod, "ragged_step", spy)


def complete(url: str, ids: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": ids, "max_tokens": GEN, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    return {"text": c["text"], "tokens": c["logprobs"]["tokens"], "logprobs": c["logprobs"]["token_logprobs"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def same(a: dict, b: dict) -> bool:
    return (a["text"], a["tokens"], a["logprobs"]) == (b["text"], b["tokens"], b["logprobs"])


def check_invariance(llm, monkeypatch, *, pause: float, prefix_len: int, tail_len: int):
    n_vocab = llm.tokenizer.n_vocab
    target = prompt(1, prefix_len + tail_len, n_vocab)
    sharer = target[:prefix_len] + prompt(2, tail_len + 3, n_vocab)   # same prefix, other tail
    others = [prompt(10 + k, 5 + 9 * k, n_vocab) for k in range(3)]

    def fresh():
        return live(Server.from_llm(llm, slots=4, batch=4))

    with fresh() as url:                               # alone, on a cold server
        alone = complete(url, target)
    assert len(alone["tokens"]) == GEN and alone["cached"] == 0

    spy = PassSpy(monkeypatch, pause)
    with fresh() as url:                               # among 4 concurrent requests
        gate = threading.Barrier(4)

        def send(ids):
            gate.wait()
            return complete(url, ids)
        with ThreadPoolExecutor(4) as pool:
            crowd = list(pool.map(send, [others[0], target, others[1], others[2]]))
    assert max(spy.widths) >= 2, f"the requests never shared a batch pass: {spy.widths}"
    assert same(crowd[1], alone), (crowd[1], alone)

    with fresh() as url:                               # after a request sharing its prefix
        complete(url, sharer)
        reused = complete(url, target)
    assert reused["cached"] >= prefix_len - 1, reused["cached"]
    assert same(reused, alone), (reused, alone)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = kernels.get_threads()
    kernels.set_threads(1)         # an OpenMP team on a busy 2-core box: seconds of spinning
    yield
    kernels.set_threads(before)


@pytest.fixture(scope="module")
def synth_llm(tmp_path_factory):
    from fucina.text.api import load

    path = write_model(tmp_path_factory.mktemp("inv") / "m.gguf", "llama", hidden=64, heads=4, kv_heads=2,
                       head_dim=16, layers=2, tied=False,
                       qtype=pytest.importorskip("gguf").GGMLQuantizationType.Q8_0)
    return load(path, n_ctx=256)


def test_greedy_request_same_alone_batched_and_after_prefix_reuse(synth_llm, monkeypatch):
    check_invariance(synth_llm, monkeypatch, pause=0.004, prefix_len=40, tail_len=7)


@pytest.mark.slow
def test_greedy_request_same_alone_batched_and_after_prefix_reuse_smollm2(smollm2_path, monkeypatch):
    from fucina.text.api import load

    check_invariance(load(smollm2_path, n_ctx=512), monkeypatch, pause=0.0, prefix_len=48, tail_len=9)
