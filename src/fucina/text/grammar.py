"""Grammar sources for constrained decoding, compiled to llguidance grammar JSON.

Every builder returns the JSON text an `LLMatcher` takes; `check()` compiles it once
and turns llguidance's complaint into a `GrammarError` naming the problem (a bad
regex, an unknown Lark rule, an unsatisfiable schema).

JSON Schema is strict or lenient (OpenAI's `strict`). A keyword the engine cannot
enforce while generating (`uniqueItems`, `contains`, `not`, `if`/`then`/`else`,
`dependentRequired`, `dependentSchemas`, `propertyNames`, `unevaluatedProperties`) is
a GrammarError under strict; otherwise (the default) the rest of the schema is
enforced, a SchemaWarning names the keyword, and the grammar (a `Grammar`, a str that
carries the schema) lets the Constraint check the finished reply against the whole
schema (with the jsonschema package, when installed).

JSON comes out compact and model-friendly (`{"a": 1, "b": [2, 3]}`): no free
whitespace (a sampled model would otherwise pad forever), `": "` and `", "` as the
separators; a schema's own `x-guidance` options override these.

Template-aware wrappers (`think_wrapped`, `tool_call_grammar`) compose the user's
grammar with the model's own syntax: free text inside the think block, then the
constraint; a forced tool call as `<tool_call>{"name", "arguments"}</tool_call>`
(hermes, the convention serve/prompt.py renders), each tool's arguments constrained
by its parameters schema. Markers that are single special tokens in the vocabulary
are referenced by id (`<[151657]>`), so the model emits its native token.
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Mapping, Sequence

from fucina.errors import GrammarError, SchemaWarning

JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
ANY_JSON_OBJECT = {"type": "object"}


def _llg():
    """llguidance, imported on first use: a plain generate/chat never pays its ~35 ms import."""
    import llguidance
    return llguidance


def schema_dict(schema: Any) -> dict:
    """A JSON Schema from a dict, JSON text, or a pydantic model (class or instance)."""
    if hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"JSON schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
    return dict(schema)


class Grammar(str):
    """Grammar text compiled from a JSON schema the engine enforces only in part:
    `schema` (the whole schema, to check the finished reply against) and `unenforced`
    (the engine's notes naming the keywords it left out)."""
    schema: dict | None = None
    unenforced: tuple[str, ...] = ()
    whole_reply: bool = False      # already spells the model's whole reply (a harmony call)


def json_schema(schema: Any, strict: bool = False) -> str:
    """The grammar for `schema`. strict: a keyword the engine cannot enforce is an
    error; otherwise it is left out with a SchemaWarning and checked after generation."""
    d = schema_dict(schema)
    g = _llg().LLMatcher.grammar_from_json_schema(json.dumps(d), defaults={**JSON_OPTIONS, "lenient": not strict})
    if strict:
        return g
    is_error, notes = _llg().LLMatcher.validate_grammar_with_warnings(g, None)
    if is_error or not notes:
        return g
    out = Grammar(g)
    out.schema, out.unenforced = d, tuple(n.strip() for n in notes)
    warnings.warn(f"JSON schema: {'; '.join(out.unenforced)}: not enforced while generating, the reply is "
                  f"checked after (strict makes this an error)", SchemaWarning, stacklevel=3)
    return out


UNENFORCED = "Unimplemented keys"


def reply_problem(schema: dict, text: str) -> str | None:
    """Why `text` (a finished reply) breaks `schema`; None when it satisfies it, or when
    it cannot be checked here (no jsonschema package)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"the reply is not JSON: {e}"
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        err = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    except jsonschema.exceptions.SchemaError as e:
        return f"the schema itself is invalid: {e.message}"
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path)
    return f"{err.message}" + (f" (at /{where})" if where else "")


def json_object() -> str:
    return json_schema(ANY_JSON_OBJECT)


def regex(pattern: str) -> str:
    return _llg().LLMatcher.grammar_from_regex(pattern)


def lark(text: str) -> str:
    return _llg().LLMatcher.grammar_from_lark(text)


def gbnf(text: str) -> str:
    """A llama.cpp GBNF grammar (Lark text is recognised and passed through)."""
    try:
        return _llg().grammar_from("gbnf", text)
    except ValueError as e:
        raise GrammarError(f"GBNF grammar: {e}") from None


def choice(options: Sequence[str]) -> str:
    if not options or not all(isinstance(o, str) for o in options):
        raise GrammarError("a choice list must be a non-empty list of strings")
    return lark("start: " + " | ".join(json.dumps(o) for o in options))


def from_options(*, json_schema: Any = None, regex: str | None = None, lark: str | None = None,
                 grammar: str | None = None, choices: Sequence[str] | None = None,
                 strict: bool = False) -> str | None:
    """The one grammar the keyword options name (None: unconstrained). More than one
    is an error: they cannot be combined. strict: a JSON schema keyword the engine
    cannot enforce is an error (otherwise a warning, and the reply checked after)."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("lark", lark),
                                ("grammar", grammar), ("choices", choices)) if v is not None}
    if len(given) > 1:
        raise GrammarError(f"give one of json_schema, regex, lark, grammar, choices, not "
                           f"{' and '.join(given)}")
    if not given:
        return None
    (kind, value), = given.items()
    if kind == "json_schema":
        return check(_json_schema(value, strict), kind)
    return check(_BUILDERS[kind](value), kind)


