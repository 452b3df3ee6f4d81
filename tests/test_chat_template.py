"""Chat templates: the GGUF's own template == a plain Jinja rendering; built-in formats."""
import json
from datetime import datetime

import jinja2
import pytest

from fucina.gguf import GGUFFile
from fucina.text.chat_template import (ChatTemplate, ChatTemplateError, detect_format, prompt_ids,
                                       split_reasoning)
from conftest import present_model
from test_chat_support import FakeTokenizer, tiny_llama_gguf


# A Qwen3-style template (tools, reasoning, enable_thinking), in the shape Qwen ships.
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {{- tool_call.arguments | tojson }}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# A Llama-3.x-style template: bos_token, strftime_now, tools in the first user turn,
# raise_exception, tojson(indent=4).
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Città <meteo> & more",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello!"},
    {"role": "user", "content": "Weather in Roma?"},
]


def plain_jinja(source, **variables):
    """The reference: a plain Jinja environment configured as Hugging Face's."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **k: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["strftime_now"] = lambda f: datetime.now().strftime(f)

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(**variables)


def test_smollm2_own_template_equals_plain_jinja():
    meta = GGUFFile(present_model("smollm2")).metadata
    t = ChatTemplate.from_metadata(meta)
    assert t.format == "chatml" and t.stop_marker == "<|im_end|>"
    msgs = MESSAGES[1:]
    for gen in (True, False):
        want = plain_jinja(meta["tokenizer.chat_template"], messages=msgs, add_generation_prompt=gen,
                           bos_token=t.bos_token, eos_token=t.eos_token)
        assert t.render(msgs, add_generation_prompt=gen) == want
    assert t.render(msgs).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("think", [None, True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_qwen3_style_template_from_gguf(tmp_path, think, tools):
    path = tiny_llama_gguf(tmp_path / "q.gguf", chat_template=QWEN3)
    t = ChatTemplate.from_metadata(GGUFFile(path).metadata)
    assert t.bos_token == "<s>" and t.eos_token == "</s>"
    extra = {"tools": tools} if tools else {}
    if think is not None:
        extra["enable_thinking"] = think
    want = plain_jinja(QWEN3, messages=MESSAGES, add_generation_prompt=True, bos_token="<s>",
                       eos_token="</s>", **extra)
    got = t.render(MESSAGES, tools=tools, enable_thinking=think)
    assert got == want
    assert ("<tools>" in got) == bool(tools) and "Città <meteo> & more" in got if tools else True
    assert got.endswith("<think>\n\n</think>\n\n") == (think is False)
    assert "hm" not in got              # prior reasoning dropped by the template itself


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_llama3_style_template_from_gguf(tmp_path, tools):
    path = tiny_llama_gguf(tmp_path / "l.gguf", chat_template=LLAMA3)
    t = ChatTemplate.from_metadata(GGUFFile(path).metadata)
    assert t.format == "llama3" and t.stop_marker == "<|eot_id|>"
    extra = {"tools": tools} if tools else {}
    want = plain_jinja(LLAMA3, messages=MESSAGES, add_generation_prompt=True, bos_token="<s>",
                       eos_token="</s>", **extra)
    assert t.render(MESSAGES, tools=tools) == want
    assert want.startswith("<s><|start_header_id|>system") and datetime.now().strftime("%Y") in want


def test_raise_exception_is_typed():
    t = ChatTemplate(LLAMA3, bos_token="<s>")
    with pytest.raises(ChatTemplateError, match="no first user message"):
        t.render([{"role": "system", "content": "x"}], tools=TOOLS)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for %}").render(MESSAGES)


def test_builtin_chatml_matches_seed_rendering():
    t = ChatTemplate.builtin("chatml")
    assert t.render(MESSAGES[:2]) == \
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    full = MESSAGES[:3] + [{"role": "user", "content": "Bye"}]
    assert t.render(full, enable_thinking=False) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<tools>" in t.render(MESSAGES[:2], tools=TOOLS)


def test_builtin_llama3_and_gemma():
    l3 = ChatTemplate.builtin("llama3", bos_token="<|begin_of_text|>")
    assert l3.render(MESSAGES[:2]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    g = ChatTemplate.builtin("gemma", bos_token="<bos>")
    assert g.render(MESSAGES[:3] + [{"role": "user", "content": "Bye"}]) == (
        "<bos><start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="mid-conversation"):
        g.render(MESSAGES[:2] + [{"role": "system", "content": "late"}])
    with pytest.raises(ChatTemplateError):
        g.render([])
    g4 = ChatTemplate.builtin("gemma4")
    assert g4.stop_marker == "<turn|>"
    assert g4.render(MESSAGES[:2], enable_thinking=False).endswith("<|turn>model\n<|channel>thought\n<channel|>")


def test_fallback_when_gguf_has_no_template():
    t = ChatTemplate.from_metadata(GGUFFile(present_model("gemma3")).metadata)
    assert t.name == "gemma" and t.bos_token == "<bos>"
    assert t.render(MESSAGES[1:2]) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_detect_and_stop_ids():
    assert detect_format("{{ '<|im_start|>' }}") == "chatml"
    assert detect_format("<|start_header_id|>") == "llama3"
    assert detect_format("<start_of_turn>") == "gemma"
    assert detect_format("<|turn>") == "gemma4"
    assert detect_format("[INST]") is None
    tok = FakeTokenizer()
    assert ChatTemplate.builtin("chatml", eos_token="</s>").stop_ids(tok) >= {257, 259}


def test_prompt_ids_does_not_double_bos():
    tok = FakeTokenizer(add_bos=True)
    assert prompt_ids(tok, "<s>hi") == [258, ord("h"), ord("i")]
    assert prompt_ids(tok, "hi") == [258, ord("h"), ord("i")]
    assert prompt_ids(FakeTokenizer(), "<s>hi") == [258, ord("h"), ord("i")]


def test_split_reasoning():
    assert split_reasoning("<think>\nhm\n</think>\n\nHello!") == ("hm", "Hello!")
    assert split_reasoning("Hello!") == ("", "Hello!")
