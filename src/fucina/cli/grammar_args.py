"""The structured-output flags `fucina run` and `fucina chat` share:
--json-schema JSON|@FILE, --json-object, --regex R, --lark G|@FILE, --grammar GBNF|@FILE (one of them),
and --strict (a schema keyword the engine cannot enforce is an error, not a warning)."""
from __future__ import annotations

from fucina.errors import FucinaError


def add_grammar_args(p) -> None:
    g = p.add_argument_group("structured output (one of; the reply must match)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="JSON|@FILE", help="a JSON Schema the reply must satisfy")
    x.add_argument("--json-object", action="store_true", help="any JSON object")
    x.add_argument("--regex", metavar="R", help="a regex (Rust syntax) the whole reply must match")
    x.add_argument("--lark", metavar="G|@FILE", help="an llguidance Lark grammar")
    x.add_argument("--grammar", metavar="GBNF|@FILE", help="a llama.cpp GBNF grammar")
    g.add_argument("--strict", action="store_true",
                   help="a JSON Schema keyword the engine cannot enforce (uniqueItems, contains, not, if/then/else, "
                        "...) is an error; without it the rest is enforced, a warning names the keyword and the "
                        "reply is checked after generation")


def _text(spec: str | None, flag: str) -> str | None:
    if spec is None or not spec.startswith("@"):
        return spec
    try:
        with open(spec[1:], encoding="utf-8") as fh:
            return fh.read()
    except OSError as e:
        raise FucinaError(f"{flag}: cannot read {spec[1:]}: {e.strerror}") from e


def grammar_options(args) -> dict:
    """The Python API keywords the flags stand for (empty: unconstrained)."""
    schema = _text(getattr(args, "json_schema", None), "--json-schema")
    if getattr(args, "json_object", False):
        schema = '{"type": "object"}'
    out = {"json_schema": schema, "regex": getattr(args, "regex", None),
           "lark": _text(getattr(args, "lark", None), "--lark"),
           "grammar": _text(getattr(args, "grammar", None), "--grammar")}
    out = {k: v for k, v in out.items() if v is not None}
    if out and getattr(args, "strict", False):
        out["strict"] = True
    return out


def reply_constraint(llm, args, *, think: bool):
    """The chat reply's Constraint for the flags given (None: unconstrained)."""
    from fucina.text import grammar as grammars
    from fucina.text.constraint import for_reply

    g = grammars.from_options(**grammar_options(args))
    return for_reply(llm.tokenizer, g, stop_ids=llm.template.stop_ids(llm.tokenizer),
                     n_vocab=llm.config.n_vocab, template=llm.template, think=think)
