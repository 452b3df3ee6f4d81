"""`fucina serve` on a text-diffusion model: a live server over a tiny random-weight dream
GGUF written in-process; its replies against the Python API's for the same settings."""
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from fucina.serve import Server  # noqa: E402
from fucina.serve.prompt import render_chat  # noqa: E402
from live_server import live  # noqa: E402
from synth import write_model  # noqa: E402

GEOMETRY = dict(layers=2, hidden=128, heads=8, kv_heads=4, head_dim=16)
# a block schedule: the reply streams block by block
SETTINGS = {"diffusion_steps": 24, "diffusion_block_length": 16, "canvas": 64, "seed": 9, "temperature": 0.8,
            "top_k": 40, "top_p": 0.95}
API = dict(steps=24, block_length=16, canvas=64, seed=9, temperature=0.8, top_k=40, top_p=0.95)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import fucina
    path = write_model(tmp_path_factory.mktemp("dream") / "dream.gguf", "dream", **GEOMETRY)
    llm = fucina.load(path)
    server = Server.from_llm(llm)
    with live(server) as url:
        yield url, server, llm


def _sse(r) -> list[dict]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_completions_equal_the_api_and_stream_by_block(served):
    url, _, llm = served
    ids = llm.tokenizer.encode("abc", add_special=True, parse_special=True)
    want = llm.generate(ids, **API)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, **SETTINGS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == want
    assert body["usage"]["completion_tokens"] == len(llm.last.tokens)
    assert body["choices"][0]["finish_reason"] == ("stop" if llm.last.finish_reason == "stop" else "length")
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": ids, "stream": True, **SETTINGS},
                      timeout=60) as r:
        chunks = [c["choices"][0]["text"] for c in _sse(r) if c.get("choices")]
    pieces = [c for c in chunks if c]
    assert "".join(pieces) == want
    assert 2 <= len(pieces) <= 5      # a piece per committed block (4 of 16), + a held-back character


def test_chat_and_messages_equal_the_api(served):
    url, server, llm = served
    msgs = [{"role": "user", "content": "hello"}]
    ids = render_chat(server.engine, msgs).ids
    want = llm.generate(ids, **API)
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, **SETTINGS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"messages": msgs, "stream": True, **SETTINGS},
                      timeout=60) as r:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in _sse(r) if c.get("choices"))
    assert text == want
    r = httpx.post(f"{url}/v1/messages", json={"messages": msgs, "max_tokens": 32, **SETTINGS}, timeout=60)
    assert r.status_code == 200, r.text
    assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == want


def test_max_tokens_sizes_the_canvas_as_the_api_does(served):
    url, _, llm = served
    ids = llm.tokenizer.encode("abc", add_special=True, parse_special=True)
    want = llm.generate(ids, 12, steps=8, seed=4, top_k=1)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 12, "diffusion_steps": 8,
                                                  "seed": 4, "top_k": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want


@pytest.mark.parametrize("field,value", [("stop", ["x"]), ("min_p", 0.2), ("presence_penalty", 0.5),
                                         ("logprobs", 2), ("grammar", "root ::= \"a\""),
                                         ("diffusion_algorithm", 7), ("diffusion_steps", 0),
                                         ("diffusion_eps", "big"), ("canvas", 100000)])
def test_fields_a_denoiser_cannot_honour_are_400s_naming_them(served, field, value):
    url, _, _ = served
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8, field: value}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_settings_llama_cpp_asserts_on_are_400s(served):
    url, _, _ = served
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "canvas": 60, "diffusion_block_length": 16},
                   timeout=60)
    assert r.status_code == 400 and "multiple of the block length" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/messages", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                               "stop_sequences": ["a"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("'stop_sequences'")


def test_diffusion_fields_on_an_autoregressive_model_are_400s(tmp_path):
    import fucina
    llm = fucina.load(write_model(tmp_path / "ar.gguf", "qwen2"))
    with live(Server.from_llm(llm)) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "diffusion_steps": 8},
                       timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "diffusion_steps"
    assert "not a diffusion model" in r.json()["error"]["message"]


def test_a_diffusion_gemma_server_answers_as_the_api(tmp_path, served):
    import fucina
    from synth_diffusion_gemma import write_diffusion_gemma
    llm = fucina.load(write_diffusion_gemma(tmp_path / "dg.gguf"))
    ids = [2, 40, 41, 42]
    want = llm.generate(ids, 24, seed=3, steps=5, entropy_bound=0.2)
    body = {"prompt": ids, "max_tokens": 24, "seed": 3, "diffusion_steps": 5, "entropy_bound": 0.2}
    with live(Server.from_llm(llm)) as url:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert "".join(c["choices"][0]["text"] for c in _sse(r) if c.get("choices")) == want
        for field, value in (("canvas", 32), ("top_k", 3), ("t_min", "x")):
            r = httpx.post(f"{url}/v1/completions", json={**body, field: value}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    url, _, _ = served          # and the other way: an EB field on a dream server
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8, "entropy_bound": 0.2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "entropy_bound"
