"""Request validation shared by the dialects, and the error every dialect renders.

`Fields` reads one JSON object, checking types and ranges; a bad value raises
`ApiError(400, ...)` naming the field by its path (`messages[2].content`), which each
dialect turns into its own error schema.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from fucina.text.defaults import default_sampling
from fucina.text.sampler import SamplingConfig

_MISSING = object()


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, dict(headers or {})


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def check_depth(value: Any, limit: int) -> None:
    """400 when JSON `value` nests arrays/objects deeper than `limit` (iterative: a
    hostile body cannot exhaust the stack here or in the code that walks it later)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            if d > limit:
                raise bad(f"the request body nests JSON deeper than {limit} levels", code="too_deep")
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))


def _tname(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


class Fields:
    """Typed access to one JSON object, errors naming `prefix + key`."""

    def __init__(self, obj: Any, prefix: str = ""):
        if not isinstance(obj, dict):
            raise bad(f"{prefix.rstrip('.') or 'the request body'} must be a JSON object, "
                      f"not {_tname(obj)}", prefix.rstrip(".") or None)
        self.obj, self.prefix = obj, prefix

    def path(self, key: str) -> str:
        return self.prefix + key

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        v = self.obj.get(key)
        return default if v is None else v

    def require(self, key: str) -> Any:
        v = self.obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            raise bad(f"'{self.path(key)}' is required", self.path(key))
        return v

    def _typed(self, key, types, what, required, default):
        v = self.require(key) if required else self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise bad(f"'{self.path(key)}' must be {what}, not {_tname(v)}", self.path(key))
        return v

    def str(self, key: str, default: str | None = None, required: bool = False) -> str | None:
        return self._typed(key, (str,), "a string", required, default)

    def bool(self, key: str, default: bool | None = None) -> bool | None:
        return self._typed(key, (bool,), "a boolean", False, default)

    def list(self, key: str, default=None, required: bool = False) -> list | None:
        return self._typed(key, (list,), "an array", required, default)

    def dict(self, key: str, default=None, required: bool = False) -> dict | None:
        return self._typed(key, (dict,), "an object", required, default)

    def num(self, key: str, default: float | None = None, lo: float | None = None,
            hi: float | None = None) -> float | None:
        v = self._typed(key, (int, float), "a number", False, default)
        if v is not None and not math.isfinite(v):
            raise bad(f"'{self.path(key)}' must be a finite number, got {v}", self.path(key))
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            raise bad(f"'{self.path(key)}' must be in [{lo}, {hi}], got {v}", self.path(key))
        return v

    def int(self, key: str, default: int | None = None, lo: int | None = None,
            hi: int | None = None, required: bool = False) -> int | None:
        v = self._typed(key, (int,), "an integer", required, default)
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise bad(f"'{self.path(key)}' must be {rng}, got {v}", self.path(key))
        return v

    def stops(self, key: str) -> list[str]:
        v = self.obj.get(key)
        if v is None:
            return []
        if isinstance(v, str):
            return [v] if v else []
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            if len(v) > 16:
                raise bad(f"'{self.path(key)}' may hold at most 16 sequences", self.path(key))
            return [s for s in v if s]
        raise bad(f"'{self.path(key)}' must be a string or an array of strings", self.path(key))


def sampling(f: Fields, base: SamplingConfig | None = None, *, seed: int | None = None) -> SamplingConfig:
    """The sampling fields every dialect shares (OpenAI names, llama.cpp extensions).
    An unset field takes `base` (the server's: the model's recommendation, else
    llama.cpp's defaults, as llama-server); no seed means a fresh one."""
    from fucina.text.defaults import fresh_seed

    b = base or default_sampling()
    s = f.int("seed", None)
    if s is None:
        s = seed if seed is not None else fresh_seed()
    return SamplingConfig(
        temperature=f.num("temperature", b.temperature, 0.0, 2.0),
        top_p=f.num("top_p", b.top_p, 0.0, 1.0),
        top_k=f.int("top_k", b.top_k, 0),
        min_p=f.num("min_p", b.min_p, 0.0, 1.0),
        frequency_penalty=f.num("frequency_penalty", b.frequency_penalty, -2.0, 2.0),
        presence_penalty=f.num("presence_penalty", b.presence_penalty, -2.0, 2.0),
        repeat_penalty=f.num("repeat_penalty", b.repeat_penalty, 0.0, 10.0) or 1.0,
        repeat_last_n=f.int("repeat_last_n", b.repeat_last_n, -1),
        seed=s & 0xFFFFFFFF)


def speculation(f: Fields, tokenizer) -> tuple[bool | None, list[list[int]]]:
    """`speculative` (a fucina extension: true/false overrides serve --spec) and OpenAI
    Predicted Outputs, `prediction: {"type": "content", "content": text or text parts}`,
    which becomes a reference document the drafts copy from."""
    on = f.bool("speculative", None)
    pred = f.dict("prediction")
    if pred is None:
        return on, []
    pf = Fields(pred, "prediction.")
    if pf.str("type", "content") != "content":
        raise bad("'prediction.type' must be 'content'", "prediction.type")
    content = pf.require("content")
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            cf = Fields(part, f"prediction.content[{i}].")
            if cf.str("type", "text") != "text":
                raise bad(f"'prediction.content[{i}].type' must be 'text'", f"prediction.content[{i}].type")
            parts.append(cf.str("text", required=True))
        content = "".join(parts)
    elif not isinstance(content, str):
        raise bad("'prediction.content' must be a string or an array of text parts", "prediction.content")
    if on is False or not content:
        return on, []
    return True, [tokenizer.encode(content, add_special=False, parse_special=False)]


# -- request pieces every dialect reads (a dialect never imports another's) ------

def text_content(content: Any, path: str, *, allowed=("text", "input_text", "output_text")) -> str:
    """A message's `content`: a string, or an array of text parts (each of a type in
    `allowed`) joined as llama-server joins them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{path}' must be a string or an array of content parts", path)
    out = []
    for j, part in enumerate(content):
        f = Fields(part, f"{path}[{j}].")
        kind = f.str("type", required=True)
        if kind not in allowed:
            raise bad(f"'{path}[{j}].type' {kind!r} is not supported (text only)", f"{path}[{j}].type")
        out.append(f.str("text", "", required=True))
    return join_parts(out)


def join_parts(texts) -> str:
    """Text parts as llama-server joins them: a newline before each part once some text
    has accumulated ("What is" + "the best book" -> "What is\nthe best book")."""
    out = ""
    for t in texts:
        out += ("\n" if out else "") + t
    return out


def max_tokens_for(server, ids: list[int], requested: int | None) -> int:
    """The request's token budget: what it asked for, capped by the room the context leaves."""
    room = server.engine.n_ctx - len(ids)
    return min(requested, room) if requested is not None else room
