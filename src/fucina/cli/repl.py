"""The interactive side of `fucina chat --repl`.

A banner names the model, its sampling and the commands; input has line editing and
a history kept across sessions (the stdlib's readline, when stdin is a terminal; the
file lives in the model cache). Ctrl-C during a reply stops that reply and keeps the
conversation (the partial reply included); Ctrl-C at the prompt clears the line;
Ctrl-D (end of input) quits. Commands:

    /reset          forget the conversation (the system prompt stays)
    /system [TEXT]  show, set, or (with "-") clear the system prompt; the turns stay
    /save FILE      write the conversation as JSON ({"messages": [...]}, the format
                    `fucina template --messages` reads)
    /load FILE      replace the conversation with one saved by /save
    /help           this list;  /exit (or Ctrl-D) quits
"""
from __future__ import annotations

import json
import sys

from fucina.errors import FucinaError

HELP = ("/reset  forget the conversation   /system [TEXT|-]  show/set/clear the system prompt\n"
        "/save FILE  /load FILE  conversation as JSON   /help   /exit (or Ctrl-D)\n"
        "Ctrl-C stops a reply and keeps the conversation.")


def _readline(interactive: bool):
    """Enable line editing and a persistent history; returns a function saving it."""
    if not interactive:
        return lambda: None
    try:
        import readline
    except ImportError:            # e.g. a Python built without it: plain input()
        return lambda: None
    from fucina.models.hub import cache_dir

    path = cache_dir() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save():
        try:
            readline.write_history_file(path)
        except OSError:
            pass
    return save


def _banner(session) -> str:
    from fucina.text.defaults import describe

    llm = session.llm
    mode = "raw completion (no chat template)" if session.raw else f"{llm.template.name} template"
    return (f"fucina chat: {session.name} ({llm.config.arch}, {mode}, ctx {llm.n_ctx}; "
            f"sampling: {describe(session.sampling)})\n{HELP}")


def _messages_from(path: str) -> list[dict]:
    from fucina.cli.template import read_messages

    msgs, _ = read_messages(path)
    for m in msgs:
        if not isinstance(m.get("content", ""), str):
            raise FucinaError(f"{path}: message contents must be strings")
    return [{"role": m["role"], "content": m.get("content", "")} for m in msgs]


def command(session, line: str, out=sys.stdout, err=sys.stderr) -> bool:
    """Run one /command; False means quit."""
    conv = session.conv
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/help":
        print(HELP, file=err)
    elif name == "/reset":
        conv.reset()
        print("(conversation reset)", file=err)
    elif name == "/system":
        if not arg:
            print(f"system prompt: {conv.system!r}" if conv.system else "(no system prompt)", file=err)
            return True
        conv.system = None if arg == "-" else arg
        rest = [m for m in conv.messages if m["role"] != "system"]
        conv.messages = ([{"role": "system", "content": conv.system}] if conv.system else []) + rest
        conv._committed_text = None        # the history renders anew; the cache keeps the common prefix
        print("(system prompt cleared)" if conv.system is None else "(system prompt set)", file=err)
    elif name == "/save":
        if not arg:
            raise FucinaError("/save needs a FILE")
        try:
            with open(arg, "w", encoding="utf-8") as fh:
                json.dump({"messages": conv.messages}, fh, ensure_ascii=False, indent=1)
        except OSError as e:
            raise FucinaError(f"cannot write {arg}: {e.strerror}") from e
        print(f"(saved {len(conv.messages)} messages to {arg})", file=err)
    elif name == "/load":
        if not arg:
            raise FucinaError("/load needs a FILE")
        msgs = _messages_from(arg)
        conv.messages = msgs
        conv.system = next((m["content"] for m in msgs[:1] if m["role"] == "system"), None)
        conv._committed_text = None
        print(f"(loaded {len(msgs)} messages from {arg})", file=err)
    else:
        print(f"unknown command {name!r}", file=err)
        print(HELP, file=err)
    return True


def repl(session, stdin=None, out=None, err=None) -> int:
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    interactive = stdin.isatty()
    save_history = _readline(interactive)
    if interactive:
        print(_banner(session), file=err)
    try:
        while True:
            try:
                line = input("> ") if interactive else stdin.readline()
            except KeyboardInterrupt:       # at the prompt: a fresh line
                out.write("\n")
                continue
            except EOFError:
                if interactive:
                    out.write("\n")
                return 0
            if not interactive:
                if not line:
                    return 0
                line = line.rstrip("\n")
            if not line.strip():
                continue
            try:
                if line.startswith("/") and not session.raw or line.strip() in ("/exit", "/quit", "/help"):
                    if not command(session, line, out, err):
                        return 0
                    continue
                session.reply(line, out)
            except KeyboardInterrupt:
                print("(stopped)", file=err)
            except FucinaError as e:          # e.g. ContextFull: say so, keep the session
                print(f"fucina: error: {e}", file=err)
    finally:
        save_history()
