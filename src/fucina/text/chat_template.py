"""Chat templates: the GGUF's own `tokenizer.chat_template` rendered with Jinja the way
Hugging Face and llama.cpp do, plus built-in formats (ChatML, Llama 3, Gemma, Gemma 4)
for files without one.

The environment is HF's: a sandboxed, immutable Jinja environment with trim_blocks,
lstrip_blocks and loop controls, `tojson` without ASCII escaping, `raise_exception`,
`strftime_now` and the `{% generation %}` tag. Variables: `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, and when given `tools` and
`enable_thinking` (omitted otherwise, as llama.cpp omits empty tools), plus any extra
keyword. The output is the template's text exactly: strip a leading BOS text only where
the tokenizer adds BOS itself (`prompt_ids` does that, as llama.cpp does).
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from functools import cache

from fucina.errors import FucinaError

Message = Mapping[str, Any]


class ChatTemplateError(FucinaError):
    """A chat template failed to compile or render (includes `raise_exception`)."""


def _raise(message: str):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def jinja_environment() -> "jinja2.sandbox.ImmutableSandboxedEnvironment":
    # jinja2 is imported here, on first render, not with the module (~40 ms of every start-up)
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(Extension):
        """HF's `{% generation %}...{% endgeneration %}`: marks assistant spans; renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_env = cache(jinja_environment)

# -- built-in formats ----------------------------------------------------------------

_STRIP_THINK = "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"

BUILTIN: dict[str, str] = {
    "chatml": (
        "{% if not messages %}{{ raise_exception('no messages') }}{% endif %}"
        "{% if tools %}<|im_start|>system\n"
        "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
        "{% endif %}"
        "{% for m in messages %}{% set content = m.content or '' %}"
        "{% if m.role == 'system' and tools and loop.first %}{% continue %}{% endif %}"
        "{% if m.role == 'assistant' and not loop.last %}" + _STRIP_THINK + "{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"),
    "llama3": (
        "{% if not messages %}{{ raise_exception('no messages') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}"
        "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ (m.content or '') | trim }}<|eot_id|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "gemma": (
        "{% if not messages %}{{ raise_exception('no messages') }}{% endif %}"
        "{{ bos_token }}{% set ns = namespace(sys='', start=0) %}"
        "{% for m in messages %}{% if m.role == 'system' and ns.start == loop.index0 %}"
        "{% set ns.sys = ns.sys + m.content + '\n\n' %}{% set ns.start = loop.index %}{% endif %}{% endfor %}"
        "{% for m in messages[ns.start:] %}"
        "{% if m.role == 'system' %}{{ raise_exception('system message mid-conversation') }}{% endif %}"
        "{% set content = m.content or '' %}"
        "{% if m.role == 'assistant' and not loop.last %}" + _STRIP_THINK + "{% endif %}"
        "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{{ (ns.sys if loop.first else '') + content | trim }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "gemma4": (
        "{% if not messages %}{{ raise_exception('no messages') }}{% endif %}"
        "{{ bos_token }}{% set ns = namespace(start=0) %}"
        "{% if messages[0].role == 'system' %}<|turn>system\n{{ messages[0].content | trim }}<turn|>\n"
        "{% set ns.start = 1 %}{% endif %}"
        "{% for m in messages[ns.start:] %}"
        "{% if m.role == 'system' %}{{ raise_exception('system message mid-conversation') }}{% endif %}"
        "{% set content = m.content or '' %}"
        "{% if m.role == 'assistant' %}{% set content = content.split('<channel|>')[-1] %}{% endif %}"
        "<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ content | trim }}<turn|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|turn>model\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<|channel>thought\n<channel|>{% endif %}"
        "{% endif %}"),
}

# harmony (gpt-oss), for a gpt-oss file without its template: the system message, the
# developer message (instructions, tools as a TypeScript namespace: scalars, enums, arrays
# of scalars; anything deeper is `any`), calls written back as `to=functions.NAME` with the
# reasoning before them kept only while no final answer follows, tool results as
# `functions.NAME to=assistant` commentary; past analysis dropped (fucina.text.harmony).
_HARMONY_TYPE = (    # one line of Jinja: every newline is an expression, so trim_blocks cannot eat one
    "{% macro ts(p) %}"
    "{% if p.enum %}{{ '\"' + p.enum | join('\" | \"') + '\"' }}"
    "{% elif p.type == 'string' %}string"
    "{% elif p.type in ('number', 'integer') %}number"
    "{% elif p.type == 'boolean' %}boolean"
    "{% elif p.type == 'array' %}"
    "{{ {'string': 'string[]', 'number': 'number[]', 'integer': 'number[]', 'boolean': 'boolean[]'}"
    ".get((p['items'] or {}).type, 'any[]') }}"
    "{% elif p.type == 'object' %}object"
    "{% else %}any{% endif %}"
    "{% endmacro %}")
