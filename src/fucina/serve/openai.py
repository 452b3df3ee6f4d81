"""The OpenAI dialects: Chat Completions, (legacy) Completions, Responses (stateless).

Each has `parse_*` (request JSON -> Turn plus options) and `respond_*` (a plain JSON
body) / `stream_*` (SSE text chunks), all over the same Turn events.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator

from fucina.serve import structured
from fucina.serve.choices import MAX_CHOICES, indexed_events, make_turns, turns_of
from fucina.serve.engine import GenRequest, Started
from fucina.serve.parsing import Reasoning, Text, ToolArgs, ToolEnd, ToolStart
from fucina.serve.prompt import render_chat, render_completion
from fucina.serve.protocol import ApiError, Fields, bad, max_tokens_for, sampling, speculation, text_content
from fucina.serve.turn import LogProbs, Turn


def sse(data: Any, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def _rid(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# -- shared request pieces -------------------------------------------------------------

def _arguments_obj(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        return text


def _chat_tools(f: Fields, key: str = "tools") -> list[dict] | None:
    tools = f.list(key)
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        tf = Fields(t, f"{key}[{i}].")
        if tf.str("type", "function") != "function":
            raise bad(f"'{key}[{i}].type' must be 'function'", f"{key}[{i}].type")
        fn = Fields(tf.dict("function", required=True), f"{key}[{i}].function.")
        d = {"name": fn.str("name", required=True)}
        if fn.has("description"):
            d["description"] = fn.str("description")
        d["parameters"] = fn.dict("parameters", {"type": "object", "properties": {}})
        out.append({"type": "function", "function": d})
    return out


def _tool_choice(f: Fields, tools: list[dict] | None, *, flat: bool = False) -> Any:
    v = f.get("tool_choice", "auto")
    if isinstance(v, str):
        if v not in ("auto", "none", "required"):
            raise bad("'tool_choice' must be 'auto', 'none', 'required' or a function", "tool_choice")
        if v == "required" and not tools:
            raise bad("'tool_choice' is 'required' but no tools are given", "tool_choice")
        return v
    tf = Fields(v, "tool_choice.")
    name = tf.str("name", required=True) if flat else Fields(
        tf.dict("function", required=True), "tool_choice.function.").str("name", required=True)
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise bad(f"'tool_choice' names {name!r}, which is not among the tools", "tool_choice")
    return {"name": name}


def _think(f: Fields) -> bool | None:
    kw = f.dict("chat_template_kwargs", {})
    if isinstance(kw.get("enable_thinking"), bool):
        return kw["enable_thinking"]
    effort = f.get("reasoning_effort")
    if effort is None and isinstance(f.get("reasoning"), dict):
        effort = f.get("reasoning").get("effort")
    if effort is not None:
        return effort not in ("none", "minimal")
    return None


def _effort(f: Fields):
    """The request's reasoning effort (chat: `reasoning_effort`; Responses: `reasoning.effort`)."""
    effort = f.get("reasoning_effort")
    if effort is None and isinstance(f.get("reasoning"), dict):
        effort = f.get("reasoning").get("effort")
    return effort


def _logprob_entry(tok_text, tok: int, lp: float) -> dict:
    piece = tok_text(tok)
    return {"token": piece.decode("utf-8", "replace"), "logprob": lp, "bytes": list(piece)}


def chat_logprobs(server, entries: list[tuple]) -> dict:
    tt = server.engine.tokenizer.token_to_piece
    return {"content": [{**_logprob_entry(tt, tok, lp),
                         "top_logprobs": [_logprob_entry(tt, i, v) for i, v in top]}
                        for tok, lp, top in entries], "refusal": None}


def usage(turn: Turn) -> dict:
    p, c = turn.prompt_tokens, turn.completion_tokens
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": turn.reused}}
    pred = getattr(getattr(turn, "reply", None), "prediction", None)
    if pred is not None:      # Predicted Outputs: the prediction's drafts, verified / rejected
        out["completion_tokens_details"] = {"accepted_prediction_tokens": pred[0],
                                            "rejected_prediction_tokens": pred[1]}
    return out


FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


# -- chat completions ------------------------------------------------------------------

def chat_messages(f: Fields) -> list[dict]:
    msgs = f.list("messages", required=True)
    if not msgs:
        raise bad("'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(msgs):
        mf = Fields(m, f"messages[{i}].")
        role = mf.str("role", required=True)
        path = f"messages[{i}].content"
        if role == "developer":
            role = "system"
        if role == "function":
            role = "tool"
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(f"'messages[{i}].role' {role!r} is not one of system, developer, user, "
                      f"assistant, tool", f"messages[{i}].role")
        msg: dict[str, Any] = {"role": role, "content": text_content(mf.get("content"), path)}
        if role == "assistant" and mf.has("tool_calls"):
            calls = []
            for j, c in enumerate(mf.list("tool_calls")):
                cf = Fields(c, f"messages[{i}].tool_calls[{j}].")
                fn = Fields(cf.dict("function", required=True), f"messages[{i}].tool_calls[{j}].function.")
                calls.append({"id": cf.str("id", f"call_{j}"), "type": "function",
                              "function": {"name": fn.str("name", required=True),
                                           "arguments": _arguments_obj(fn.str("arguments", "{}"))}})
            msg["tool_calls"] = calls
        if role == "assistant" and isinstance(mf.get("reasoning_content"), str):
            msg["reasoning_content"] = mf.get("reasoning_content")
        if role == "user" and mf.get("content") is None:
            raise bad(f"'{path}' is required", path)
        if role == "tool":
            msg["tool_call_id"] = mf.str("tool_call_id", "") or mf.str("name", "")
        out.append(msg)
    return out


def parse_chat(server, body: dict) -> tuple[Turn, dict]:
    f = Fields(body)
    f.str("model")
    messages = chat_messages(f)
    n = f.int("n", 1, 1, MAX_CHOICES)
    grammar = structured.response_format(f.dict("response_format"), "response_format") \
        or structured.llamacpp_fields(f)
    tools = _chat_tools(f)
    choice = _tool_choice(f, tools)
    parallel = f.bool("parallel_tool_calls", True)
    forced = structured.forced_tool(tools, choice)
    if forced:
        grammar = structured.tool_grammar(server, tools, choice, parallel)
    top = None
    if f.bool("logprobs", False):
        top = f.int("top_logprobs", 0, 0, 20)
    elif f.has("top_logprobs"):
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    mt = f.int("max_completion_tokens", None, 1)
    if mt is None:
        mt = f.int("max_tokens", None, 1)
    stream = f.bool("stream", False)
    so = Fields(f.dict("stream_options", {}), "stream_options.")
    cfg = sampling(f, server.sampling)
    stops = f.stops("stop")
    prompt = server.render(lambda: render_chat(server.engine, messages, tools=tools, tool_choice=choice,
                                               think=_think(f), prime=not forced, effort=_effort(f)))
    def constraint():
        return structured.constraint(server, prompt, grammar, think=_think(f))
    req = GenRequest(prompt.ids, max_tokens_for(server, prompt.ids, mt), cfg, stops,
                     server.engine.stop_ids, top, constraint(),
                     *speculation(f, server.engine.tokenizer))
    single = isinstance(choice, dict) or not parallel
    return make_turns(server, prompt, req, n, constraint, single_call=bool(tools) and single), {
        "stream": stream, "include_usage": bool(so.bool("include_usage", False)),
        "id": _rid("chatcmpl-"), "created": int(time.time()), "logprobs": top is not None}


def respond_chat(server, turn: Turn, opt: dict) -> dict:
    return {"id": opt["id"], "object": "chat.completion", "created": opt["created"],
            "model": server.model_id, "system_fingerprint": server.fingerprint,
            "choices": [_chat_choice(server, t, opt, i) for i, t in enumerate(turns_of(turn))],
            "usage": usage(turn)}


def _chat_choice(server, turn: Turn, opt: dict, index: int) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content or (None if turn.calls else "")}
    if turn.reasoning_text:
        msg["reasoning_content"] = turn.reasoning_text
    if turn.calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in turn.calls]
    return {"index": index, "message": msg, "finish_reason": FINISH[turn.finish],
            "logprobs": chat_logprobs(server, turn.logprobs) if opt["logprobs"] else None}


