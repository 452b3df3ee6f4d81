"""The model's reply text, split as it streams: reasoning, answer text, tool calls.

`OutputParser.feed(piece)` takes the decoded reply text piece by piece and returns
events; `finish()` flushes. Streaming and non-streaming responses both come from the
same events, so a stream concatenates to exactly the plain response.

- reasoning: a leading `<think>...</think>` block (or a prompt primed with `<think>`)
  becomes `Reasoning` events; whitespace after the block is dropped.
- tool calls (hermes, the Qwen-family convention): `<tool_call>{"name": N,
  "arguments": {...}}</tool_call>`. Once the name is known a `ToolStart` is emitted
  and the arguments' JSON text streams out as `ToolArgs` deltas while the model
  writes it; `ToolEnd` closes the call. A block in another key order, or with string
  arguments, is parsed whole at its `</tool_call>`; a block that is not JSON is
  given back as text.
- bare JSON calls (templates whose models answer with just the object, Llama 3
  style, and weak models that drop the tags): with `tool_names`, a reply that opens
  with `{` (or `<|python_tag|>`) is held to its end and becomes a call if it is one
  object naming a declared tool, else it is given back as text (in one piece).

Text that may be the beginning of a marker is held back until it is known not to be.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Iterable

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class Text:
    text: str


@dataclass
class Reasoning:
    text: str


@dataclass
class ToolStart:
    index: int
    id: str
    name: str


@dataclass
class ToolArgs:
    index: int
    text: str


@dataclass
class ToolEnd:
    index: int
    arguments: str      # the complete arguments JSON text (== the ToolArgs deltas joined)


Event = Text | Reasoning | ToolStart | ToolArgs | ToolEnd


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


def _held(buf: str, marker: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


class _JsonValueEnd:
    """Finds where one JSON value ends in a growing text (string/escape aware)."""

    def __init__(self):
        self.depth, self.in_str, self.esc, self.started, self.scalar = 0, False, False, False, False

    def feed(self, s: str) -> int | None:
        """Consume s; return the index in s just past the value's end, or None."""
        for i, ch in enumerate(s):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
                if ch in "{[":
                    self.depth = 1
                elif ch == '"':
                    self.in_str = True
                    self.scalar = True
                else:
                    self.scalar = True          # number / literal: ends at , } or space
                continue
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.scalar:
                        return i + 1
                continue
            if self.scalar:
                if ch in ",}] \n\t\r":
                    return i
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class _Call:
    index: int
    id: str
    raw: str = ""               # text after <tool_call>
    name: str | None = None
    args_at: int | None = None  # where the arguments value starts in raw
    args_end: int | None = None
    sent: int = 0               # argument chars already streamed
    scanned: int = 0            # argument chars already given to the scanner
    scan: _JsonValueEnd = field(default_factory=_JsonValueEnd)
    streaming: bool = False


