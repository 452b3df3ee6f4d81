"""Structured output for every dialect: request fields -> one grammar Constraint.

- OpenAI Chat Completions `response_format`: `{"type": "json_object"}` or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (what
  `client.chat.completions.parse(response_format=PydanticModel)` sends);
- Responses `text.format`: the same, flat (`{"type": "json_schema", "name", "schema"}`);
- llama.cpp-server's body fields `json_schema` (a schema object) and `grammar` (GBNF);
- a forced tool choice (OpenAI `"required"` / a named function, Anthropic `any` /
  `tool`): the reply is the model's tool-call syntax with each call's arguments valid
  under that tool's parameters schema (`parallel_tool_calls` allows several calls).

A malformed schema or grammar is a 400 naming the problem (never a silent fallback
to any-JSON). A schema keyword the engine cannot enforce while generating is a 400
under `"strict": true` (response_format's json_schema, text.format, a function's
`strict`); otherwise the rest is enforced, the server logs a warning naming the
keyword, and the finished reply is checked against the whole schema (a violation is
logged). On a thinking template the think block stays free and the grammar governs
what follows it; on gpt-oss (harmony) the analysis messages stay free and the grammar
governs the final message's body, and a forced call is written in harmony's own syntax.
"""
from __future__ import annotations

from typing import Any

from fucina.errors import GrammarError
from fucina.serve.protocol import Fields, bad
from fucina.text import grammar as grammars
from fucina.text.constraint import Constraint, thinks
from fucina.text.harmony import is_harmony


def forced_tool(tools: list[dict] | None, choice: Any) -> bool:
    """Whether the tool choice obliges a call (so the grammar writes it, unprimed)."""
    return bool(tools) and (choice == "required" or isinstance(choice, dict))


def _compile(build, path: str, *args) -> str:
    try:
        return build(*args)
    except GrammarError as e:
        raise bad(f"'{path}': {e}", path, code="invalid_grammar") from None


def _checked(grammar: str, kind: str, path: str) -> str:
    return _compile(lambda: grammars.check(grammar, kind), path)


def response_format(fmt: dict | None, path: str, *, flat: bool = False) -> str | None:
    """OpenAI's response_format / Responses text.format -> a grammar (None: text)."""
    if fmt is None:
        return None
    f = Fields(fmt, path + ".")
    kind = f.str("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return grammars.json_object()
    if kind != "json_schema":
        raise bad(f"'{path}.type' must be text, json_object or json_schema, not {kind!r}", path + ".type")
    spec = f if flat else Fields(f.dict("json_schema", required=True), path + ".json_schema.")
    spec.str("name")
    schema = spec.dict("schema")
    where = spec.path("schema")
    strict = spec.bool("strict", False)
    if schema is None:
        return grammars.json_object()
    return _checked(_compile(grammars.json_schema, where, schema, strict), "json_schema", where)


def llamacpp_fields(f: Fields) -> str | None:
    """llama.cpp-server's `json_schema` / `grammar` body fields."""
    if f.has("json_schema") and f.has("grammar"):
        raise bad("give 'json_schema' or 'grammar', not both", "grammar")
    if f.has("json_schema"):
        schema = f.get("json_schema")
        if not isinstance(schema, (dict, bool)):
            raise bad("'json_schema' must be a JSON Schema object", "json_schema")
        return _checked(_compile(grammars.json_schema, "json_schema", schema), "json_schema", "json_schema")
    if f.has("grammar"):
        text = f.str("grammar")
        return _checked(_compile(grammars.gbnf, "grammar", text), "grammar", "grammar") if text.strip() else None
    return None


def tool_grammar(server, tools: list[dict], choice: Any, parallel: bool) -> str:
    name = choice.get("name") if isinstance(choice, dict) else None
    if is_harmony(server.engine.template):      # gpt-oss: one call a turn, in its own syntax
        return _compile(lambda: grammars.harmony_call_grammar(tools, server.engine.tokenizer, name=name),
                        "tools")
    return _compile(lambda: grammars.tool_call_grammar(tools, server.engine.tokenizer, name=name,
                                                       parallel=parallel and name is None),
                    "tools")


def constraint(server, prompt, grammar: str | None, *, think: bool | None = None) -> Constraint | None:
    """The request's Constraint over `grammar` for the rendered `prompt`."""
    if grammar is None:
        return None
    eng = server.engine
    text = prompt.text.rstrip()
    if getattr(prompt, "harmony", False):
        if not getattr(grammar, "whole_reply", False):
            grammar = _compile(grammars.harmony_wrapped, "response_format", grammar, eng.tokenizer)
    elif think is not False and thinks(eng.template) and not text.endswith("</think>"):
        grammar = grammars.think_wrapped(grammar, eng.tokenizer, primed=text.endswith("<think>"))
    try:
        return Constraint(eng.tokenizer, grammar, stop_ids=eng.stop_ids, n_vocab=eng.model.config.n_vocab)
    except GrammarError as e:
        raise bad(str(e), "response_format", code="invalid_grammar") from None
