"""The Anthropic Messages dialect: a translation layer onto the same engine.

Content blocks map onto the canonical history (tool_use -> assistant tool_calls,
tool_result -> tool messages, an assistant's thinking blocks -> its reasoning, which
only gpt-oss's template renders back, before a tool call); the reply's reasoning
becomes a `thinking` block, tool calls `tool_use` blocks. Usage follows Anthropic's prompt-caching split: `input_tokens` are the
prompt tokens that were computed, `cache_read_input_tokens` those served from a KV
slot.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator

from fucina.serve import structured
from fucina.serve.engine import GenRequest, Started
from fucina.serve.parsing import Reasoning, Text, ToolArgs, ToolEnd, ToolStart, tool_arguments
from fucina.serve.prompt import render_chat
from fucina.serve.protocol import ApiError, Fields, bad, join_parts, max_tokens_for, sampling, text_content
from fucina.serve.turn import Turn

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}

STOP = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence",
        "tool_calls": "tool_use"}


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _text(content: Any, path: str) -> str:
    return text_content(content, path, allowed=("text",))


def messages(f: Fields) -> list[dict]:
    out: list[dict] = []
    if f.has("system"):
        out.append({"role": "system", "content": _text(f.get("system"), "system")})
    msgs = f.list("messages", required=True)
    if not msgs:
        raise bad("'messages' must not be empty", "messages")
    for i, m in enumerate(msgs):
        mf = Fields(m, f"messages[{i}].")
        role = mf.str("role", required=True)
        if role not in ("user", "assistant"):
            raise bad(f"'messages[{i}].role' must be 'user' or 'assistant'", f"messages[{i}].role")
        content = mf.require("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"'messages[{i}].content' must be a string or an array of content blocks",
                      f"messages[{i}].content")
        text, calls, results, thinking = [], [], 0, []
        for j, b in enumerate(content):
            path = f"messages[{i}].content[{j}]"
            bf = Fields(b, path + ".")
            kind = bf.str("type", required=True)
            if kind == "text":
                text.append(bf.str("text", "", required=True))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": bf.str("id", required=True), "type": "function",
                              "function": {"name": bf.str("name", required=True),
                                           "arguments": bf.dict("input", {})}})
            elif kind == "tool_result" and role == "user":
                c = bf.get("content", "")
                result = _text(c, path + ".content")
                if bf.bool("is_error", False):
                    result = "Error: " + result
                out.append({"role": "tool", "tool_call_id": bf.str("tool_use_id", required=True),
                            "content": result})
                results += 1
            elif kind == "thinking" and role == "assistant":
                thinking.append(bf.str("thinking", ""))
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise bad(f"'{path}.type' {kind!r} is not supported in a {role} message", path + ".type")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": join_parts(text)}
            if "".join(thinking):
                msg["reasoning_content"] = "".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not results:
            out.append({"role": "user", "content": join_parts(text)})
    return out


def _tools(f: Fields) -> list[dict] | None:
    tools = f.list("tools")
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        tf = Fields(t, f"tools[{i}].")
        if tf.str("type", "custom") not in ("custom",):
            raise bad(f"'tools[{i}].type' {tf.get('type')!r} is not supported (client tools only)",
                      f"tools[{i}].type")
        d = {"name": tf.str("name", required=True),
             "parameters": tf.dict("input_schema", required=True)}
        if tf.has("description"):
            d["description"] = tf.str("description")
        out.append({"type": "function", "function": d})
    return out


def parse(server, body: dict) -> tuple[Turn, dict]:
    f = Fields(body)
    f.str("model")
    max_tokens = f.int("max_tokens", None, 1, required=True)
    msgs = messages(f)
    tools = _tools(f)
    choice, single = "auto", False
    if f.has("tool_choice"):
        cf = Fields(f.dict("tool_choice"), "tool_choice.")
        kind = cf.str("type", required=True)
        single = bool(cf.bool("disable_parallel_tool_use", False))
        if kind == "tool":
            name = cf.str("name", required=True)
            if not tools or name not in {t["function"]["name"] for t in tools}:
                raise bad(f"'tool_choice.name' {name!r} is not among the tools", "tool_choice.name")
            choice, single = {"name": name}, True
        elif kind in ("any", "auto", "none"):
            choice = {"any": "required", "auto": "auto", "none": "none"}[kind]
            if kind == "any" and not tools:
                raise bad("'tool_choice' is 'any' but no tools are given", "tool_choice")
        else:
            raise bad("'tool_choice.type' must be auto, any, tool or none", "tool_choice.type")
    think = None
    if f.has("thinking"):
        tk = Fields(f.dict("thinking"), "thinking.")
        t = tk.str("type", required=True)
        if t not in ("enabled", "disabled", "adaptive"):
            raise bad("'thinking.type' must be 'enabled' or 'disabled'", "thinking.type")
        think = t != "disabled"
    cfg = sampling(f, server.sampling)
    if f.has("temperature") and cfg.temperature > 1.0:
        raise bad("'temperature' must be in [0, 1]", "temperature")
    stops = f.stops("stop_sequences")
    forced = structured.forced_tool(tools, choice)
    grammar = structured.tool_grammar(server, tools, choice, not single) if forced else None
    prompt = server.render(lambda: render_chat(server.engine, msgs, tools=tools, tool_choice=choice,
                                               think=think, prime=not forced))
    req = GenRequest(prompt.ids, max_tokens_for(server, prompt.ids, max_tokens), cfg, stops,
                     server.engine.stop_ids, processor=structured.constraint(server, prompt, grammar, think=think))
    turn = Turn(server, prompt, req, single_call=bool(tools) and single, id_prefix="toolu_")
    return turn, {"stream": f.bool("stream", False), "id": "msg_" + secrets.token_hex(12)}


def usage(turn: Turn) -> dict:
    return {"input_tokens": turn.prompt_tokens - turn.reused, "output_tokens": turn.completion_tokens,
            "cache_read_input_tokens": turn.reused, "cache_creation_input_tokens": 0}


def respond(server, turn: Turn, opt: dict) -> dict:
    content: list[dict] = []
    if turn.reasoning_text:
        content.append({"type": "thinking", "thinking": turn.reasoning_text, "signature": ""})
    if turn.content or not turn.calls:
        content.append({"type": "text", "text": turn.content})
    content += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": tool_arguments(c["arguments"])}
                for c in turn.calls]
    return {"id": opt["id"], "type": "message", "role": "assistant", "model": server.model_id,
            "content": content, "stop_reason": STOP[turn.finish], "stop_sequence": turn.stop_sequence,
            "usage": usage(turn)}


async def stream(server, turn: Turn, opt: dict) -> AsyncIterator[str]:
    index, open_kind = -1, None

    def close() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        out = []
        if open_kind == "thinking":
            out.append(sse("content_block_delta", {"index": index,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        open_kind = None
        return out + [sse("content_block_stop", {"index": index})]

    def open_(kind: str, block: dict) -> list[str]:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        return out + [sse("content_block_start", {"index": index, "content_block": block})]

    async for e in turn.events():
        chunks: list[str] = []
        if isinstance(e, Started):
            msg = {"id": opt["id"], "type": "message", "role": "assistant", "model": server.model_id,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {**usage(turn), "output_tokens": 0}}
            chunks += [sse("message_start", {"message": msg}), sse("ping", {})]
        elif isinstance(e, Text):
            if open_kind != "text":
                chunks += open_("text", {"type": "text", "text": ""})
            chunks.append(sse("content_block_delta", {"index": index, "delta": {"type": "text_delta",
                                                                                "text": e.text}}))
        elif isinstance(e, Reasoning):
            if open_kind != "thinking":
                chunks += open_("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            chunks.append(sse("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                                "thinking": e.text}}))
        elif isinstance(e, ToolStart):
            chunks += open_("tool_use", {"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
        elif isinstance(e, ToolArgs):
            chunks.append(sse("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                                "partial_json": e.text}}))
        elif isinstance(e, ToolEnd):
            chunks += close()
        for c in chunks:
            yield c
    if turn.error is not None:
        yield sse("error", {"error": error_body(server.api_error(turn.error))["error"]})
        return
    if index < 0:       # never started (or nothing said): one empty text block
        if turn.reply is None:
            return
        for c in open_("text", {"type": "text", "text": ""}):
            yield c
    for c in close():
        yield c
    yield sse("message_delta", {"delta": {"stop_reason": STOP[turn.finish], "stop_sequence": turn.stop_sequence},
                                "usage": usage(turn)})
    yield sse("message_stop", {})


def count_tokens(server, body: dict) -> dict:
    f = Fields(body)
    msgs = messages(f)
    prompt = server.render(lambda: render_chat(server.engine, msgs, tools=_tools(f)))
    return {"input_tokens": len(prompt.ids)}

