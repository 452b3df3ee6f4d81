"""From a dialect's request to prompt ids: the stateless render.

Every dialect converts its messages into one canonical, Hugging Face-shaped list
(`{"role", "content": str, "tool_calls": [{"id", "type": "function", "function":
{"name", "arguments": dict}}], "tool_call_id"}`) and its tools into OpenAI function
declarations; the GGUF's own chat template renders the whole history on every
request (KV slots make the repeated prefix free).

Tools go through the template when it knows about them (it mentions `tools`, as the
Qwen family's do: hermes `<tool_call>` blocks). A template without tool support gets
the same hermes convention spelled out in a system message, assistant tool calls
written back as `<tool_call>` blocks and tool results as `<tool_response>` user
turns. A forced tool choice primes the reply with `<tool_call>` (and, when one
function is named, its name and the opening `{"` of its arguments object when its
schema has properties), so even a weak model answers with a call. This is priming,
not constrained decoding: the arguments themselves are the model's.

gpt-oss (a harmony template, fucina.text.harmony) renders through its own template with
an assistant's reasoning as `thinking` and the request's reasoning effort; a forced call
is primed with the `<|channel|>commentary to=functions.` header.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fucina.text import harmony
from fucina.text.chat_template import prompt_ids

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass
class Prompt:
    text: str              # the rendered prompt, primed text included
    ids: list[int]
    primed: str = ""       # text appended after the template's generation prompt
    tools: bool = False    # parse tool calls from the reply
    reasoning: bool = False
    tool_names: tuple[str, ...] = ()   # declared tools (a bare-JSON reply may call them)
    harmony: bool = False  # the reply is harmony channels (gpt-oss), parsed by fucina.text.harmony

    @property
    def opening(self) -> str:
        """What the reply starts inside of: the primed text, or a primed `<think>`."""
        if self.primed:
            return self.primed
        return "<think>" if self.text.rstrip().endswith("<think>") else ""


def template_knows_tools(template) -> bool:
    src = (template.tool_source or "") + template.source
    return "tools" in src and "tool_call" in src


def _call_block(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})},
                                        ensure_ascii=False) + "\n</tool_call>"


def hermes_fallback(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None):
    """Spell tools, tool calls and tool results out as plain messages."""
    out: list[dict[str, Any]] = []
    msgs = [dict(m) for m in messages]
    if tools:
        block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = (msgs[0].get("content") or "") + "\n\n" + block
        else:
            msgs.insert(0, {"role": "system", "content": block})
    for m in msgs:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + blocks})
        elif role == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool", None)
    return out


def render_harmony(engine, msgs: list[dict[str, Any]], tools, tool_choice: Any, think: bool | None,
                   effort: Any, prime: bool) -> Prompt:
    """gpt-oss: the template renders tools and calls itself; an assistant's reasoning
    goes in as `thinking`; a forced call is primed with its commentary header."""
    extra = {}
    level = harmony.effort_level(think, effort)
    if level is not None:
        extra["reasoning_effort"] = level
    text = engine.template.render(harmony.history(msgs), add_generation_prompt=True,
                                  tools=list(tools) if tools else None, **extra)
    primed = ""
    if prime and tools and tool_choice not in ("auto", None):
        primed = "<|channel|>commentary to=functions."
        if isinstance(tool_choice, dict) and tool_choice.get("name"):
            primed += tool_choice["name"] + " <|constrain|>json<|message|>"
    full = text + primed
    names = tuple(t.get("function", t).get("name") for t in tools or ())
    return Prompt(full, prompt_ids(engine.tokenizer, full), primed, bool(tools), True, names, harmony=True)


def render_chat(engine, messages: Sequence[Mapping[str, Any]], *,
                tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = "auto",
                think: bool | None = None, prime: bool = True, effort: Any = None) -> Prompt:
    """Render a canonical history for the engine's model. tool_choice: "auto", "none",
    "required", or a function name (str wrapped as {"name": ...}). prime=False leaves a
    forced call unprimed (a grammar writes the whole call). effort: the request's
    reasoning effort (gpt-oss renders it; other templates read only `think`)."""
    template = engine.template
    if tool_choice == "none":
        tools = None
    if harmony.is_harmony(template):
        msgs = [dict(m) for m in messages]
        for m in msgs:
            m["content"] = m.get("content") or ""
        return render_harmony(engine, msgs, tools, tool_choice, think, effort, prime)
    has_tool_msgs = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    native = template_knows_tools(template)
    msgs = [dict(m) for m in messages]
    for m in msgs:
        m["content"] = m.get("content") or ""
        m.pop("reasoning_content", None)      # past reasoning: only harmony renders it back
    if (tools or has_tool_msgs) and not native:
        msgs, tools_arg = hermes_fallback(msgs, tools), None
    else:
        tools_arg = list(tools) if tools else None
    text = template.render(msgs, add_generation_prompt=True, tools=tools_arg, enable_thinking=think)
    primed = ""
    if prime and tools and tool_choice not in ("auto", None):
        primed = "<tool_call>\n"
        if isinstance(tool_choice, dict) and tool_choice.get("name"):
            name = tool_choice["name"]
            primed += '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
            fn = next((t.get("function", t) for t in tools if t.get("function", t).get("name") == name), {})
            if (fn.get("parameters") or {}).get("properties"):
                primed += '{"'       # an object with named fields: start its first key
    full = text + primed
    reasoning = "think>" in template.source or full.rstrip().endswith("<think>")
    names = tuple(t.get("function", t).get("name") for t in tools or ())
    return Prompt(full, prompt_ids(engine.tokenizer, full), primed, bool(tools), reasoning, names)


def render_completion(engine, prompt: str | Sequence[int]) -> Prompt:
    if isinstance(prompt, str):
        ids = engine.tokenizer.encode(prompt, add_special=True, parse_special=True)
        return Prompt(prompt, ids)
    ids = [int(i) for i in prompt]
    return Prompt(engine.tokenizer.decode(ids), ids)
