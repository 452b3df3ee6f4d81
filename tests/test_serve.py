"""The server end to end: live uvicorn servers on free loopback ports, driven by the
official `openai` and `anthropic` clients (and raw httpx where a client would hide
what is tested).

Two kinds of server:
- `real`: the default model (SmolLM2-135M-Instruct Q4_1), greedy, small max_tokens;
  it also does one real tool round trip (a forced tool choice: SmolLM2 writes the
  arguments itself, then answers from the tool's result).
- `scripted`: the same tokenizer and a Qwen-style hermes chat template over a
  scripted model whose logits force a fixed reply per prompt, so tool calling,
  reasoning, batching, disconnects and the queue bound are tested deterministically
  through the whole stack (template render, tokenizer, sampler, parser, dialects).
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
uvicorn = pytest.importorskip("uvicorn")

from fucina.serve import Engine, Server  # noqa: E402
from fucina.text.chat_template import ChatTemplate  # noqa: E402
from live_server import free_port, live  # noqa: E402,F401  (others import them from here)

GEN = dict(temperature=0, max_tokens=8)
T0 = {"temperature": 0}   # the anthropic SDK no longer has sampling arguments


# -- live servers ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def threads_one():
    import fucina.kernels as kernels

    before = kernels.get_threads()
    kernels.set_threads(1)        # predictable on a busy 2-core machine
    yield
    kernels.set_threads(before)


@pytest.fixture(scope="module")
def llm(smollm2_path, threads_one):
    from fucina.text.api import load

    return load(smollm2_path, n_ctx=1024)


@pytest.fixture(scope="module")
def real(llm):
    server = Server.from_llm(llm, slots=4, batch=3)
    with live(server) as url:
        yield url, server


def oai(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def anth(url, key="none"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def idle(server, timeout=20):
    """Wait until no slot is busy and the queue is empty (no leaked slots)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(s.busy for s in server.engine.pool.slots) and server.scheduler.depth == 0:
            return True
        time.sleep(0.05)
    return False


USER = [{"role": "user", "content": "Write one sentence about the sea."}]


def warm(url, messages=USER, **kw):
    """Leave the prompt in a KV slot first. Greedy output depends on how the prompt was
    prefilled (a fresh prefill and a one-token prefill after a reused prefix round
    differently, as in llama.cpp with cache_prompt), so the requests a test compares
    must both find the prompt warm."""
    oai(url).chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=1, **kw)


# -- real model: OpenAI chat -----------------------------------------------------------

def test_models_and_health(real):
    url, server = real
    ids = [m.id for m in oai(url).models.list().data]
    assert ids == [server.model_id]
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and h["n_ctx"] == 1024 and len(h["slots"]) == 4
    load = httpx.get(url + "/get_load").json()      # what a router's load-aware policy polls
    assert load["load"] == load["num_reqs"] + load["num_waiting_reqs"] and load["load"] >= 0


def test_chat_plain_equals_stream(real):
    url, _ = real
    c = oai(url)
    warm(url)
    plain = c.chat.completions.create(model="anything", messages=USER, **GEN)
    ch = plain.choices[0]
    assert ch.finish_reason == "length" and ch.message.role == "assistant" and ch.message.content
    assert plain.usage.completion_tokens == 8 and plain.usage.prompt_tokens > 10
    pieces, finish, usage = [], None, None
    for chunk in c.chat.completions.create(model="x", messages=USER, stream=True,
                                           stream_options={"include_usage": True}, **GEN):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == ch.message.content
    assert finish == "length"
    assert usage.completion_tokens == 8 and usage.prompt_tokens == plain.usage.prompt_tokens
    # the same prompt again: its prefix comes from a warm KV slot
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1


def test_chat_logprobs(real):
    url, _ = real
    r = oai(url).chat.completions.create(model="x", messages=USER, logprobs=True, top_logprobs=3,
                                         temperature=0, max_tokens=4)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6   # greedy picks the top token
        assert e.top_logprobs[0].token == e.token