class OutputParser:
    def __init__(self, *, tools: bool = False, reasoning: bool = False, primed: str = "",
                 id_prefix: str = "call_", tool_names: Iterable[str] = ()):
        self.tools, self.id_prefix = tools, id_prefix
        self.bare = set(tool_names) if tools else set()   # names a bare-JSON reply may call
        self.state = "start" if reasoning else "text"
        self.buf = ""
        self.n_calls = 0
        self.call: _Call | None = None
        self.strip_lead = False
        self.thought = False        # some reasoning already emitted
        self.events: list[Event] = []
        if primed.rstrip().endswith(THINK_OPEN) and reasoning:
            self.state = "think"
        elif tools and CALL_OPEN in primed:
            self.state = "text"
            self.feed(primed[primed.index(CALL_OPEN):])

    # -- public ------------------------------------------------------------------
    def feed(self, piece: str) -> list[Event]:
        self.buf += piece
        out: list[Event] = []
        while self._step(out):
            pass
        self.events += out
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out):
            pass
        if self.state == "think":
            if self.buf.strip():
                out.append(Reasoning(self.buf.rstrip() if self.thought else self.buf.strip()))
        elif self.state == "json":
            self._bare_json(out)
        elif self.state == "tool":
            self._close_call(out, complete=False)
        elif self.state in ("text", "start"):
            text = self.buf.lstrip() if self.strip_lead else self.buf
            if self.tools:
                text = text.rstrip()
            if text:
                out.append(Text(text))
        self.buf = ""
        self.events += out
        return out

    @property
    def n_tool_calls(self) -> int:
        return self.n_calls

    # -- states ------------------------------------------------------------------
    def _step(self, out: list[Event]) -> bool:
        """Advance once; True if something changed and another step may apply."""
        if self.state == "start":
            lead = self.buf.lstrip()
            if lead.startswith(THINK_OPEN):
                self.buf = lead[len(THINK_OPEN):]
                self.state = "think"
                return True
            if THINK_OPEN.startswith(lead):      # undecided (empty or a prefix)
                return False
            self.state = "text"
            return True
        if self.state == "think":       # reasoning is trimmed: edge whitespace waits
            if not self.thought:
                self.buf = self.buf.lstrip()
            at = self.buf.find(THINK_CLOSE)
            if at >= 0:
                if self.buf[:at].rstrip():
                    out.append(Reasoning(self.buf[:at].rstrip()))
                self.buf = self.buf[at + len(THINK_CLOSE):]
                self.state, self.strip_lead = "text", True
                return True
            end = len(self.buf[:len(self.buf) - _held(self.buf, THINK_CLOSE)].rstrip())
            if end > 0:
                out.append(Reasoning(self.buf[:end]))
                self.buf = self.buf[end:]
                self.thought = True
            return False
        if self.state == "text":
            if self.strip_lead:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return False
                self.strip_lead = False
            if self.bare:                # a reply that opens with JSON may be a bare call
                lead = self.buf.lstrip()
                if lead.startswith("{") or lead.startswith(PYTHON_TAG):
                    self.state, self.buf = "json", lead
                    return False
                if not lead or PYTHON_TAG.startswith(lead):
                    return False         # undecided yet
                self.bare = set()
            at = self.buf.find(CALL_OPEN) if self.tools else -1
            if at >= 0:
                before = self.buf[:at].rstrip()
                if before:
                    out.append(Text(before))
                self.buf = self.buf[at + len(CALL_OPEN):]
                self.call = _Call(self.n_calls, new_call_id(self.id_prefix))
                self.state = "tool"
                return True
            keep = _held(self.buf, CALL_OPEN) if self.tools else 0
            end = len(self.buf) - keep
            if self.tools:      # trailing whitespace waits: it is dropped before a call
                end = len(self.buf[:end].rstrip())
            if end > 0:
                out.append(Text(self.buf[:end]))
                self.buf = self.buf[end:]
            return False
        if self.state == "tool":
            return self._tool(out)
        return False

    def _tool(self, out: list[Event]) -> bool:
        c = self.call
        c.raw += self.buf
        self.buf = ""
        if c.name is None:
            head = c.raw.split(CALL_CLOSE, 1)[0]
            m = _HEAD.match(head)
            if m and m.end() < len(head) and head[m.end()] != '"':
                try:
                    c.name = json.loads('"' + m.group(1) + '"')
                except ValueError:
                    c.name = m.group(1)
                c.args_at, c.streaming = m.end(), True
                out.append(ToolStart(c.index, c.id, c.name))
        if c.streaming and c.args_end is None:
            fresh = c.raw[c.args_at + c.scanned:]
            end = c.scan.feed(fresh)
            if end is not None:
                c.args_end = c.args_at + c.scanned + end
            c.scanned += len(fresh)
        # once the arguments have begun, a close tag counts only after their end: inside a
        # JSON string it is text ({"city": "Rome</tool_call>..." is still one argument)
        at = (-1 if c.streaming and c.args_end is None
              else c.raw.find(CALL_CLOSE, c.args_end if c.streaming else 0))
        rest = None
        if at >= 0:
            c.raw, rest = c.raw[:at], c.raw[at + len(CALL_CLOSE):]
        if c.streaming:
            stop = c.args_end if c.args_end is not None else len(c.raw) - (
                0 if rest is not None else _held(c.raw, CALL_CLOSE))
            chunk = c.raw[c.args_at + c.sent:stop]
            if chunk:
                out.append(ToolArgs(c.index, chunk))
                c.sent += len(chunk)
        if rest is None:
            return False
        self._close_call(out, complete=True)
        self.buf = rest
        self.strip_lead = True
        return True

    def _bare_json(self, out: list[Event]) -> None:
        """The whole reply was held: one JSON object naming a declared tool (Llama 3
        style `{"name": ..., "parameters": ...}`, maybe after <|python_tag|>) is a
        call; anything else is the reply's text after all."""
        raw = self.buf.removeprefix(PYTHON_TAG).strip()
        parsed = _parse_call(raw)
        self.state = "text"
        if parsed is None or parsed[0] not in self.bare:
            out.append(Text(self.buf.rstrip()))
            return
        call_id = new_call_id(self.id_prefix)
        out += [ToolStart(self.n_calls, call_id, parsed[0]), ToolArgs(self.n_calls, parsed[1]),
                ToolEnd(self.n_calls, parsed[1])]
        self.n_calls += 1

    def _close_call(self, out: list[Event], complete: bool) -> None:
        c, self.call = self.call, None
        self.state = "text"
        if c.streaming:
            args = c.raw[c.args_at:c.args_end] if c.args_end is not None else c.raw[c.args_at:]
            tail = args[c.sent:]
            if tail:
                out.append(ToolArgs(c.index, tail))
            out.append(ToolEnd(c.index, args))
            self.n_calls += 1
            return
        parsed = _parse_call(c.raw) if complete or c.raw.strip() else None
        if parsed is None:          # not a tool call after all: give the text back
            text = CALL_OPEN + c.raw + (CALL_CLOSE if complete else "")
            out.append(Text(text))
            return
        name, args = parsed
        out += [ToolStart(c.index, c.id, name), ToolArgs(c.index, args), ToolEnd(c.index, args)]
        self.n_calls += 1


