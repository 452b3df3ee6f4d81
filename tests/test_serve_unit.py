"""fucina.serve pieces that need no model: the reply parser (reasoning, hermes tool
calls, streamed in any chunking), the hermes fallback render, request validation."""
import json

import pytest

from fucina.serve.parsing import OutputParser, Reasoning, Text, ToolArgs, ToolEnd, ToolStart, tool_arguments
from fucina.serve.prompt import hermes_fallback
from fucina.serve.protocol import ApiError, Fields, sampling


def parse(text, chunk=1, **kw):
    p = OutputParser(**kw)
    ev = []
    for i in range(0, len(text), chunk):
        ev += p.feed(text[i:i + chunk])
    return ev + p.finish()


def summary(events):
    out = {"text": "", "reasoning": "", "calls": []}
    for e in events:
        if isinstance(e, Text):
            out["text"] += e.text
        elif isinstance(e, Reasoning):
            out["reasoning"] += e.text
        elif isinstance(e, ToolStart):
            assert e.index == len(out["calls"])
            out["calls"].append([e.name, ""])
        elif isinstance(e, ToolArgs):
            out["calls"][e.index][1] += e.text
        elif isinstance(e, ToolEnd):
            assert out["calls"][e.index][1] == e.arguments     # deltas join to the whole
    return out


REPLY = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } in \\"quotes\\""}}\n'
         '</tool_call>\n<tool_call>\n{"arguments": {"x": [1, 2]}, "name": "other"}\n</tool_call>')


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 13, 1000])
def test_parser_any_chunking_same_result(chunk):
    s = summary(parse(REPLY, chunk, tools=True, reasoning=True))
    assert s["reasoning"] == "The user wants the weather."
    assert s["text"] == "Let me check."
    assert s["calls"][0][0] == "get_weather"
    assert json.loads(s["calls"][0][1]) == {"city": "Paris", "note": 'a } in "quotes"'}
    assert s["calls"][1] == ["other", '{"x": [1, 2]}']


def test_parser_streams_arguments_incrementally():
    p = OutputParser(tools=True)
    ev = p.feed('<tool_call>\n{"name": "f", "arguments": {"a": ')
    assert [type(e) for e in ev] == [ToolStart, ToolArgs]
    assert ev[1].text == '{"a": '
    assert [e.text for e in p.feed('"long value"')] == ['"long value"']
    ev = p.feed("}}\n</tool_call>")
    assert [type(e) for e in ev] == [ToolArgs, ToolEnd] and ev[1].arguments == '{"a": "long value"}'


@pytest.mark.parametrize("chunk", [1, 3, 200])
def test_parser_close_tag_inside_an_argument_string_is_text(chunk):
    """A sampled string may spell the close tag; the call ends only after its arguments do
    (a forced call was cut at '{"city": "Rome}}' and its arguments were not JSON)."""
    text = '<tool_call>\n{"name": "w", "arguments": {"city": "Rome}}</tool_call>x"}}\n</tool_call> after'
    s = summary(parse(text, chunk, tools=True))
    assert s["calls"] == [["w", '{"city": "Rome}}</tool_call>x"}']] and s["text"].strip() == "after"
    assert json.loads(s["calls"][0][1]) == {"city": "Rome}}</tool_call>x"}


def test_parser_plain_text_untouched_without_tools():
    assert summary(parse("  spaced <tool_call> text  ", 2))["text"] == "  spaced <tool_call> text  "


def test_parser_holds_back_partial_markers():
    p = OutputParser(tools=True)
    assert p.feed("Hello <tool") == [Text("Hello")]
    assert summary(p.feed(" box") + p.finish())["text"] == " <tool box"


def test_parser_bad_json_is_given_back_as_text():
    s = summary(parse("<tool_call>not json</tool_call>", 3, tools=True))
    assert s["calls"] == [] and s["text"] == "<tool_call>not json</tool_call>"


def test_parser_unterminated_call_ends_with_what_it_has():
    s = summary(parse('<tool_call>{"name": "f", "arguments": {"a": [1,', 4, tools=True))
    assert s["calls"] == [["f", '{"a": [1,']]


def test_parser_primed_call_and_primed_think():
    primed = '<tool_call>\n{"name": "g", "arguments": '
    s = summary(OutputParser(tools=True, primed=primed).events + parse('{"k": 1}}\n</tool_call>', 2, tools=True,
                                                                      primed=primed))
    assert s["calls"] == [["g", '{"k": 1}']]
    s = summary(parse("hmm\n</think>\nok", 2, reasoning=True, primed="<think>"))
    assert s == {"text": "ok", "reasoning": "hmm", "calls": []}


def test_parser_unfinished_reasoning():
    assert summary(parse("<think>still going", 3, reasoning=True))["reasoning"] == "still going"


def test_tool_arguments_object():
    assert tool_arguments('{"a": 1}') == {"a": 1}
    assert tool_arguments("nope") == {}
    assert tool_arguments("") == {}


