"""gpt-oss's harmony format: the reply parser on strings and at every streaming split,
the built-in template's harmony rules, the stop tokens, the grammars, a Conversation's
history, and the three server dialects end to end over a scripted model that writes
harmony (a tiny random-weight gpt-oss file with a harmony vocabulary gives the tokenizer
and cache; the logits are forced). Oracle: llama-server's /apply-template renders the
same prompts."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch

from fucina.serve.parsing import HarmonyOutputParser, Reasoning, Text, ToolArgs, ToolEnd, ToolStart
from fucina.text import harmony
from fucina.text.chat_template import ChatTemplate
from synth_harmony import write_harmony_vocab

CALL = ('<|channel|>analysis<|message|>The user asks about the weather; I should call the tool.<|end|>'
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris", "unit": "celsius"}')
ANSWER = ('<|channel|>analysis<|message|>The tool said 18.<|end|>'
          '<|start|>assistant<|channel|>final<|message|>It is 18 degrees in Paris.')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
                   "required": ["city"]}}}


# -- the parser -----------------------------------------------------------------------

def _chunked(text: str, n: int) -> list[tuple]:
    s = harmony.HarmonyStream()
    for i in range(0, len(text), n):
        s.feed(text[i:i + n])
    s.finish()
    return s.events


def _joined(events) -> dict:
    out = {"reasoning": "", "content": "", "calls": []}
    for kind, v in events:
        if kind in ("reasoning", "content"):
            out[kind] += v
        elif kind == "call":
            out["calls"].append([v, ""])
        elif kind == "args":
            out["calls"][-1][1] += v
        elif kind == "end_call":
            assert out["calls"][-1][1] == v            # the deltas join to the whole
    return out


@pytest.mark.parametrize("text, want", [
    (ANSWER, {"reasoning": "The tool said 18.", "content": "It is 18 degrees in Paris.", "calls": []}),
    (CALL, {"reasoning": "The user asks about the weather; I should call the tool.", "content": "",
            "calls": [["get_weather", '{"city": "Paris", "unit": "celsius"}']]}),
    # the recipient in the role header, as the template writes calls back; <|call|> in the text
    (' to=functions.now<|channel|>commentary json<|message|> {} \n<|call|>',
     {"reasoning": "", "content": "", "calls": [["now", "{}"]]}),
    # a preamble on commentary is for the user; <|return|> reached the text
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>',
     {"reasoning": "", "content": "Checking.Done.", "calls": []}),
    # a reply without any header is the answer; text that looks like a marker's start is kept
    ("the <|en answer", {"reasoning": "", "content": "the <|en answer", "calls": []}),
    # a message the model writes as another role (a made-up tool result) is dropped
    ('<|channel|>analysis<|message|>a<|end|><|start|>functions.f to=assistant<|channel|>commentary<|message|>"x"'
     '<|end|><|start|>assistant<|channel|>final<|message|>b', {"reasoning": "a", "content": "b", "calls": []}),
    # an empty call body is an empty object; a built-in tool keeps its whole name
    ('<|channel|>analysis to=browser.search<|message|>', {"reasoning": "", "content": "", "calls": [["browser.search", "{}"]]}),
    # a stray commentary channel before the real one (llama.cpp's parser allows it too)
    ('<|channel|>commentary to=assistant<|channel|>analysis<|message|>r<|end|><|start|>assistant'
     '<|channel|>commentary<|channel|>final<|message|>f', {"reasoning": "r", "content": "f", "calls": []}),
    # cut off inside a header: nothing to show
    ('<|channel|>analysis<|message|>hm<|end|><|start|>assist', {"reasoning": "hm", "content": "", "calls": []}),
])
def test_parser_maps_channels_at_every_split(text, want):
    for n in (1, 2, 3, 7, len(text)):
        assert _joined(_chunked(text, n)) == want, n
    p = harmony.split(text)
    assert (p.reasoning, p.content, [list(c) for c in p.calls]) == (want["reasoning"], want["content"], want["calls"])


def test_parser_streams_reasoning_then_content_then_args():
    ev = _chunked(CALL, 4)
    kinds = [k for k, _ in ev]
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert kinds.count("args") > 3 and kinds[-1] == "end_call"
    assert not any("<|" in v for k, v in ev if k != "call")      # markers never leak


def test_header_forms():
    h = harmony.parse_header("<|start|>assistant to=functions.get_weather<|channel|>commentary json")
    assert (h.role, h.channel, h.tool, h.kind) == ("assistant", "commentary", "get_weather", "call")
    h = harmony.parse_header("<|channel|>commentary to=functions.f <|constrain|>json")
    assert (h.channel, h.tool) == ("commentary", "f")
    assert harmony.parse_header("<|start|>assistant<|channel|>analysis").kind == "reasoning"
    assert harmony.parse_header("<|start|>functions.f to=assistant<|channel|>commentary").kind == "drop"


def test_serve_parser_events_and_unsolicited_calls():
    p = HarmonyOutputParser(tools=True, id_prefix="toolu_")
    ev = p.feed(CALL[:60]) + p.feed(CALL[60:]) + p.finish()
    assert isinstance(ev[0], Reasoning) and [type(e) for e in ev[-2:]] == [ToolArgs, ToolEnd]
    start = next(e for e in ev if isinstance(e, ToolStart))
    assert start.name == "get_weather" and start.id.startswith("toolu_") and p.n_tool_calls == 1
    p = HarmonyOutputParser(tools=False)          # no tools declared: a call is dropped, text stays
    ev = p.feed(CALL) + p.finish()
    assert [type(e) for e in ev] == [Reasoning] and p.n_tool_calls == 0
    p = HarmonyOutputParser(tools=True, primed="<|channel|>commentary to=functions.")   # a forced call
    ev = p.feed('get_weather <|constrain|>json<|message|>{"city": "Rome"}') + p.finish()
    assert [type(e) for e in ev][0] is ToolStart and ev[-1].arguments == '{"city": "Rome"}'
    p = HarmonyOutputParser()
    assert [e.text for e in p.feed(ANSWER) + p.finish() if isinstance(e, Text)] == ["It is 18 degrees in Paris."]


# -- the template and the history -------------------------------------------------------

def test_builtin_template_follows_the_harmony_rules():
    t = ChatTemplate.builtin("harmony")
    assert t.format == "harmony" and harmony.is_harmony(t)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "thinking": "Call it.", "tool_calls": [call]},
            {"role": "tool", "content": "18"}]
    text = t.render(msgs, tools=[WEATHER], reasoning_effort="high")
    assert "Reasoning: high" in text and "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert 'type get_weather = (_: {\ncity: string,\nunit?: "celsius" | "kelvin",\n}) => any;' in text
    # the reasoning before a call is kept while no final answer follows; the result is commentary
    assert text.endswith("<|start|>assistant<|channel|>analysis<|message|>Call it.<|end|>"
                         "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                         '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant'
                         '<|channel|>commentary<|message|>"18"<|end|><|start|>assistant')
    later = t.render(msgs + [{"role": "assistant", "content": "18 C.", "thinking": "Answer."},
                             {"role": "user", "content": "Thanks"}], tools=[WEATHER])
    assert "Call it." not in later and "Answer." not in later          # past analysis dropped
    assert "<|start|>assistant<|channel|>final<|message|>18 C.<|end|><|start|>user" in later


def test_effort_levels():
    assert [harmony.effort_level(t, e) for t, e in [(None, "high"), (True, "low"), (False, None), (None, "minimal"),
                                                     (None, None), (True, None), (None, "xhigh")]] == \
        ["high", "low", "low", "low", None, None, None]


def test_history_maps_reasoning_to_thinking():
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    h = harmony.history([{"role": "assistant", "content": "x", "reasoning_content": "r", "tool_calls": [call]},
                         {"role": "assistant", "content": "y", "reasoning_content": "s"},
                         {"role": "user", "content": "z", "reasoning_content": "ignored"}])
    assert h[0] == {"role": "assistant", "thinking": "r", "tool_calls": [call]}
    assert h[1] == {"role": "assistant", "content": "y", "thinking": "s"}
    assert h[2] == {"role": "user", "content": "z"}
    raw = harmony.history([{"role": "assistant", "content": ANSWER}])        # a raw reply sent back
    assert raw == [{"role": "assistant", "content": "It is 18 degrees in Paris.", "thinking": "The tool said 18."}]


@pytest.fixture(scope="module")
def gptoss_path(tmp_path_factory):
    from synth_gptoss import write_gptoss

    d = tmp_path_factory.mktemp("harmony")
    vocab = write_harmony_vocab(d / "vocab.gguf")
    return write_gptoss(d / "g.gguf", vocab=vocab, layers=2, hidden=32, heads=2, kv_heads=1, experts=4, moe_ffn=32)


@pytest.fixture(scope="module")
def llm(gptoss_path):
    from fucina.text.api import load

    return load(gptoss_path, n_ctx=1024)


def test_stop_tokens_end_the_turn_and_end_does_not(llm):
    tok = llm.tokenizer
    assert llm.template.format == "harmony"
    stops = llm.template.stop_ids(tok)
    assert {tok.token_id("<|return|>"), tok.token_id("<|call|>")} <= stops
    assert tok.token_id("<|end|>") not in stops
    # the markers render as text in the reply (the parser reads them)
    assert tok.decode([tok.token_id("<|channel|>"), tok.token_id("<|end|>")]) == "<|channel|><|end|>"


def test_conversation_keeps_channels_apart(llm):
    """A reply goes into the history split by channel: the next turn's prompt has the
    final answer, not the analysis (and the template accepts it)."""
    from fucina.text.conversation import Conversation

    c = Conversation(llm.model, llm.tokenizer, llm.template, max_tokens=4)
    c.messages = [{"role": "user", "content": "Hi"}]
    c.messages.append(c._assistant("<|channel|>analysis<|message|>greet<|end|><|start|>assistant"
                                   "<|channel|>final<|message|>Hello!"))
    assert c.messages[-1] == {"role": "assistant", "content": "Hello!", "thinking": "greet"}
    text = c._render(c.messages + [{"role": "user", "content": "Again"}])
    assert "<|channel|>final<|message|>Hello!<|end|><|start|>user<|message|>Again" in text and "greet" not in text
    m = c._assistant(CALL)
    assert m["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    text = c._render([{"role": "user", "content": "Weather?"}, m, {"role": "tool", "content": "18"}])
    assert text.endswith('{"city": "Paris", "unit": "celsius"}<|call|><|start|>functions.get_weather to=assistant'
                         '<|channel|>commentary<|message|>"18"<|end|><|start|>assistant')   # send_messages' history
    reply = c.send("Hi there")                     # a real (random-weight) turn: it renders and runs
    assert isinstance(reply, str) and c.messages[-1]["role"] == "assistant"
    assert "<|channel|>" not in c.messages[-1]["content"]


def test_chat_view_shows_reasoning_then_answer():
    from fucina.cli.chat import HarmonyView

    out = []
    v = HarmonyView(out.append)
    for i in range(0, len(ANSWER), 5):
        v.feed(ANSWER[i:i + 5])
    v.finish()
    assert "".join(out) == "<think>\nThe tool said 18.\n</think>\n\nIt is 18 degrees in Paris."


# -- grammars ---------------------------------------------------------------------------

def _walk(constraint, tok, text: str, stop: int) -> bool:
    """Whether `constraint` admits the tokens of `text` and then `stop`."""
    for t in tok.encode(text, add_special=False, parse_special=True) + [stop]:
        if not constraint.allows(t):
            return False
        constraint.commit(t)
    return True


def test_grammars_admit_harmony_replies(llm):
    from fucina.text import grammar as g
    from fucina.text.constraint import Constraint, for_reply

    tok, n = llm.tokenizer, llm.config.n_vocab
    stops = llm.template.stop_ids(tok)
    ret, call = tok.token_id("<|return|>"), tok.token_id("<|call|>")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    c = for_reply(tok, g.json_schema(schema), stop_ids=stops, n_vocab=n, template=llm.template, think=True)
    assert _walk(c, tok, '<|channel|>analysis<|message|>JSON it is.<|end|><|start|>assistant'
                         '<|channel|>final<|message|>{"city": "Paris"}', ret)
    c.reset()
    assert not _walk(c, tok, '<|channel|>final<|message|>Paris', ret)        # not JSON: refused
    c = Constraint(tok, g.harmony_call_grammar([WEATHER], tok), stop_ids=stops, n_vocab=n)
    assert _walk(c, tok, CALL, call)
    c.reset()
    assert _walk(c, tok, CALL.split("<|start|>assistant", 1)[1], call)     # analysis is optional
    c.reset()
    assert not _walk(c, tok, CALL.replace("get_weather", "get_time"), call)   # undeclared tool


# -- the server, end to end ----------------------------------------------------------------

def script(prompt: str) -> tuple[str, str]:
    last = max(prompt.rfind("<|start|>user"), prompt.rfind("<|start|>functions."))
    tail = prompt[last:]
    if tail.startswith("<|start|>functions."):
        return ANSWER, "<|return|>"
    if "weather" in tail:
        return CALL, "<|call|>"
    if "JSON" in tail:
        return ('<|channel|>analysis<|message|>JSON it is.<|end|><|start|>assistant<|channel|>final'
                '<|message|>{"city": "Paris"}'), "<|return|>"
    return "<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!", "<|return|>"


class HarmonyScripted:
    """The decoder contract with forced logits: after the reply's start (the first
    `<|start|>assistant` past the last user or tool message) it writes `script(prompt)`,
    then that reply's stop token. Records each prompt it answered."""

    def __init__(self, real, tok):
        self.config, self.tok = real.config, tok
        self.init_cache, self.kv_geometry, self.gguf = real.init_cache, real.kv_geometry, real.gguf
        enc = lambda s: tok.encode(s, add_special=False, parse_special=True)     # noqa: E731
        self.opener, self.marks = enc("<|start|>assistant"), [enc("<|start|>user"), enc("<|start|>functions.")]
        self.seqs: dict[int, list[int]] = {}
        self.targets: dict[str, list[int]] = {}

    @staticmethod
    def _find(seq, sub, start=0, last=False):
        hits = [i for i in range(start, len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub]
        return (hits[-1] if last else hits[0]) if hits else -1

    def forward_step(self, cache, tokens, pos0):
        seq = self.seqs.setdefault(id(cache), [])
        del seq[pos0:]
        seq.extend(int(t) for t in tokens)
        cache.advance(len(tokens))
        logits = torch.full((self.config.n_vocab,), -1e4)
        turn = max(self._find(seq, m, last=True) for m in self.marks)
        k = self._find(seq, self.opener, max(turn, 0)) if turn >= 0 else -1
        if k < 0:
            logits[self.tok.token_id("<|return|>")] = 0
            return logits
        prompt = self.tok.decode(seq[:k + len(self.opener)])
        if prompt not in self.targets:
            text, stop = script(prompt)
            self.targets[prompt] = (self.tok.encode(text, add_special=False, parse_special=True)
                                    + [self.tok.token_id(stop)])
        target = self.targets[prompt]
        at = len(seq) - (k + len(self.opener))
        logits[target[at] if at < len(target) else target[-1]] = 0
        return logits


@pytest.fixture(scope="module")
def served(llm):
    pytest.importorskip("openai")
    from fucina.serve import Engine, Server
    from live_server import live

    model = HarmonyScripted(llm.model, llm.tokenizer)
    engine = Engine(model, llm.tokenizer, llm.template, n_ctx=1024, slots=2, batch=2, name="scripted-gpt-oss")
    with live(Server(engine)) as url:
        yield url, model


def _oai(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_openai_chat_reasoning_tool_round_trip_and_stream(served):
    url, model = served
    c = _oai(url)
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                  reasoning_effort="high")
    m = r.choices[0].message
    assert (m.content, m.model_extra["reasoning_content"], r.choices[0].finish_reason) == ("Hello!", "Say hi.", "stop")
    assert any("Reasoning: high" in p for p in model.targets)       # the effort reached the template
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert ch.message.model_extra["reasoning_content"] == "The user asks about the weather; I should call the tool."
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    msgs = ASK + [ch.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "18"}]
    r2 = c.chat.completions.create(model="x", messages=msgs, tools=[WEATHER], temperature=0)
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "It is 18 degrees in Paris."
    # the history came back in harmony: the call's reasoning kept (no final answer follows
    # it yet), the call in the template's form, the result on commentary from functions.NAME
    seen = [p for p in model.targets if p.endswith("<|start|>functions.get_weather to=assistant<|channel|>"
                                                   'commentary<|message|>"18"<|end|><|start|>assistant')]
    assert len(seen) == 1 and ("<|start|>assistant<|channel|>analysis<|message|>The user asks about the weather; "
                               "I should call the tool.<|end|><|start|>assistant to=functions.get_weather"
                               '<|channel|>commentary json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>') in seen[0]
    # streaming: reasoning deltas, then the call's deltas; the same call as the plain reply
    order, args, name = [], "", None
    for chunk in c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], temperature=0, stream=True):
        for chc in chunk.choices:
            d = chc.delta
            if (d.model_extra or {}).get("reasoning_content"):
                order.append("r")
            for t in d.tool_calls or []:
                name = name or (t.function.name if t.function else None)
                if t.function and t.function.arguments:
                    args += t.function.arguments
                    order.append("a")
    assert order[0] == "r" and order[-1] == "a" and order.index("a") > len(order) - order[::-1].index("r") - 1
    assert name == "get_weather" and args == call.function.arguments
    content = ""
    rs = ""
    for chunk in c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                           stream=True):
        for chc in chunk.choices:
            rs += (chc.delta.model_extra or {}).get("reasoning_content") or ""
            content += chc.delta.content or ""
            assert not (content and (chc.delta.model_extra or {}).get("reasoning_content"))   # reasoning first
    assert (rs, content) == ("Say hi.", "Hello!")


