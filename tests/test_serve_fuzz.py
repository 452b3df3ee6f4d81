"""The server's request parser under hostile bodies: hypothesis-generated JSON (and
mutations of valid requests) on every route, plus nesting-depth and size limits.
Whatever arrives, the answer is a 2xx or a 4xx in the route's own error schema:
never a 500, never a hang. In-process (Starlette's TestClient) over a tiny model."""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from fucina.serve import Server, create_app  # noqa: E402
from fucina.serve.app import MAX_BODY, MAX_DEPTH  # noqa: E402
from fucina.text.api import load  # noqa: E402
from synth import write_model  # noqa: E402

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
          "/v1/messages/count_tokens", "/chat/completions", "/completions", "/messages"]

VALID = {
    "/v1/chat/completions": {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"model": "x", "prompt": "hi", "max_tokens": 3},
    "/v1/responses": {"model": "x", "input": "hi", "max_output_tokens": 3},
    "/v1/messages": {"model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "x", "messages": [{"role": "user", "content": "hi"}]},
}
FIELDS = ["model", "messages", "prompt", "input", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stream", "n", "logprobs", "top_logprobs", "tools",
          "tool_choice", "response_format", "stream_options", "system", "stop_sequences", "thinking",
          "instructions", "repeat_penalty", "frequency_penalty", "echo", "parallel_tool_calls", "content",
          "role", "type", "text"]

scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | \
    st.text(max_size=20) | st.sampled_from(["user", "assistant", "system", "tool", "text", "function",
                                            "required", "any", "auto", "none", "tool_use", "hi"])
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) |
                      st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), kids, max_size=5),
                      max_leaves=20)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    llm = load(write_model(tmp_path_factory.mktemp("fuzz") / "tiny.gguf", "llama"), n_ctx=128)
    server = Server.from_llm(llm, slots=1)
    with TestClient(create_app(server), raise_server_exceptions=False) as c:
        yield c


def post(client, route, body: bytes, **headers):
    t = time.perf_counter()
    r = client.post(route, content=body, headers={"content-type": "application/json", **headers})
    took = time.perf_counter() - t
    assert r.status_code < 500, (route, body[:300], r.status_code, r.text[:300])
    assert took < 30, (route, body[:300], took)
    if r.status_code >= 400:
        err = r.json()
        if route.removeprefix("/v1").startswith("/messages"):
            assert err["type"] == "error" and err["error"]["message"]
        else:
            assert err["error"]["message"] and err["error"]["type"]
    return r


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), body=values)
def test_random_json_bodies_never_500(client, route, body):
    post(client, route, json.dumps(body).encode())


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(sorted(VALID)), key=st.sampled_from(FIELDS), value=values,
       drop=st.sampled_from([None, "messages", "prompt", "input", "max_tokens"]))
def test_mutated_valid_bodies_never_500(client, route, key, value, drop):
    body = dict(VALID[route])
    body[key] = value
    if drop:
        body.pop(drop, None)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body.get("max_tokens"), bool):
        body["max_tokens"] = min(body["max_tokens"], 8)      # keep generation short
    post(client, route, json.dumps(body).encode())


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=200))
def test_raw_bytes_never_500(client, route, raw):
    post(client, route, raw)


@pytest.mark.parametrize("route", ROUTES)
def test_deep_nesting_is_a_400_on_every_route(client, route):
    for body in (b"[" * 5000, b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
                 json.dumps({"messages": [{"role": "user", "content": "hi"}],
                             "tools": [{"x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}]}).encode()):
        r = post(client, route, body)
        assert r.status_code == 400
    ok = [[1]] * 2
    for _ in range(MAX_DEPTH - 4):
        ok = [ok]
    assert post(client, route, json.dumps({"junk": ok}).encode()).status_code != 500


def test_size_limit_is_a_413_before_reading(client):
    r = client.post("/v1/chat/completions", content=b" " * 16,
                    headers={"content-type": "application/json", "content-length": str(MAX_BODY + 1)})
    assert r.status_code == 413
    big = b'{"messages": "' + b"x" * (MAX_BODY + 10) + b'"}'
    r = client.post("/v1/messages", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["type"] == "error"


def test_non_finite_numbers_are_400_naming_the_field(client):
    for v in ("NaN", "Infinity", "-Infinity"):
        body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": ' + v.encode() + b"}"
        r = post(client, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