_json_schema = json_schema
_BUILDERS = {"json_schema": json_schema, "regex": regex, "lark": lark, "grammar": gbnf, "choices": choice}

_KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "lark": "Lark grammar",
               "grammar": "grammar", "choices": "choice list", "tool": "tool schema"}


def check(grammar: str, kind: str = "grammar", tokenizer: Any = None) -> str:
    """Compile once; a problem raises GrammarError naming it. Returns the grammar."""
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        what = _KIND_NAMES.get(kind, kind)
        detail = (messages[0] if messages else "invalid").strip()
        if detail.startswith(UNENFORCED):
            detail += (" (strict: the engine cannot enforce these keywords while generating; without "
                       "strict it enforces the rest and checks the reply after)")
        raise GrammarError(f"{what}: {detail}")
    notes = [m.strip() for m in messages if m.strip().startswith(UNENFORCED)]
    if notes and not isinstance(grammar, Grammar):       # a json_schema() Grammar has warned already
        warnings.warn(f"{_KIND_NAMES.get(kind, kind)}: {'; '.join(notes)}: not enforced while generating "
                      f"(strict makes this an error)", SchemaWarning, stacklevel=3)
    return grammar


# -- template-aware composition ---------------------------------------------------------

def token_ref(tokenizer, text: str) -> str:
    """A Lark item for `text`: `<[id]>` when it is one special token, else a literal."""
    tid = tokenizer.token_id(text) if tokenizer is not None else None
    if tid is not None and tokenizer.token_to_piece(tid) == text.encode() and _is_special(tokenizer, tid):
        return f"<[{tid}]>"
    return json.dumps(text)


def _is_special(tokenizer, tid: int) -> bool:
    from fucina.text.tokenizer.special import special_ids
    return tid in special_ids(tokenizer)


def _named(grammar: str, name: str) -> list[dict]:
    """The grammar's list form with its top grammar named (Lark text is its own form)."""
    try:
        gs = json.loads(grammar)["grammars"]
    except ValueError:
        gs = [{"lark_grammar": grammar}]
    gs[0] = {**gs[0], "name": name}
    return gs


def think_wrapped(grammar: str, tokenizer, *, primed: bool) -> str:
    """Free text in a think block, then `grammar`. `primed`: the prompt already ends
    with the opening marker (the reply starts inside the block); otherwise the block
    is optional (a model may answer straight away). A closing marker that is one
    special token ends the free text by itself (no text can spell it); a textual one
    is the free text's stop string (a lazy lexeme: greedy free text would swallow it)."""
    open_, close = token_ref(tokenizer, "<think>"), token_ref(tokenizer, "</think>")
    if close.startswith("<["):
        think = f"think: THINK {close}\nTHINK: /(?s:.*)/\n"
    else:
        think = f"think[stop={close}]: /(?s:.*)/\n"
    start = "start: think /\\n{0,2}/ @body\n" if primed else f"start: ({open_} think /\\n{{0,2}}/)? @body\n"
    return _carry(grammar, json.dumps({"grammars": [{"lark_grammar": start + think}] + _named(grammar, "body")}))


