"""Speculation through the server: serve --spec, a request's `speculative`, OpenAI
Predicted Outputs (usage.completion_tokens_details), a speculative stream beside a
plain one under --batch. Same replies as the plain server, token for token."""
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from fucina.serve import Engine, Server  # noqa: E402
from fucina.text.chat_template import ChatTemplate  # noqa: E402
from fucina.text.speculative import Speculation  # noqa: E402
from test_chat_support import FakeTokenizer, ScriptedDecoder, tiny_llama  # noqa: E402
from test_serve import live  # noqa: E402

CHATML = ChatTemplate.builtin("chatml", bos_token="<s>", eos_token="</s>")
ASK = [{"role": "user", "content": "say abc abc abc abc"}]
SCRIPT = "The quick brown fox jumps over the lazy dog, twice."


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    model = tiny_llama(str(tmp_path_factory.mktemp("specserve")))
    servers = [Server(Engine(model, FakeTokenizer(), CHATML, n_ctx=256, slots=2, batch=2, spec=spec))
               for spec in (False, True)]
    scripted = Server(Engine(ScriptedDecoder(SCRIPT), FakeTokenizer(), CHATML, n_ctx=256))
    with live(servers[0]) as plain, live(servers[1]) as spec, live(scripted) as fixed:
        yield plain, spec, servers[1], fixed


@pytest.fixture(autouse=True)
def exact(monkeypatch):
    monkeypatch.setattr(Speculation, "pin_rows_default", True)


def chat(url, **kw):
    body = {"model": "m", "messages": ASK, "max_tokens": 24, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    return r.status_code, r.json()


def test_serve_spec_equals_plain_and_predicted_outputs(urls):
    plain, spec, server, fixed = urls
    for kw in ({}, {"temperature": 0.9, "seed": 3}, {"speculative": False}):
        assert chat(spec, **kw)[1]["choices"][0]["message"]["content"] == \
            chat(plain, **kw)[1]["choices"][0]["message"]["content"]
    text = chat(plain)[1]["choices"][0]["message"]["content"]
    assert chat(plain, prediction={"type": "content", "content": text})[1]["choices"][0]["message"][
        "content"] == text
    # a prediction on a server without --spec: the edited reply differs from it in one word
    predicted = SCRIPT.replace("lazy", "sleepy")
    code, got = chat(fixed, prediction={"type": "content", "content": predicted}, max_tokens=64)
    assert code == 200 and got["choices"][0]["message"]["content"] == SCRIPT
    details = got["usage"]["completion_tokens_details"]
    # while aligned every pass drafts from the prediction; a pass's bonus token is not a draft,
    # and the draft length follows the (timed) cost gate: at least half the shared prefix
    assert details["accepted_prediction_tokens"] >= len("The quick brown fox jumps over the ") // 2
    assert details["rejected_prediction_tokens"] > 0
    parts = {"type": "content", "content": [{"type": "text", "text": SCRIPT[:5]}, {"type": "text", "text": SCRIPT[5:]}]}
    got = chat(fixed, prediction=parts, max_tokens=64)[1]
    assert got["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] == 0
    assert "completion_tokens_details" not in chat(spec)[1]["usage"]
    code, err = chat(spec, prediction={"type": "image", "content": "x"})
    assert code == 400 and "prediction.type" in err["error"]["message"]
    r = httpx.post(spec + "/v1/completions", json={"prompt": "abc abc abc", "max_tokens": 16,
                                                   "temperature": 0}, timeout=60)
    q = httpx.post(plain + "/v1/completions", json={"prompt": "abc abc abc", "max_tokens": 16,
                                                    "temperature": 0}, timeout=60)
    assert r.json()["choices"][0]["text"] == q.json()["choices"][0]["text"]
    assert server.engine.pool.slots[0].spec.stats.committed > 0


def test_serve_spec_stream_beside_plain_stream_under_batch(urls):
    plain, spec, _, _ = urls
    want = [chat(plain, seed=s, temperature=0.8)[1]["choices"][0]["message"]["content"] for s in (1, 2)]
    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda a: chat(spec, seed=a[0], temperature=0.8, speculative=a[1]),
                          [(1, True), (2, False)]))
    assert [g[1]["choices"][0]["message"]["content"] for g in got] == want
