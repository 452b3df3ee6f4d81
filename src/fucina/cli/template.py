"""`fucina template MODEL --messages FILE.json [--no-generation-prompt]`: print the
prompt the model's chat template renders, exactly (no trailing newline added).

FILE.json is a list of messages, or an object with `messages` and optionally `tools`,
`enable_thinking` and any other template variable.
"""
from __future__ import annotations

import json
import sys

from fucina.errors import FucinaError


def add_parser(sub) -> None:
    s = sub.add_parser("template", help="render a chat template over messages from a JSON file")
    s.add_argument("model", nargs="?", help="GGUF file or packaged name (default: SmolLM2)")
    s.add_argument("--messages", "-m", required=True, help="JSON file: [messages] or {messages, tools, ...}")
    s.add_argument("--no-generation-prompt", action="store_true", help="omit the assistant opener")
    s.add_argument("--no-think", action="store_true", help="set enable_thinking=false")
    s.add_argument("--builtin", choices=("chatml", "llama3", "gemma", "gemma4", "harmony"),
                   help="use a built-in format instead of the file's template")
    s.set_defaults(func=cmd_template)


def read_messages(path: str) -> tuple[list, dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise FucinaError(f"cannot read {path}: {e.strerror}") from e
    except ValueError as e:
        raise FucinaError(f"{path} is not JSON: {e}") from e
    extra = {}
    if isinstance(data, dict):
        extra = {k: v for k, v in data.items() if k != "messages"}
        data = data.get("messages")
    if not isinstance(data, list) or not all(isinstance(m, dict) and "role" in m for m in data):
        raise FucinaError(f"{path}: expected a list of messages with a 'role' each")
    return data, extra


def cmd_template(args) -> int:
    from fucina.gguf import GGUFFile
    from fucina.models import resolve_model
    from fucina.text.chat_template import ChatTemplate

    messages, extra = read_messages(args.messages)
    meta = GGUFFile(resolve_model(args.model)).metadata
    t = ChatTemplate.from_metadata(meta, fallback=args.builtin)
    if args.no_think:
        extra["enable_thinking"] = False
    sys.stdout.write(t.render(messages, add_generation_prompt=not args.no_generation_prompt, **extra))
    sys.stdout.flush()
    return 0