def _harmony_analysis(tokenizer) -> tuple[str, dict[str, str]]:
    """Lark for gpt-oss's optional analysis messages before the one the grammar governs
    (the reply starts after `<|start|>assistant`); the harmony markers by token id."""
    t = {k: token_ref(tokenizer, v) for k, v in (("ch", "<|channel|>"), ("msg", "<|message|>"),
                                                  ("end", "<|end|>"), ("start", "<|start|>"),
                                                  ("con", "<|constrain|>"))}
    free = "THOUGHT: /(?s:.*)/\n" if t["end"].startswith("<[") else f'THOUGHT[stop={t["end"]}]: /(?s:.*)/\n'
    close = t["end"] if t["end"].startswith("<[") else ""
    rule = f'analysis: {t["ch"]} "analysis" {t["msg"]} THOUGHT {close} {t["start"]} "assistant"\n' + free
    return rule, t


def harmony_wrapped(grammar: str, tokenizer) -> str:
    """gpt-oss (harmony): free analysis messages, then the final message, whose body is
    `grammar` (the whole reply is `<|channel|>final<|message|>BODY`, as the parser reads it)."""
    rule, t = _harmony_analysis(tokenizer)
    start = f'start: analysis* {t["ch"]} "final" {t["msg"]} @body\n'
    return _carry(grammar, json.dumps({"grammars": [{"lark_grammar": start + rule}] + _named(grammar, "body")}))


def harmony_call_grammar(tools: Sequence[Mapping[str, Any]], tokenizer, *, name: str | None = None) -> str:
    """A forced gpt-oss tool call: optional analysis, then one `<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>ARGS` message (harmony calls one tool a
    turn; `<|call|>` ends it), ARGS valid under the tool's parameters schema. The
    result is the whole reply's grammar (`whole_reply`): it is not wrapped again."""
    fns = [_function(t) for t in tools]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
    if not fns:
        raise GrammarError(f"no declared tool named {name!r}" if name else "no tools to call")
    rule, t = _harmony_analysis(tokenizer)
    alts, rules = [], []
    for i, fn in enumerate(fns):
        params = schema_dict(fn.get("parameters") or {"type": "object", "properties": {}})
        params = {**params, "x-guidance": {**JSON_OPTIONS, "lenient": not fn.get("strict", False)}}
        alts.append(f"fn{i}")
        rules.append(f'fn{i}: {json.dumps(fn.get("name"))} " " {t["con"]} "json" {t["msg"]} args{i}\n'
                     f"args{i}: %json {json.dumps(params)}\n")
    text = (f'start: analysis? {t["ch"]} "commentary to=functions." call\n'
            f"call: {' | '.join(alts)}\n" + "".join(rules) + rule)
    out = Grammar(check(lark(text), "tool"))
    out.whole_reply = True
    return out


def _carry(inner: str, outer: str) -> str:
    """`outer` (a grammar wrapping `inner`) keeps inner's partly enforced schema."""
    if getattr(inner, "schema", None) is None:
        return outer
    out = Grammar(outer)
    out.schema, out.unenforced = inner.schema, inner.unenforced
    return out


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    return tool.get("function", tool)


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], tokenizer, *, name: str | None = None,
                      parallel: bool = False) -> str:
    """One (or, with `parallel`, one or more) hermes tool calls, each naming a declared
    tool (`name`: only that one) with arguments valid under its parameters schema."""
    fns = [_function(t) for t in tools]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
    if not fns:
        raise GrammarError(f"no declared tool named {name!r}" if name else "no tools to call")
    rules = []
    for i, fn in enumerate(fns):
        params = schema_dict(fn.get("parameters") or {"type": "object", "properties": {}})
        call = {"x-guidance": {**JSON_OPTIONS, "lenient": not fn.get("strict", False)}, "type": "object",
                "properties": {"name": {"const": fn.get("name")}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"fn{i}: %json {json.dumps(call)}")
    open_, close = token_ref(tokenizer, "<tool_call>"), token_ref(tokenizer, "</tool_call>")
    many = ' ("\\n" call)*' if parallel else ""
    text = (f"start: call{many}\n"
            f'call: {open_} "\\n" body "\\n" {close}\n'
            f"body: {' | '.join(f'fn{i}' for i in range(len(fns)))}\n" + "\n".join(rules) + "\n")
    return check(lark(text), "tool")
