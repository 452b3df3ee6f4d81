"""`n > 1` choices over HTTP (chat and completions, plain and streamed) on a tiny
model: one prompt prefill shared by every choice, one choice per index, usage summed;
and /metrics through the route."""
import json

import pytest
from starlette.testclient import TestClient

from fucina.serve import Server
from fucina.serve.app import create_app
from fucina.serve.engine import Engine
from fucina.text.chat_template import ChatTemplate
from test_chat_support import CHATML, FakeTokenizer, tiny_llama

LONG = [{"role": "user", "content": "Tell me three things about the sea, the wind and the rocks."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    m = tiny_llama(str(tmp_path_factory.mktemp("choices")))
    m.use_native_step = False
    engine = Engine(m, FakeTokenizer(), ChatTemplate(CHATML, eos_token="<|im_end|>"), n_ctx=256, batch=4)
    server = Server(engine)
    with TestClient(create_app(server)) as c:
        yield c, server


def test_chat_n_choices_share_the_prompt(client):
    c, server = client
    before = server.engine.metrics.copied_tokens
    r = c.post("/v1/chat/completions", json={"model": "x", "messages": LONG, "n": 3, "temperature": 0,
                                             "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    texts = {ch["message"]["content"] for ch in body["choices"]}
    assert len(texts) == 1                                # greedy: every choice the same
    p = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 18 and body["usage"]["total_tokens"] == p + 18
    assert server.engine.metrics.copied_tokens - before == 2 * (p - 1)   # the prompt computed once
    r = c.post("/v1/chat/completions", json={"model": "x", "messages": LONG, "n": 17})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_chat_n_choices_streamed(client):
    c, _ = client
    per: dict[int, list[dict]] = {0: [], 1: []}
    with c.stream("POST", "/v1/chat/completions", json={
            "model": "x", "messages": LONG, "n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    for ev in events:
        for ch in ev["choices"]:
            per[ch["index"]].append(ch)
    for i in (0, 1):
        assert per[i][0]["delta"]["role"] == "assistant"
        assert [ch["finish_reason"] for ch in per[i]].count("length") == 1
        assert per[i][-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 10


def test_completions_n_choices(client):
    c, _ = client
    r = c.post("/v1/completions", json={"model": "x", "prompt": "The sea and the rocks and the wind are",
                                        "n": 2, "temperature": 0, "max_tokens": 4})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"]
    assert [x["index"] for x in ch] == [0, 1] and ch[0]["text"] == ch[1]["text"]
    assert r.json()["usage"]["completion_tokens"] == 8
    r = c.post("/v1/completions", json={"model": "x", "prompt": "hi", "n": 2, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_metrics_route(client):
    c, _ = client
    c.post("/v1/chat/completions", json={"model": "x", "messages": LONG, "max_tokens": 2})
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {ln.split("{")[0].split(" ")[0] for ln in r.text.splitlines() if not ln.startswith("#")}
    for want in ("fucina_requests_total", "fucina_queue_depth", "fucina_streams_active",
                 "fucina_generation_tokens_per_second", "fucina_time_to_first_token_seconds_bucket",
                 "fucina_prefix_cache_hit_ratio", "fucina_prompt_tokens_cached_total"):
        assert want in names


def test_each_choice_gets_its_own_processor_and_seed():
    import asyncio

    from fucina.serve.choices import make_turns
    from fucina.serve.engine import GenRequest
    from fucina.serve.prompt import Prompt
    from fucina.text.sampler import SamplingConfig

    made = []

    def fresh():
        made.append(object())
        return made[-1]

    async def build():
        req = GenRequest([1, 2, 3], 4, SamplingConfig(seed=10), processor=fresh())
        return make_turns(None, Prompt("x", [1, 2, 3]), req, 3, fresh)
    turns = asyncio.run(build()).turns
    assert [t.req.sampling.seed for t in turns] == [10, 11, 12]
    assert [t.req.processor for t in turns] == made and len(set(map(id, made))) == 3