async def stream_chat(server, turn: Turn, opt: dict) -> AsyncIterator[str]:
    pending: dict[int, list[tuple]] = {}   # per choice: logprobs of tokens whose text is not sent yet

    def chunk(delta: dict, finish=None) -> str:
        logprobs = None
        if pending.get(i) and (delta or finish):   # ride on the chunk carrying the tokens' text
            logprobs = chat_logprobs(server, pending.pop(i))
        c = {"id": opt["id"], "object": "chat.completion.chunk", "created": opt["created"],
             "model": server.model_id, "system_fingerprint": server.fingerprint,
             "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if opt["include_usage"]:
            c["usage"] = None
        return sse(c)

    async for i, ev in indexed_events(turn):
        if ev is None:                       # choice i is over
            if turns_of(turn)[i].error is None:
                yield chunk({}, FINISH[turns_of(turn)[i].finish])
        elif isinstance(ev, Started):
            yield chunk({"role": "assistant", "content": ""})
        elif isinstance(ev, Text):
            yield chunk({"content": ev.text})
        elif isinstance(ev, Reasoning):
            yield chunk({"reasoning_content": ev.text})
        elif isinstance(ev, ToolStart):
            yield chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                         "function": {"name": ev.name, "arguments": ""}}]})
        elif isinstance(ev, ToolArgs):
            yield chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]})
        elif isinstance(ev, LogProbs) and opt["logprobs"]:
            pending.setdefault(i, []).extend(ev.entries)
    if turn.error is not None:
        yield sse(error_body(server.api_error(turn.error)))
    else:
        if opt["include_usage"]:
            yield sse({"id": opt["id"], "object": "chat.completion.chunk", "created": opt["created"],
                       "model": server.model_id, "choices": [], "usage": usage(turn)})
    yield sse("[DONE]")


# -- completions -----------------------------------------------------------------------

def parse_completion(server, body: dict) -> tuple[Turn, dict]:
    f = Fields(body)
    f.str("model")
    p = f.require("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, list):
        if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise bad("'prompt' must be a string, or an array of token ids (one prompt per request)",
                      "prompt")
        n_vocab = server.engine.tokenizer.n_vocab
        if any(not 0 <= t < n_vocab for t in p):
            raise bad(f"'prompt' holds a token id outside [0, {n_vocab})", "prompt")
    elif not isinstance(p, str):
        raise bad("'prompt' must be a string or an array of token ids", "prompt")
    n = f.int("n", 1, 1, MAX_CHOICES)
    if f.int("best_of", n, 1) != n:
        raise bad("'best_of' must equal 'n' (every choice is returned)", "best_of")
    if f.has("suffix"):
        raise bad("'suffix' is not supported", "suffix")
    top = f.int("logprobs", None, 0, 20)
    grammar = structured.llamacpp_fields(f)
    prompt = server.render(lambda: render_completion(server.engine, p), param="prompt")
    def constraint():
        return structured.constraint(server, prompt, grammar, think=False)
    req = GenRequest(prompt.ids, max_tokens_for(server, prompt.ids, f.int("max_tokens", 16, 1)),
                     sampling(f, server.sampling), f.stops("stop"), server.engine.stop_ids, top,
                     constraint(), *speculation(f, server.engine.tokenizer))
    so = Fields(f.dict("stream_options", {}), "stream_options.")
    return make_turns(server, prompt, req, n, constraint), {
        "stream": f.bool("stream", False), "include_usage": bool(so.bool("include_usage", False)),
        "echo": f.bool("echo", False), "id": _rid("cmpl-"), "created": int(time.time()),
        "logprobs": top is not None}


def _completion_logprobs(server, entries: list[tuple]) -> dict:
    tt = server.engine.tokenizer.token_to_piece
    toks = [tt(t).decode("utf-8", "replace") for t, _, _ in entries]
    offs, at = [], 0
    for s in toks:
        offs.append(at)
        at += len(s)
    return {"tokens": toks, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{tt(i).decode("utf-8", "replace"): v for i, v in top} for _, _, top in entries],
            "text_offset": offs}