def test_openai_forced_call_and_structured_output(served):
    """Under a forced tool choice and under a JSON schema the grammars (harmony headers,
    analysis free) admit the scripted replies token for token."""
    url, _ = served
    c = _oai(url)
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], tool_choice="required",
                                  temperature=0.8, max_tokens=400)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Answer in JSON"}],
                                  temperature=0.8, max_tokens=400, response_format={
                                      "type": "json_schema", "json_schema": {"name": "c", "schema": {
                                          "type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}})
    m = r.choices[0].message
    assert json.loads(m.content) == {"city": "Paris"} and m.model_extra["reasoning_content"] == "JSON it is."


def test_responses_and_anthropic(served):
    anthropic = pytest.importorskip("anthropic")
    url, model = served
    c = _oai(url)
    tool = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
            "parameters": WEATHER["function"]["parameters"]}
    r = c.responses.create(model="x", input=ASK[0]["content"], tools=[tool], temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    fc = r.output[1]
    kinds, args = [], ""
    for ev in c.responses.create(model="x", input=ASK[0]["content"], tools=[tool], temperature=0, stream=True):
        kinds.append(ev.type)
        args += ev.delta if ev.type == "response.function_call_arguments.delta" else ""
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.function_call_arguments.delta")
    assert args == fc.arguments
    r2 = c.responses.create(model="x", tools=[tool], temperature=0, input=[
        ASK[0], r.output[0].model_dump(exclude_none=True),
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "18"}])
    assert r2.output_text == "It is 18 degrees in Paris."
    a = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    atool = {"name": "get_weather", "description": "Current weather in a city",
             "input_schema": WEATHER["function"]["parameters"]}
    m = a.messages.create(model="x", max_tokens=200, tools=[atool], messages=ASK, extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[1].input == {"city": "Paris", "unit": "celsius"}
    with a.messages.stream(model="x", max_tokens=200, tools=[atool], messages=ASK, extra_body={"temperature": 0}) as s:
        deltas = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        final = s.get_final_message()
    assert deltas[0] == "thinking_delta" and deltas[-1] == "input_json_delta"
    assert final.content[1].input == m.content[1].input
    msgs = ASK + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id, "content": "18"}]}]
    m2 = a.messages.create(model="x", max_tokens=200, tools=[atool], messages=msgs, extra_body={"temperature": 0})
    off = a.messages.create(model="x", max_tokens=200, messages=[{"role": "user", "content": "Hi, briefly"}],
                            thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert off.content[-1].text == "Hello!"
    assert any("Reasoning: low" in p and "Hi, briefly" in p for p in model.targets)   # no off switch: low
    assert m2.stop_reason == "end_turn" and m2.content[-1].text == "It is 18 degrees in Paris."
    # both dialects passed the call's reasoning back (Responses' reasoning item, Anthropic's thinking block)
    kept = [p for p in model.targets if "<|start|>functions.get_weather" in p]
    assert kept and all("<|channel|>analysis<|message|>The user asks" in p for p in kept)


# -- the oracle: llama-server renders the same prompts ----------------------------------------

@pytest.mark.oracle
@pytest.mark.slow
def test_prompts_match_llama_server(llm, gptoss_path):
    """The rendered prompt of each OpenAI request equals llama-server's /apply-template
    (its gpt-oss handler maps reasoning_content to thinking, as ours does)."""
    import httpx

    from oracle import oracle_dir
    from live_server import free_port
    from fucina.serve.openai import _chat_tools, chat_messages
    from fucina.serve.prompt import render_chat
    from fucina.serve.protocol import Fields
    from types import SimpleNamespace

    d = oracle_dir()
    if d is None:
        pytest.skip("FUCINA_LLAMA_CPP not set")
    port = free_port()
    proc = subprocess.Popen([str(d / "llama-server"), "-m", gptoss_path, "--port", str(port), "-t", "1", "--jinja",
                             "-c", "1024"], env=dict(os.environ, LD_LIBRARY_PATH=str(d)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline and proc.poll() is None, "llama-server did not start"
            time.sleep(0.2)
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        bodies = [
            {"messages": [{"role": "user", "content": "Hi"}]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                          {"role": "user", "content": "Again"}]},
            {"messages": [{"role": "developer", "content": "Use tools."}, ASK[0]], "tools": [WEATHER]},
            {"messages": ASK + [{"role": "assistant", "content": None, "reasoning_content": "Call it.",
                                 "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "18"}],
             "tools": [WEATHER]},
            {"messages": ASK + [{"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "c1", "content": "18"},
                                {"role": "assistant", "content": "18.", "reasoning_content": "done"},
                                {"role": "user", "content": "Thanks"}], "tools": [WEATHER]},
        ]
        eng = SimpleNamespace(template=llm.template, tokenizer=llm.tokenizer)
        for b in bodies:
            f = Fields(b)
            ours = render_chat(eng, chat_messages(f), tools=_chat_tools(f)).text
            theirs = httpx.post(f"http://127.0.0.1:{port}/apply-template", json=b, timeout=30).json()["prompt"]
            assert ours == theirs
    finally:
        proc.terminate()
        proc.wait(10)
