"""The harmony format (gpt-oss): a reply is a run of messages on channels, split here
into reasoning, answer text and tool calls.

After the generation prompt `<|start|>assistant` the model writes messages like

    <|channel|>analysis<|message|>THOUGHTS<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

or, to call a tool, `<|start|>assistant<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>{ARGS}<|call|>` (the recipient may also sit in the role
header: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`,
as the template writes calls back). `<|return|>` and `<|call|>` end the turn (the
vocabulary makes them end-of-generation, `<|end|>` not), so they rarely reach the
text; when they do they close the message all the same.

Mapping: the `analysis` channel is reasoning; `final` and a `commentary` message
without a recipient (a preamble to the user) are the answer; a message addressed
`to=functions.NAME` is a call of NAME whose body is its arguments (another recipient,
a built-in tool such as `browser.search`, keeps its whole name). A reply that starts
without any header is taken as answer text.

`HarmonyStream.feed(text)` takes the decoded reply piece by piece and returns events
`("reasoning", s)`, `("content", s)`, `("call", name)`, `("args", s)`, `("end_call",
args)`; a piece that may be the start of a marker waits for the next. `split()` parses
a whole reply. `history()` turns canonical messages into the shape the gpt-oss template
reads (an assistant's reasoning in `thinking`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
STOP_MARKERS = (RETURN, CALL)            # end the assistant's turn
_CLOSERS = (END, RETURN, CALL, START)    # end a message body (START: one left unclosed)
_HEADER_OPENERS = (CHANNEL, START, " to=", "to=", CONSTRAIN)

_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
_ROLE = re.compile(r"\s*([^\s<]*)")


EFFORTS = ("low", "medium", "high")


def effort_level(think: bool | None, effort: Any = None) -> str | None:
    """gpt-oss's `Reasoning:` level (the template's `reasoning_effort`): an effort it
    knows as given; thinking off (or effort none/minimal) as low, since its analysis
    channel cannot be turned off; else None (the template's default, medium)."""
    if isinstance(effort, str) and effort in EFFORTS:
        return effort
    if think is False or effort in ("none", "minimal"):
        return "low"
    return None


def is_harmony(template) -> bool:
    """Whether a chat template (object or source text) speaks harmony."""
    src = template if isinstance(template, str) else (getattr(template, "source", "") or "")
    return CHANNEL in src and MESSAGE in src


def _held(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of markers."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


@dataclass
class Header:
    role: str = "assistant"
    channel: str | None = None
    recipient: str | None = None

    @property
    def kind(self) -> str:
        """reasoning | content | call | drop (a message from another role)"""
        if self.role not in ("", "assistant"):
            return "drop"
        if self.recipient and self.recipient != "assistant":
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"

    @property
    def tool(self) -> str:
        r = self.recipient or ""
        return r[len("functions."):] if r.startswith("functions.") else r


def parse_header(text: str) -> Header:
    """`<|start|>assistant to=functions.f<|channel|>commentary <|constrain|>json` and the
    other orders harmony allows."""
    h = text.strip()
    role = "assistant"
    if h.startswith(START):
        role = _ROLE.match(h[len(START):]).group(1) or "assistant"
    ch = _CHANNEL.findall(h)            # the last: gpt-oss sometimes writes a stray
    to = _RECIPIENT.search(h)           # `<|channel|>commentary` before the real channel
    return Header(role, ch[-1] if ch else None, to.group(1) if to else None)


class HarmonyStream:
    def __init__(self):
        self.state = "header"
        self.buf = ""
        self.head: Header | None = None
        self.args: list[str] = []          # the open call's argument text sent so far
        self.events: list[tuple] = []

    def feed(self, piece: str) -> list[tuple]:
        self.buf += piece
        out: list[tuple] = []
        while self._step(out):
            pass
        self.events += out
        return out

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        while self._step(out):
            pass
        if self.state == "body":
            self._body_text(out, self.buf, final=True)
            self._close(out)
        # an unfinished header is control syntax cut short: nothing to show
        self.buf = ""
        self.events += out
        return out

    # -- states --------------------------------------------------------------------
    def _step(self, out: list[tuple]) -> bool:
        if self.state == "header":
            lead = self.buf.lstrip()
            at = lead.find(MESSAGE)
            if at >= 0:
                self.head = parse_header(lead[:at])
                self.buf = lead[at + len(MESSAGE):]
                self.state = "body"
                if self.head.kind == "call":
                    out.append(("call", self.head.tool))
                    self.args = []
                return True
            if not lead or any(lead.startswith(o) or o.startswith(lead) for o in _HEADER_OPENERS):
                return False                   # a header still being written
            self.head, self.state = Header(channel="final"), "body"   # no header: plain answer
            self.buf = lead
            return True
        if self.state == "body":
            lt = self.buf.find("<")
            if lt < 0:                         # the common case: no marker can be here
                self.buf = self.buf[self._body_text(out, self.buf, final=False):]
                return False
            cut = [(self.buf.find(m, lt), m) for m in _CLOSERS]
            cut = [(i, m) for i, m in cut if i >= 0]
            if cut:
                at, m = min(cut)
                self._body_text(out, self.buf[:at], final=True)
                self._close(out)
                self.buf = self.buf[at:] if m == START else self.buf[at + len(m):]
                self.state = "header"
                return True
            keep = _held(self.buf, _CLOSERS)
            sent = self._body_text(out, self.buf[:len(self.buf) - keep], final=False)
            self.buf = self.buf[sent:]
            return False
        return False

    def _body_text(self, out: list[tuple], text: str, final: bool) -> int:
        """Emit a body's text; returns how much of it was consumed. A call's arguments
        lose their edge whitespace (trailing whitespace waits until more text follows)."""
        kind = self.head.kind
        if kind == "drop":
            return len(text)
        if kind == "call":
            send = text if self.args else text.lstrip()
            skipped = len(text) - len(send)
            body = send.rstrip()
            if body:
                out.append(("args", body))
                self.args.append(body)
            return skipped + len(body) if not final else len(text)
        if text:
            out.append((kind, text))
        return len(text)

    def _close(self, out: list[tuple]) -> None:
        if self.head is not None and self.head.kind == "call":
            args = "".join(self.args)
            if not args:
                args = "{}"
                out.append(("args", args))
            out.append(("end_call", args))
        self.head, self.args = None, []


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)   # (name, arguments JSON text)


def split(text: str) -> Parsed:
    """A whole harmony reply, parsed."""
    s = HarmonyStream()
    s.feed(text)
    s.finish()
    p, name = Parsed(), ""
    for kind, value in s.events:
        if kind == "reasoning":
            p.reasoning += value
        elif kind == "content":
            p.content += value
        elif kind == "call":
            name = value
        elif kind == "end_call":
            p.calls.append((name, value))
    return p


def history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages in the shape the gpt-oss template reads: an assistant's
    `reasoning_content` as `thinking` (the template keeps it only before a tool call
    that no final answer follows, as harmony asks: analysis of finished turns is
    dropped); with both reasoning and calls the content goes (the template refuses
    both), as llama.cpp does. Assistant content that is a raw harmony reply (channel
    markers and all) is split first: the official template refuses such content."""
    out = []
    for m in messages:
        m = dict(m)
        r = m.pop("reasoning_content", None)
        c = m.get("content")
        if m.get("role") == "assistant" and isinstance(c, str) and CHANNEL in c:
            p = split(c)                   # a raw reply sent back: the template refuses markup
            m["content"] = p.content
            r = r or p.reasoning
        if m.get("role") == "assistant" and isinstance(r, str) and r:
            m["thinking"] = r
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out