def respond_completion(server, turn: Turn, opt: dict) -> dict:
    head = turn.prompt.text if opt["echo"] else ""
    return {"id": opt["id"], "object": "text_completion", "created": opt["created"],
            "model": server.model_id, "system_fingerprint": server.fingerprint,
            "choices": [{"index": i, "text": head + t.content, "finish_reason": FINISH[t.finish],
                         "logprobs": _completion_logprobs(server, t.logprobs) if opt["logprobs"] else None}
                        for i, t in enumerate(turns_of(turn))],
            "usage": usage(turn)}


async def stream_completion(server, turn: Turn, opt: dict) -> AsyncIterator[str]:
    pending: dict[int, list[tuple]] = {}   # per choice: logprobs of tokens whose text is not sent yet

    def chunk(text: str, finish=None, echo=False) -> str:
        logprobs = None
        if pending.get(i) and not echo and (text or finish):
            logprobs = _completion_logprobs(server, pending.pop(i))
        return sse({"id": opt["id"], "object": "text_completion", "created": opt["created"],
                    "model": server.model_id,
                    "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}]})

    async for i, ev in indexed_events(turn):
        if ev is None:                       # choice i is over
            if turns_of(turn)[i].error is None:
                yield chunk("", FINISH[turns_of(turn)[i].finish])
        elif isinstance(ev, Started) and opt["echo"]:
            yield chunk(turn.prompt.text, echo=True)
        elif isinstance(ev, Text):
            yield chunk(ev.text)
        elif isinstance(ev, LogProbs) and opt["logprobs"]:
            pending.setdefault(i, []).extend(ev.entries)
    if turn.error is not None:
        yield sse(error_body(server.api_error(turn.error)))
    else:
        if opt["include_usage"]:
            yield sse({"id": opt["id"], "object": "text_completion", "created": opt["created"],
                       "model": server.model_id, "choices": [], "usage": usage(turn)})
    yield sse("[DONE]")


# -- responses (stateless) -------------------------------------------------------------

def response_input(f: Fields) -> list[dict]:
    msgs: list[dict] = []
    if f.has("instructions"):
        msgs.append({"role": "system", "content": f.str("instructions")})
    inp = f.require("input")
    if isinstance(inp, str):
        return msgs + [{"role": "user", "content": inp}]
    if not isinstance(inp, list):
        raise bad("'input' must be a string or an array of items", "input")
    thought = ""                           # a reasoning item's text, for the assistant turn it precedes
    for i, item in enumerate(inp):
        it = Fields(item, f"input[{i}].")
        kind = it.str("type", "message")
        if kind == "message":
            role = it.str("role", required=True)
            role = "system" if role == "developer" else role
            if role not in ("system", "user", "assistant"):
                raise bad(f"'input[{i}].role' {role!r} is not one of system, developer, user, assistant",
                          f"input[{i}].role")
            msgs.append({"role": role, "content": text_content(it.require("content"), f"input[{i}].content")})
            if role == "assistant" and thought:
                msgs[-1]["reasoning_content"], thought = thought, ""
        elif kind == "function_call":
            if thought:
                msgs.append({"role": "assistant", "content": "", "reasoning_content": thought})
                thought = ""
            call = {"id": it.str("call_id", required=True), "type": "function",
                    "function": {"name": it.str("name", required=True),
                                 "arguments": _arguments_obj(it.str("arguments", "{}"))}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.require("output")
            msgs.append({"role": "tool", "tool_call_id": it.str("call_id", required=True),
                         "content": out if isinstance(out, str) else text_content(out, f"input[{i}].output")})
        elif kind == "reasoning":          # rendered back only where the template wants it
            thought += "".join(c.get("text", "") for c in it.list("content", [])
                               if isinstance(c, dict) and isinstance(c.get("text"), str))
        else:
            raise bad(f"'input[{i}].type' {kind!r} is not supported", f"input[{i}].type")
    if not msgs:
        raise bad("'input' must not be empty", "input")
    return msgs


def parse_response(server, body: dict) -> tuple[Turn, dict]:
    f = Fields(body)
    f.str("model")
    if f.has("previous_response_id"):
        raise bad("'previous_response_id' is not supported: this server is stateless; send the "
                  "whole conversation in 'input'", "previous_response_id")
    messages = response_input(f)
    tools = None
    if f.list("tools"):
        tools = []
        for i, t in enumerate(f.list("tools")):
            tf = Fields(t, f"tools[{i}].")
            if tf.str("type", required=True) != "function":
                raise bad(f"'tools[{i}].type' {tf.get('type')!r} is not supported (function only)",
                          f"tools[{i}].type")
            d = {"name": tf.str("name", required=True),
                 "parameters": tf.dict("parameters", {"type": "object", "properties": {}})}
            if tf.has("description"):
                d["description"] = tf.str("description")
            tools.append({"type": "function", "function": d})
    choice = _tool_choice(f, tools, flat=True)
    parallel = f.bool("parallel_tool_calls", True)
    fmt = Fields(f.dict("text", {}), "text.").dict("format")
    grammar = structured.response_format(fmt, "text.format", flat=True)
    forced = structured.forced_tool(tools, choice)
    if forced:
        grammar = structured.tool_grammar(server, tools, choice, parallel)
    prompt = server.render(lambda: render_chat(server.engine, messages, tools=tools, tool_choice=choice,
                                               think=_think(f), prime=not forced, effort=_effort(f)))
    cfg = sampling(f, server.sampling)
    mt = f.int("max_output_tokens", None, 1)
    req = GenRequest(prompt.ids, max_tokens_for(server, prompt.ids, mt), cfg, [], server.engine.stop_ids,
                     processor=structured.constraint(server, prompt, grammar, think=_think(f)))
    turn = Turn(server, prompt, req, single_call=bool(tools) and (isinstance(choice, dict) or not parallel))
    return turn, {"stream": f.bool("stream", False), "id": _rid("resp_"), "created": int(time.time()),
                  "msg_id": _rid("msg_"), "rs_id": _rid("rs_"), "body": body, "tools": f.list("tools", []),
                  "tool_choice": f.get("tool_choice", "auto"), "parallel": parallel, "max": mt,
                  "temperature": cfg.temperature, "top_p": cfg.top_p, "format": fmt or {"type": "text"}}


def _response_obj(server, turn: Turn | None, opt: dict, status: str, output: list) -> dict:
    incomplete = None
    if turn is not None and status == "completed" and turn.finish == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    u = None
    if turn is not None and turn.done:
        p, c = turn.prompt_tokens, turn.completion_tokens
        u = {"input_tokens": p, "input_tokens_details": {"cached_tokens": turn.reused},
             "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}
    return {"id": opt["id"], "object": "response", "created_at": opt["created"], "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": opt["body"].get("instructions"),
            "max_output_tokens": opt["max"], "model": server.model_id, "output": output,
            "parallel_tool_calls": opt["parallel"], "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": opt["temperature"], "text": {"format": opt["format"]},
            "tool_choice": opt["tool_choice"], "tools": opt["tools"], "top_p": opt["top_p"],
            "truncation": "disabled", "usage": u, "metadata": opt["body"].get("metadata") or {}}


def _reasoning_item(opt, text: str) -> dict:
    return {"type": "reasoning", "id": opt["rs_id"], "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _message_item(opt, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": opt["msg_id"], "status": status, "role": "assistant", "content": content}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["name"], "arguments": call["arguments"], "status": status}


def respond_response(server, turn: Turn, opt: dict) -> dict:
    output = []
    if turn.reasoning_text:
        output.append(_reasoning_item(opt, turn.reasoning_text))
    if turn.content or not turn.calls:
        output.append(_message_item(opt, turn.content))
    output += [_call_item(c) for c in turn.calls]
    return _response_obj(server, turn, opt, "completed", output)


async def stream_response(server, turn: Turn, opt: dict) -> AsyncIterator[str]:
    seq = 0
    output: list[dict] = []
    cur: dict | None = None        # the open output item: {"kind", "index", "text"/"call"}

    def ev(kind: str, **data) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **data}, event=kind)

    def close() -> list[str]:
        nonlocal cur
        if cur is None:
            return []
        k, i, out = cur["kind"], cur["index"], []
        if k == "message":
            text = cur["text"]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out += [ev("response.output_text.done", item_id=opt["msg_id"], output_index=i, content_index=0,
                       text=text, logprobs=[]),
                    ev("response.content_part.done", item_id=opt["msg_id"], output_index=i,
                       content_index=0, part=part)]
            item = _message_item(opt, text)
        elif k == "reasoning":
            text = cur["text"]
            out.append(ev("response.reasoning_text.done", item_id=opt["rs_id"], output_index=i,
                          content_index=0, text=text))
            item = _reasoning_item(opt, text)
        else:
            item = _call_item(cur["call"])
            out.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                          arguments=item["arguments"]))
        out.append(ev("response.output_item.done", output_index=i, item=item))
        output.append(item)
        cur = None
        return out

    def open_(kind: str, call: dict | None = None) -> list[str]:
        nonlocal cur
        out = close()
        i = len(output)
        cur = {"kind": kind, "index": i, "text": "", "call": call}
        if kind == "message":
            out += [ev("response.output_item.added", output_index=i, item=_message_item(opt, "", "in_progress")),
                    ev("response.content_part.added", item_id=opt["msg_id"], output_index=i, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
        elif kind == "reasoning":
            item = {"type": "reasoning", "id": opt["rs_id"], "summary": [], "content": [],
                    "status": "in_progress"}
            out.append(ev("response.output_item.added", output_index=i, item=item))
        else:
            out.append(ev("response.output_item.added", output_index=i,
                          item=_call_item({**call, "arguments": ""}, "in_progress")))
        return out

    yield ev("response.created", response=_response_obj(server, None, opt, "in_progress", []))
    yield ev("response.in_progress", response=_response_obj(server, None, opt, "in_progress", []))
    async for e in turn.events():
        chunks: list[str] = []
        if isinstance(e, Text):
            if cur is None or cur["kind"] != "message":
                chunks += open_("message")
            cur["text"] += e.text
            chunks.append(ev("response.output_text.delta", item_id=opt["msg_id"], output_index=cur["index"],
                             content_index=0, delta=e.text, logprobs=[]))
        elif isinstance(e, Reasoning):
            if cur is None or cur["kind"] != "reasoning":
                chunks += open_("reasoning")
            cur["text"] += e.text
            chunks.append(ev("response.reasoning_text.delta", item_id=opt["rs_id"], output_index=cur["index"],
                             content_index=0, delta=e.text))
        elif isinstance(e, ToolStart):
            chunks += open_("call", {"id": e.id, "name": e.name, "arguments": ""})
        elif isinstance(e, ToolArgs):
            cur["call"]["arguments"] += e.text
            chunks.append(ev("response.function_call_arguments.delta",
                             item_id="fc_" + cur["call"]["id"].removeprefix("call_"),
                             output_index=cur["index"], delta=e.text))
        elif isinstance(e, ToolEnd):
            cur["call"]["arguments"] = e.arguments
            chunks += close()
        for c in chunks:
            yield c
    if turn.error is not None:
        err = server.api_error(turn.error)
        yield ev("error", code=err.code, message=err.message, param=err.param)
        return
    if not output and cur is None:
        for c in open_("message"):
            yield c
    for c in close():
        yield c
    final = _response_obj(server, turn, opt, "completed", output)
    yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