BUILTIN["harmony"] = (
    _HARMONY_TYPE +
    "{% if not messages %}{{ raise_exception('no messages') }}{% endif %}"
    "<|start|>system<|message|>{{ model_identity if model_identity is defined else "
    "'You are ChatGPT, a large language model trained by OpenAI.' }}{{ '\\n' }}"
    "Knowledge cutoff: 2024-06{{ '\\n' }}Current date: {{ strftime_now('%Y-%m-%d') }}{{ '\\n\\n' }}"
    "Reasoning: {{ reasoning_effort if reasoning_effort is defined else 'medium' }}{{ '\\n\\n' }}"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'.{% endif %}"
    "<|end|>"
    "{% set ns = namespace(start=0, dev='', call=none) %}"
    "{% if messages[0].role in ('system', 'developer') %}"
    "{% set ns.dev = messages[0].content %}{% set ns.start = 1 %}{% endif %}"
    "{% if ns.dev or tools %}<|start|>developer<|message|>"
    "{% if ns.dev %}# Instructions{{ '\\n\\n' + ns.dev + '\\n\\n' }}{% endif %}"
    "{% if tools %}# Tools{{ '\\n\\n' }}## functions{{ '\\n\\n' }}namespace functions {{ '{\\n\\n' }}"
    "{% for t in tools %}{% set f = t.function or t %}"
    "// {{ f.description }}{{ '\\n' }}type {{ f.name }} = "
    "{% if f.parameters and f.parameters.properties %}(_: {{ '{\\n' }}"
    "{% for k, p in f.parameters.properties.items() %}"
    "{% if p.description %}// {{ p.description }}{{ '\\n' }}{% endif %}"
    "{{ k }}{{ '' if k in (f.parameters.required or []) else '?' }}: {{ ts(p) }}"
    "{% if p.default is defined %}, // default: "
    "{{ p.default if p.enum else p.default | tojson }}{% endif %},{{ '\\n' }}"
    "{% endfor %}}) => any;{{ '\\n\\n' }}"
    "{% else %}() => any;{{ '\\n\\n' }}{% endif %}"
    "{% endfor %}} // namespace functions{% endif %}<|end|>"
    "{% endif %}"
    "{% set msgs = messages[ns.start:] %}"
    "{% for m in msgs %}"
    "{% if m.role == 'assistant' and m.tool_calls %}"
    "{% set later = namespace(final=false) %}"
    "{% for n in msgs[loop.index:] %}{% if n.role == 'assistant' and not n.tool_calls %}"
    "{% set later.final = true %}{% endif %}{% endfor %}"
    "{% set c = m.tool_calls[0].function or m.tool_calls[0] %}"
    "{% set thought = m.thinking or m.content %}"
    "{% if thought and not later.final %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ thought }}<|end|>{% endif %}"
    "<|start|>assistant to=functions.{{ c.name }}<|channel|>commentary json<|message|>"
    "{{ c.arguments | tojson }}<|call|>{% set ns.call = c.name %}"
    "{% elif m.role == 'assistant' %}"
    "{% if loop.last and not add_generation_prompt %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|return|>"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% set ns.call = none %}"
    "{% elif m.role == 'tool' %}"
    "{% if ns.call is none %}{{ raise_exception('a tool message without an earlier tool call') }}{% endif %}"
    "<|start|>functions.{{ ns.call }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{% elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

STOP_MARKERS = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>",
                "gemma4": "<turn|>", "harmony": "<|return|>"}
# more texts that end an assistant turn (harmony: a tool call ends it too)
EXTRA_STOPS = {"harmony": ("<|call|>",)}

# reasoning block delimiters per format, for splitting a reply
REASONING = {"chatml": ("<think>", "</think>"), "gemma4": ("<|channel>thought", "<channel|>")}


def detect_format(source: str | None) -> str | None:
    """Sniff the turn protocol from a template's text (or a vocabulary's markers)."""
    if not source:
        return None
    for marker, name in (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama3"),
                         ("<|turn>", "gemma4"), ("<start_of_turn>", "gemma"), ("<|channel|>", "harmony")):
        if marker in source:
            return name
    return None