def _parse_call(raw: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
            return obj["name"], args
        except ValueError:
            return obj["name"], json.dumps(args)
    return obj["name"], json.dumps(args, ensure_ascii=False)


def tool_arguments(text: str) -> dict:
    """A call's arguments as an object (Anthropic's `input`); {} when not valid JSON."""
    try:
        obj = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {"value": obj}


class HarmonyOutputParser:
    """The OutputParser interface over a harmony reply (gpt-oss; fucina.text.harmony):
    the analysis channel as `Reasoning`, final (and a recipient-less commentary
    preamble) as `Text`, a `to=functions.NAME` message as one streamed tool call. A call
    when no tools were declared (a built-in tool the client never offered) is dropped,
    as llama.cpp drops it."""

    def __init__(self, *, tools: bool = False, primed: str = "", id_prefix: str = "call_"):
        from fucina.text.harmony import HarmonyStream

        self.tools, self.id_prefix = tools, id_prefix
        self.stream = HarmonyStream()
        self.n_calls = 0
        self.skip = False           # inside a dropped call
        self.events: list[Event] = []
        if primed:
            self.feed(primed)

    def feed(self, piece: str) -> list[Event]:
        return self._map(self.stream.feed(piece))

    def finish(self) -> list[Event]:
        return self._map(self.stream.finish())

    @property
    def n_tool_calls(self) -> int:
        return self.n_calls

    def _map(self, raw: list[tuple]) -> list[Event]:
        out: list[Event] = []
        for kind, value in raw:
            if kind == "reasoning":
                out.append(Reasoning(value))
            elif kind == "content":
                out.append(Text(value))
            elif kind == "call":
                self.skip = not self.tools
                if not self.skip:
                    out.append(ToolStart(self.n_calls, new_call_id(self.id_prefix), value))
            elif self.skip:
                continue
            elif kind == "args":
                out.append(ToolArgs(self.n_calls, value))
            elif kind == "end_call":
                out.append(ToolEnd(self.n_calls, value))
                self.n_calls += 1
        self.events += out
        return out


def parser_for(prompt, id_prefix: str = "call_") -> OutputParser | HarmonyOutputParser:
    """The reply parser a rendered prompt calls for."""
    if getattr(prompt, "harmony", False):
        return HarmonyOutputParser(tools=prompt.tools, primed=prompt.primed, id_prefix=id_prefix)
    return OutputParser(tools=prompt.tools, reasoning=prompt.reasoning, primed=prompt.opening,
                        id_prefix=id_prefix, tool_names=prompt.tool_names)