def test_chat_stop_sequence(real):
    url, _ = real
    c = oai(url)
    warm(url)
    full = c.chat.completions.create(model="x", messages=USER, temperature=0, max_tokens=12)
    text = full.choices[0].message.content
    words = text.split()
    stop = words[len(words) // 2]
    r = c.chat.completions.create(model="x", messages=USER, temperature=0, max_tokens=12, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]


def test_sampling_seed_reproducible(real):
    url, _ = real
    c = oai(url)
    kw = dict(model="x", messages=USER, temperature=0.9, top_p=0.95, seed=1234, max_tokens=6)
    a = c.chat.completions.create(**kw).choices[0].message.content
    b = c.chat.completions.create(**kw).choices[0].message.content
    assert a == b


# -- real model: completions, responses ---------------------------------------------------

def test_completions_plain_and_stream(real):
    url, _ = real
    c = oai(url)
    c.completions.create(model="x", prompt="The capital of France is", max_tokens=1, temperature=0)
    r = c.completions.create(model="x", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model="x", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True) if ch.choices)
    assert text == r.choices[0].text


def test_responses_plain_and_stream(real):
    url, _ = real
    c = oai(url)
    warm(url)
    r = c.responses.create(model="x", input="Write one sentence about the sea.", max_output_tokens=6,
                           temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6
    deltas, final = [], None
    for ev in c.responses.create(model="x", input="Write one sentence about the sea.", max_output_tokens=6,
                                 temperature=0, stream=True):
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert "".join(deltas) == r.output_text == final.output_text


# -- real model: Anthropic messages --------------------------------------------------------

def test_messages_plain_and_stream(real):
    url, _ = real
    a = anth(url)
    warm(url, [{"role": "system", "content": "Be brief."}, USER[0]])
    m = a.messages.create(model="claude-whatever", max_tokens=8, extra_body=T0, system="Be brief.",
                          messages=[{"role": "user", "content": "Write one sentence about the sea."}])
    assert m.stop_reason == "max_tokens" and m.content[0].type == "text" and m.usage.output_tokens == 8
    with a.messages.stream(model="x", max_tokens=8, extra_body=T0, system="Be brief.",
                           messages=[{"role": "user", "content": "Write one sentence about the sea."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.cache_read_input_tokens > 0


def test_messages_stop_sequence(real):
    url, _ = real
    a = anth(url)
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    warm(url)
    text = a.messages.create(model="x", max_tokens=12, extra_body=T0, messages=msgs).content[0].text
    stop = text.split()[len(text.split()) // 2]
    m = a.messages.create(model="x", max_tokens=12, extra_body=T0, messages=msgs, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


# -- real model: concurrency, disconnects ----------------------------------------------------

def test_six_concurrent_streams(real):
    url, server = real
    c = oai(url)

    def one(i):
        pieces, finish = [], None
        for chunk in c.chat.completions.create(
                model="x", stream=True, temperature=0, max_tokens=6,
                messages=[{"role": "user", "content": f"Count to {i + 3}."}]):
            for ch in chunk.choices:
                pieces.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        return "".join(pieces), finish

    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(one, range(6)))
    assert all(text and finish == "length" for text, finish in results)
    assert idle(server)


def test_disconnect_mid_stream_then_normal_request(real):
    url, server = real
    before = server.engine.stats["cancelled"]
    body = {"model": "x", "stream": True, "temperature": 0, "max_tokens": 400,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data:"):
                    got += 1
                if got >= 3:
                    break
    assert idle(server), "the abandoned stream kept its slot"
    assert server.engine.stats["cancelled"] > before
    r = oai(url).chat.completions.create(model="x", messages=USER, **GEN)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8


def test_prefix_copied_from_a_busy_slot(real):
    """A request sharing a long system prompt with a stream still decoding in another
    slot adopts that slot's KV rows (copied, not prefilled): reported as cached."""
    url, server = real
    import secrets

    system = f"[{secrets.token_hex(4)}] You are a careful assistant who writes plainly. " * 6
    c = oai(url)
    n_sys = len(server.engine.tokenizer.encode(system, add_special=False))
    first = threading.Event()
    out = {}

    def long_one():
        for chunk in c.chat.completions.create(model="x", stream=True, temperature=0, max_tokens=40, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": "Tell me a story."}]):
            if chunk.choices and chunk.choices[0].delta.content:
                first.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                out["finish"] = chunk.choices[0].finish_reason

    t = threading.Thread(target=long_one)
    t.start()
    assert first.wait(60)
    r = c.chat.completions.create(model="x", temperature=0, max_tokens=2, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Say hi."}])
    t.join(60)
    assert out["finish"] == "length"
    assert r.usage.prompt_tokens_details.cached_tokens >= n_sys
    assert idle(server)


def test_cli_serve_subprocess(smollm2_path):
    """`fucina serve` as a user runs it: loopback, --api-key, --allow-host."""
    import os
    import subprocess
    import sys

    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "fucina", "serve", str(smollm2_path), "--port", str(port),
                          "--ctx", "256", "--slots", "1", "--threads", "1", "--api-key", "k",
                          "--allow-host", "localhost", "--allow-host", "127.0.0.1", "--log-level", "warning"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            assert p.poll() is None, p.stderr.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(url + "/health", headers={"Host": "attacker.test"}).status_code == 403
        r = oai(url, "k").chat.completions.create(model="x", messages=USER, temperature=0, max_tokens=2)
        assert r.usage.completion_tokens == 2
    finally:
        p.terminate()
        p.wait(20)


# -- real model: bad input ---------------------------------------------------------------------

def test_bad_inputs_openai(real):
    url, _ = real
    c = oai(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="x", messages=USER, temperature="hot")
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="x", messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="x", messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="x", messages=USER, n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="x", messages=USER, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing").status_code == 404


def test_context_overflow(real):
    url, _ = real
    long = "word " * 1500
    with pytest.raises(openai.BadRequestError) as e:
        oai(url).chat.completions.create(model="x", messages=[{"role": "user", "content": long}], max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as e:
        anth(url).messages.create(model="x", max_tokens=4, messages=[{"role": "user", "content": long}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_bad_inputs_anthropic(real):
    url, _ = real
    r = httpx.post(url + "/v1/messages", json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "'max_tokens' is required"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        anth(url).messages.create(model="x", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert "messages[0].content[0].type" in e.value.body["error"]["message"]


# -- real model: one real tool round trip ---------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_real_model_tool_round_trip(real):
    """SmolLM2 with a forced tool choice: the prompt is primed with the call's head, the
    model writes the arguments, the server parses them back; then the tool's result
    goes in and the model answers in text."""
    url, _ = real
    c = oai(url)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model="x", messages=msgs, tools=[WEATHER_TOOL], temperature=0, max_tokens=24,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)      # the model's own JSON
    assert isinstance(args, dict)
    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r2 = c.chat.completions.create(model="x", messages=msgs, tools=[WEATHER_TOOL], temperature=0, max_tokens=8)
    assert r2.choices[0].message.content and r2.choices[0].finish_reason in ("length", "stop")


# == scripted model: deterministic tool calling, reasoning, batching, queue ========================

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{% continue %}{% endif %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}{{ content }}"
    "{%- for tc in m.tool_calls or [] %}{% if content or not loop.first %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CALL_REPLY = ('<think>\nThe user asks about the weather; I should call the tool.\n</think>\n\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
              '</tool_call>')
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
ANSWER = "<think>\nThe tool said 18.\n</think>\n\nIt is 18 degrees in Paris."
SLOW = " ".join(f"w{i}" for i in range(300))


def script(prompt: str) -> str:
    last = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "<tool_response>" in last:
        return ANSWER
    if "two cities" in last:
        return TWO_CALLS
    if "weather" in last:
        return CALL_REPLY
    if "slow" in last:
        return SLOW
    if "explode" in last:
        raise RuntimeError("scripted failure")
    return "Scripted reply."


class ScriptedModel:
    """The decoder contract with forced logits: after the last assistant opener it
    emits `script(prompt)` token by token, then <|im_end|>."""

    def __init__(self, real_model, tokenizer, delay: float = 0.0):
        self.config, self.tok, self.delay = real_model.config, tokenizer, delay
        self.init_cache, self.kv_geometry = real_model.init_cache, real_model.kv_geometry
        self.gguf = real_model.gguf
        self.opener = tokenizer.encode("<|im_start|>assistant\n", add_special=False, parse_special=True)
        self.end = tokenizer.token_id("<|im_end|>")
        self.seqs: dict[int, list[int]] = {}
        self.targets: dict[str, list[int]] = {}

    def forward_step(self, cache, tokens, pos0):
        seq = self.seqs.setdefault(id(cache), [])
        del seq[pos0:]
        seq.extend(int(t) for t in tokens)
        cache.advance(len(tokens))
        if self.delay:
            time.sleep(self.delay)
        n = len(self.opener)
        k = max((i for i in range(len(seq) - n + 1) if seq[i:i + n] == self.opener), default=-1)
        logits = torch.full((self.config.n_vocab,), -1e4)
        if k < 0:
            logits[self.end] = 0
            return logits
        prompt = self.tok.decode(seq[:k])
        if prompt not in self.targets:
            self.targets[prompt] = self.tok.encode(script(prompt), add_special=False, parse_special=True) + [self.end]
        target = self.targets[prompt]
        at = len(seq) - (k + n)
        logits[target[at] if at < len(target) else self.end] = 0
        return logits


def scripted_server(llm, *, delay=0.0, batch=2, **kw) -> Server:
    model = ScriptedModel(llm.model, llm.tokenizer, delay)
    template = ChatTemplate(QWEN_STYLE, bos_token="", eos_token="<|im_end|>")
    engine = Engine(model, llm.tokenizer, template, n_ctx=1024, slots=batch, batch=batch, name="scripted-qwen")
    return Server(engine, **kw)


KEY = "s3cret"


@pytest.fixture(scope="module")
def scripted(llm):
    server = scripted_server(llm, api_key=KEY, allow_hosts=["127.0.0.1", "localhost"])
    with live(server) as url:
        yield url, server


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_scripted_tool_round_trip_openai_plain(scripted):
    url, _ = scripted
    c = oai(url, KEY)
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER_TOOL], temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    assert ch.message.model_extra["reasoning_content"] == "The user asks about the weather; I should call the tool."
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    msgs = ASK + [ch.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "18"}]
    r2 = c.chat.completions.create(model="x", messages=msgs, tools=[WEATHER_TOOL], temperature=0)
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "It is 18 degrees in Paris."
    assert r2.choices[0].message.model_extra["reasoning_content"] == "The tool said 18."
    assert r2.usage.prompt_tokens_details.cached_tokens > 0      # the history's prefix was warm


def test_scripted_tool_round_trip_openai_stream(scripted):
    url, _ = scripted
    c = oai(url, KEY)
    plain = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "weather in two cities"}],
                                      tools=[WEATHER_TOOL], temperature=0)
    calls: dict[int, dict] = {}
    n_arg_deltas, finish = 0, None
    for chunk in c.chat.completions.create(model="x", messages=[{"role": "user", "content": "weather in two cities"}],
                                           tools=[WEATHER_TOOL], temperature=0, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    slot["id"] = d.id
                if d.function and d.function.name:
                    slot["name"] = d.function.name
                if d.function and d.function.arguments:
                    slot["arguments"] += d.function.arguments
                    n_arg_deltas += 1
    assert finish == "tool_calls"
    assert n_arg_deltas > 2, "arguments should stream in pieces"
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    want = [(t.function.name, json.loads(t.function.arguments)) for t in plain.choices[0].message.tool_calls]
    assert got == want == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(v["id"].startswith("call_") for v in calls.values())


def test_scripted_parallel_tool_calls_false_stops_after_one(scripted):
    url, _ = scripted
    r = oai(url, KEY).chat.completions.create(model="x", messages=[{"role": "user", "content": "weather in two cities"}],
                                              tools=[WEATHER_TOOL], temperature=0, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


def test_scripted_tool_round_trip_anthropic(scripted):
    url, _ = scripted
    a = anth(url, KEY)
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    m = a.messages.create(model="x", max_tokens=200, extra_body=T0, tools=[tool], messages=ASK)
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    use = m.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "unit": "celsius"}
    assert use.id.startswith("toolu_")
    with a.messages.stream(model="x", max_tokens=200, extra_body=T0, tools=[tool], messages=ASK) as s:
        json_deltas = sum(1 for ev in s if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta")
        final = s.get_final_message()
    assert json_deltas > 2
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == use.input and final.content[0].thinking == m.content[0].thinking
    msgs = ASK + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18"}]}]
    m2 = a.messages.create(model="x", max_tokens=200, extra_body=T0, tools=[tool], messages=msgs)
    assert m2.stop_reason == "end_turn"
    assert [b.type for b in m2.content] == ["thinking", "text"]
    assert m2.content[1].text == "It is 18 degrees in Paris."


def test_scripted_tool_round_trip_responses(scripted):
    url, _ = scripted
    c = oai(url, KEY)
    tool = {"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": WEATHER_TOOL["function"]["parameters"]}
    r = c.responses.create(model="x", input="What is the weather in Paris?", tools=[tool], temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    args, done = "", None
    for ev in c.responses.create(model="x", input="What is the weather in Paris?", tools=[tool], temperature=0,
                                 stream=True):
        if ev.type == "response.function_call_arguments.delta":
            args += ev.delta
        elif ev.type == "response.completed":
            done = ev.response
    assert args == calls[0].arguments
    assert [o.type for o in done.output] == [o.type for o in r.output] == ["reasoning", "function_call"]
    r2 = c.responses.create(model="x", tools=[tool], temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18"}])
    assert r2.output_text == "It is 18 degrees in Paris."


def test_auth_and_host_guard(scripted):
    url, _ = scripted
    with pytest.raises(openai.AuthenticationError):
        oai(url, "wrong").models.list()
    with pytest.raises(anthropic.AuthenticationError) as e:
        anth(url, "wrong").messages.create(model="x", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200                       # open, no key
    r = httpx.get(url + "/health", headers={"Host": "evil.example:8080"})
    assert r.status_code == 403
    r = httpx.get(url + "/v1/models", headers={"Host": "localhost:1234", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200


@pytest.fixture(scope="module")
def slow(llm):
    server = scripted_server(llm, delay=0.01, batch=2, max_queue=1)
    with live(server) as url:
        yield url, server


def test_batch_stream_disconnect_is_isolated(slow):
    """Two streams decode in lockstep; one client vanishes, the other finishes whole."""
    url, server = slow
    body = {"model": "x", "stream": True, "temperature": 0, "max_tokens": 60,
            "messages": [{"role": "user", "content": "slow please"}]}
    out, started = {}, threading.Event()

    def keep():
        chunks = []
        for ch in oai(url).chat.completions.create(**body):   # the server answers once it is decoding
            started.set()
            chunks += [ch] if ch.choices else []
        out["text"] = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        out["finish"] = chunks[-1].choices[0].finish_reason

    t = threading.Thread(target=keep)
    t.start()
    assert started.wait(30)          # taken by the worker: the queue (bound 1) is free again
    with httpx.Client(timeout=30) as h, h.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    t.join(60)
    assert out["finish"] == "length" and SLOW.startswith(out["text"]) and len(out["text"]) > 60
    assert idle(server)


def test_queue_full_is_429_with_retry_after(slow):
    url, server = slow
    body = {"model": "x", "temperature": 0, "max_tokens": 80, "messages": [{"role": "user", "content": "slow"}]}

    def post(_):
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)

    with ThreadPoolExecutor(8) as ex:        # 2 decoding + 1 waiting; the rest are refused
        rs = list(ex.map(post, range(8)))
    codes = sorted(r.status_code for r in rs)
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    refused = next(r for r in rs if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    ok = next(r for r in rs if r.status_code == 200).json()
    assert ok["choices"][0]["finish_reason"] == "length" and ok["usage"]["completion_tokens"] == 80
    assert idle(server)


def test_failure_is_isolated_and_in_schema(slow):
    """A request whose forward fails gets a 500 in its dialect's schema (plain and
    streamed, before the first byte) while a stream decoding beside it finishes."""
    url, server = slow
    bad = [{"role": "user", "content": "explode"}]
    out, started = {}, threading.Event()

    def keep():
        chunks = []
        for ch in oai(url).chat.completions.create(model="x", stream=True, temperature=0, max_tokens=100,
                                                   messages=[{"role": "user", "content": "slow"}]):
            started.set()
            chunks += [ch] if ch.choices else []
        out["finish"] = chunks[-1].choices[0].finish_reason

    t = threading.Thread(target=keep)
    t.start()
    assert started.wait(30)
    with pytest.raises(openai.InternalServerError) as e:
        oai(url).chat.completions.create(model="x", messages=bad, temperature=0, max_tokens=4)
    assert e.value.body["type"] == "server_error" and "scripted failure" in e.value.body["message"]
    with pytest.raises(openai.InternalServerError):
        list(oai(url).chat.completions.create(model="x", messages=bad, temperature=0, max_tokens=4, stream=True))
    with pytest.raises(anthropic.InternalServerError) as e:
        anth(url).messages.create(model="x", max_tokens=4, messages=bad)
    assert e.value.body["error"]["type"] == "api_error"
    t.join(60)
    assert out["finish"] == "length"
    assert idle(server)
    assert server.engine.stats["failed"] >= 3


def test_count_tokens_and_completion_extras(real):
    url, server = real
    n = anth(url).messages.count_tokens(model="x", messages=[{"role": "user", "content": "Hello there"}])
    assert n.input_tokens > 3
    c = oai(url)
    r = c.completions.create(model="x", prompt="One, two,", max_tokens=3, temperature=0, echo=True, logprobs=2)
    ch = r.choices[0]
    assert ch.text.startswith("One, two,")
    assert len(ch.logprobs.tokens) == 3 and all(len(t) == 2 for t in ch.logprobs.top_logprobs)
    assert "".join(ch.logprobs.tokens) == ch.text[len("One, two,"):]


def test_langchain_tool_round_trip(scripted):
    """LangChain's ChatOpenAI, plain and streaming, against the hermes server."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = lc.ChatOpenAI(base_url=scripted[0] + "/v1", api_key=KEY, model="x", temperature=0, max_retries=0)
    bound = llm.bind_tools([WEATHER_TOOL])
    ai = bound.invoke([HumanMessage("What is the weather in Paris?")])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert ai.tool_calls[0]["args"] == {"city": "Paris", "unit": "celsius"}
    acc = None
    for chunk in bound.stream([HumanMessage("What is the weather in Paris?")]):
        acc = chunk if acc is None else acc + chunk
    assert [(c["name"], c["args"]) for c in acc.tool_calls] == [(c["name"], c["args"]) for c in ai.tool_calls]
    final = bound.invoke([HumanMessage("What is the weather in Paris?"), ai,
                          ToolMessage("18", tool_call_id=ai.tool_calls[0]["id"])])
    assert final.content == "It is 18 degrees in Paris."


def test_stalled_client_does_not_block_others(slow):
    """A client that opens a stream and stops reading holds only its own response:
    the worker keeps decoding into that request's queue and serves the next one."""
    url, server = slow
    body = {"model": "x", "stream": True, "temperature": 0, "max_tokens": 200,
            "messages": [{"role": "user", "content": "slow"}]}
    with httpx.Client(timeout=30) as h, h.stream("POST", url + "/v1/chat/completions", json=body) as stalled:
        assert stalled.status_code == 200          # headers read; the body is never read
        t0 = time.time()
        r = oai(url).chat.completions.create(model="x", temperature=0, max_tokens=5,
                                             messages=[{"role": "user", "content": "hello"}])
        assert r.choices[0].message.content == "Scripted reply." and time.time() - t0 < 20
    assert idle(server)