def test_hermes_fallback_render():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    msgs = hermes_fallback([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "tool", "tool_call_id": "c2", "content": "43"},
    ], tools)
    assert msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"] and '"name": "f"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>\n"
                                                  "<tool_response>\n43\n</tool_response>"}


def test_fields_name_the_field():
    with pytest.raises(ApiError) as e:
        Fields({"messages": [{"role": 3}]}).list("messages") and Fields({"role": 3}, "messages[0].").str("role")
    assert e.value.param == "messages[0].role" and e.value.status == 400
    with pytest.raises(ApiError) as e:
        sampling(Fields({"temperature": 7}))
    assert e.value.param == "temperature"
    with pytest.raises(ApiError) as e:
        Fields({"max_tokens": True}).int("max_tokens")
    assert "integer" in e.value.message
    assert sampling(Fields({"seed": 5, "temperature": 0})).seed == 5


class _Tok:
    bos_id = None

    def encode(self, text, add_special=True, parse_special=True):
        return [ord(c) for c in text]


class _Engine:
    def __init__(self, source):
        from fucina.text.chat_template import ChatTemplate

        self.template, self.tokenizer = ChatTemplate(source), _Tok()


CHATML_NO_TOOLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                    "properties": {"a": {"type": "string"}}}}}


def test_render_priming_by_tool_choice():
    from fucina.serve.prompt import render_chat

    e = _Engine(CHATML_NO_TOOLS)
    msgs = [{"role": "user", "content": "hi"}]
    auto = render_chat(e, msgs, tools=[TOOL])
    assert auto.tools and auto.primed == "" and "<tools>" in auto.text     # hermes fallback system
    assert render_chat(e, msgs, tools=[TOOL], tool_choice="required").primed == "<tool_call>\n"
    named = render_chat(e, msgs, tools=[TOOL], tool_choice={"name": "f"})
    assert named.primed == '<tool_call>\n{"name": "f", "arguments": {"'
    assert named.text.endswith("<|im_start|>assistant\n" + named.primed) and named.ids[-1] == ord('"')
    none = render_chat(e, msgs, tools=[TOOL], tool_choice="none")
    assert not none.tools and "<tools>" not in none.text
    p = OutputParser(tools=True, primed=named.opening)
    s = summary(list(p.events) + p.feed('a": "x"}}\n</tool_call>') + p.finish())
    assert s["calls"] == [["f", '{"a": "x"}']]


def test_render_reasoning_detection():
    from fucina.serve.prompt import render_chat

    src = CHATML_NO_TOOLS.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")
    p = render_chat(_Engine(src), [{"role": "user", "content": "hi"}])
    assert p.reasoning and p.opening == "<think>"
    assert not render_chat(_Engine(CHATML_NO_TOOLS), [{"role": "user", "content": "hi"}]).reasoning


class _TinyModel:
    def kv_geometry(self):
        return [2, 2], [4, 4]

    def init_cache(self, capacity=None):
        from fucina.models.cache import KVCache

        return KVCache(2, 2, 4, capacity)


def test_slot_pool_prefix_choice_copy_and_ram_guard(monkeypatch):
    from fucina.serve.engine import SlotPool

    pool = SlotPool(_TinyModel(), 3, 64)
    assert pool.cache_bytes() == 2 * (8 + 8) * 64 * 2
    a = pool.acquire(list(range(40)))
    a.tokens[:] = list(range(40))
    a.cache.len = 40
    pool.release(a)
    b = pool.acquire(list(range(30)) + [99])          # the warm slot, for its 30-token prefix
    assert b is a
    b.busy = True
    c = pool.acquire(list(range(25)) + [7, 7])        # a is busy: a new slot copies its rows
    assert c is not a and c.tokens == list(range(25)) and c.cache.len == 25
    pool.release(a)
    pool.release(c)
    monkeypatch.setattr(pool, "_room_for_cache", lambda: False)
    d = pool.acquire([5, 5, 5])                        # no room for the third cache: reuse
    assert d.cache is not None and sum(s.cache is not None for s in pool.slots) == 2


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_parser_bare_json_call(chunk):
    reply = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    s = summary(parse(reply, chunk, tools=True, tool_names=["get_weather"]))
    assert s == {"text": "", "reasoning": "", "calls": [["get_weather", '{"city": "Paris"}']]}
    s = summary(parse(' {"name": "f", "arguments": {}}', chunk, tools=True, tool_names=["f"]))
    assert s["calls"] == [["f", "{}"]]
    # JSON that is not a call of a declared tool is the answer, given back whole
    s = summary(parse('{"answer": 42}', chunk, tools=True, tool_names=["f"]))
    assert s == {"text": '{"answer": 42}', "reasoning": "", "calls": []}
    s = summary(parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', chunk, tools=True,
                      tool_names=["f"]))
    assert s["calls"] == [["f", '{"a": 1}']]
    assert summary(parse("plain words", chunk, tools=True, tool_names=["f"]))["text"] == "plain words"