def split_reasoning(text: str, fmt: str | None = "chatml") -> tuple[str, str]:
    """(reasoning, answer) of a reply; reasoning is '' when the reply has no block."""
    open_, close = REASONING.get(fmt or "chatml", REASONING["chatml"])
    if close not in text:
        return "", text
    head, _, tail = text.partition(close)
    return head.replace(open_, "", 1).strip(), tail.lstrip("\n")


class ChatTemplate:
    """One chat template: Jinja source plus the special-token texts it may use."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 name: str | None = None, tool_source: str | None = None):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.format = detect_format(source)
        self.name = name or self.format or "custom"
        self.tool_source = tool_source
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def builtin(cls, fmt: str, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        if fmt not in BUILTIN:
            raise ChatTemplateError(f"unknown built-in chat format {fmt!r} "
                                    f"(known: {', '.join(sorted(BUILTIN))})")
        t = cls(BUILTIN[fmt], bos_token=bos_token, eos_token=eos_token, name=fmt)
        t.format = fmt
        return t

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tokenizer=None,
                      fallback: str | None = None) -> "ChatTemplate":
        """The GGUF's own template when it has one; else a built-in format, chosen by
        `fallback` or sniffed from the vocabulary's turn markers (ChatML otherwise).
        BOS/EOS texts come from the tokenizer when given, else from the vocabulary."""
        vocab = metadata.get("tokenizer.ggml.tokens")
        vocab = list(vocab) if vocab is not None else []

        def text(key: str, attr: str) -> str:
            if tokenizer is not None:
                return _piece_text(tokenizer, getattr(tokenizer, attr, None))
            i = metadata.get(key)
            return str(vocab[int(i)]) if i is not None and 0 <= int(i) < len(vocab) else ""

        bos = text("tokenizer.ggml.bos_token_id", "bos_id")
        eos = text("tokenizer.ggml.eos_token_id", "eos_id")
        src = metadata.get("tokenizer.chat_template")
        if isinstance(src, str) and src.strip() and fallback is None:
            return cls(src, bos_token=bos, eos_token=eos,
                       tool_source=metadata.get("tokenizer.chat_template.tool_use"))
        fmt = fallback
        if fmt is None:
            known = set(vocab)
            for marker in ("<|im_start|>", "<|start_header_id|>", "<|turn>", "<start_of_turn>", "<|channel|>"):
                if marker in known or (tokenizer is not None and tokenizer.token_id(marker) is not None):
                    fmt = detect_format(marker)
                    break
        return cls.builtin(fmt or "chatml", bos, eos)

    @property
    def stop_marker(self) -> str | None:
        return STOP_MARKERS.get(self.format) if self.format else None

    def _template(self, source: str) -> jinja2.Template:
        import jinja2

        t = self._compiled.get(source)
        if t is None:
            try:
                t = self._compiled[source] = _env().from_string(source)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"chat template {self.name!r} does not compile: {e}") from e
        return t

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               enable_thinking: bool | None = None, **extra: Any) -> str:
        variables: dict[str, Any] = dict(extra)
        variables.update(messages=[dict(m) for m in messages],
                         add_generation_prompt=add_generation_prompt,
                         bos_token=self.bos_token, eos_token=self.eos_token)
        if tools:
            variables["tools"] = [dict(t) for t in tools]
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        src = self.tool_source if tools and self.tool_source else self.source
        import jinja2

        try:
            return self._template(src).render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template {self.name!r}: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"chat template {self.name!r} failed: {type(e).__name__}: {e}") from e

    def stop_ids(self, tokenizer) -> set[int]:
        """Token ids that end an assistant turn: the format's stop marker, the
        tokenizer's end-of-generation ids and EOS."""
        ids = set(getattr(tokenizer, "eog_ids", ()) or ())
        eos = getattr(tokenizer, "eos_id", None)
        if eos is not None and eos >= 0:
            ids.add(eos)
        for text in (self.stop_marker, self.eos_token, *EXTRA_STOPS.get(self.format, ())):
            if text:
                i = tokenizer.token_id(text)
                if i is not None:
                    ids.add(i)
        return ids


def _piece_text(tokenizer, i) -> str:
    if i is None or i < 0:
        return ""
    return tokenizer.token_to_piece(i).decode("utf-8", "replace")


def prompt_ids(tokenizer, text: str) -> list[int]:
    """Tokenize a rendered prompt as llama.cpp's chat path does: special tokens parsed,
    BOS added per the model's policy, and a BOS the template already wrote not doubled."""
    ids = tokenizer.encode(text, add_special=True, parse_special=True)
    bos = getattr(tokenizer, "bos_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    return ids
