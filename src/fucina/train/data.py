"""SFT data: JSONL examples -> (ids, labels) and the deterministic sample order.

One JSON object per line, in one of three shapes:

- `{"messages": [{"role": ..., "content": ...}, ...]}` rendered by the model's own chat
  template; the loss is on the assistant turns (their text and end-of-turn marker) only;
- `{"prompt": ..., "completion": ...}`: loss on the completion and the EOS after it;
- `{"text": ...}`: loss on every token.

Rendered text is tokenized a segment at a time (prompt parts, then each assistant reply),
so the reply's tokens are the ones generation would produce after that prompt. An
example longer than the context is an error (with its line), never silently cut.

The order (`Loader`) is the seed's checkpoint contract: each epoch is a pure function of
(seed, epoch) — identity, then a Fisher-Yates pass driven by a splitmix64 stream that
starts at at(seed, epoch) (j = next % (i + 1), i from n-1 down to 1); n = 8, seed 42
gives [3, 6, 0, 7, 1, 2, 5, 4], as the seed pins.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from fucina.errors import FucinaError

IGNORE = -100
_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


class DataError(FucinaError):
    """A training file is malformed, empty, or holds an example that does not fit."""


@dataclass
class Example:
    ids: list[int]      # input positions
    labels: list[int]   # target of each position (IGNORE = not supervised)

    @property
    def n_supervised(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE)


# -- the permutation ---------------------------------------------------------------------------

def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def splitmix_at(seed: int, i: int) -> int:
    """The i-th output of the splitmix64 stream started at `seed`."""
    return _mix((seed + (i + 1) * _GAMMA) & _M64)


def permutation(n: int, seed: int, epoch: int) -> list[int]:
    state = splitmix_at(seed & _M64, epoch)
    p = list(range(n))
    for i in range(n - 1, 0, -1):
        state = (state + _GAMMA) & _M64
        j = _mix(state) % (i + 1)
        p[i], p[j] = p[j], p[i]
    return p


class Loader:
    """Example indices in a seeded shuffled order, epoch after epoch. The whole state is one
    counter (examples handed out so far): position p is epoch p // n, index p % n."""

    def __init__(self, n: int, seed: int, shuffle: bool = True, position: int = 0):
        if n <= 0:
            raise DataError("the dataset is empty")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.position = position
        self._epoch, self._perm = -1, []

    def order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = permutation(self.n, self.seed, epoch) if self.shuffle else list(range(self.n))
        return self._perm

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            out.append(self.order(self.position // self.n)[self.position % self.n])
            self.position += 1
        return out


# -- reading and encoding ----------------------------------------------------------------------

def _render_messages(template, msgs, where: str) -> list[tuple[str, bool]]:
    """[(text, supervised)] segments of one conversation, in order."""
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: each message needs string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no assistant turn to learn from")
    full = template.render(msgs, add_generation_prompt=False)
    segments, pos = [], 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = len(template.render(msgs[:i], add_generation_prompt=True))
        end = len(template.render(msgs[:i + 1], add_generation_prompt=False))
        if not (pos <= start <= end <= len(full)):
            raise DataError(f"{where}: the chat template does not render turns as prefixes of "
                            "the conversation; cannot find the assistant spans")
        segments += [(full[pos:start], False), (full[start:end], True)]
        pos = end
    if pos < len(full):
        segments.append((full[pos:], False))
    return segments


def _tokens(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    toks: list[int] = []
    sup: list[bool] = []
    bos = tokenizer.bos_id if getattr(tokenizer, "add_bos", False) else None
    if bos is not None:
        toks.append(bos)
        sup.append(False)
    for text, supervised in segments:
        ids = tokenizer.encode(text, add_special=False, parse_special=True) if text else []
        if bos is not None and len(toks) == 1 and ids[:1] == [bos]:
            ids = ids[1:]   # the template wrote BOS itself: not twice
        toks += ids
        sup += [supervised] * len(ids)
    return toks, sup


def encode_record(rec, tokenizer, template, where: str = "example") -> Example:
    """One parsed JSONL object -> Example (labels shifted: labels[t] is token t + 1)."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    eos = tokenizer.eos_id
    if "messages" in rec:
        if template is None:
            raise DataError(f"{where}: 'messages' needs a chat template")
        toks, sup = _tokens(tokenizer, _render_messages(template, rec["messages"], where))
    elif "prompt" in rec or "completion" in rec:
        p, c = rec.get("prompt"), rec.get("completion")
        if not isinstance(p, str) or not isinstance(c, str) or not c:
            raise DataError(f"{where}: 'prompt' and a non-empty 'completion' must be strings")
        toks, sup = _tokens(tokenizer, [(p, False), (c, True)])
        if eos is not None:
            toks.append(eos)
            sup.append(True)
    elif "text" in rec:
        if not isinstance(rec["text"], str) or not rec["text"]:
            raise DataError(f"{where}: 'text' must be a non-empty string")
        toks, sup = _tokens(tokenizer, [(rec["text"], True)])
        if eos is not None:
            toks.append(eos)
            sup.append(True)
    else:
        raise DataError(f"{where}: needs 'messages', 'prompt'/'completion' or 'text' "
                        f"(has {', '.join(sorted(rec)) or 'no keys'})")
    labels = [toks[t + 1] if sup[t + 1] else IGNORE for t in range(len(toks) - 1)]
    ex = Example(toks[:-1], labels)
    if ex.n_supervised == 0:
        raise DataError(f"{where}: no supervised tokens")
    return ex


def records(path: str | os.PathLike):
    """(where, object) for every non-blank line of a JSONL file; errors name the line."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from e
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield where, rec


def read_jsonl(path: str | os.PathLike, tokenizer, template, ctx: int) -> list[Example]:
    """Every example of a JSONL file; errors name the line and the reason."""
    out = []
    for where, rec in records(path):
        ex = encode_record(rec, tokenizer, template, where)
        if len(ex.ids) > ctx:
            raise DataError(f"{where}: example is {len(ex.ids) + 1} tokens, longer than the "
                            f"context of {ctx} (raise --ctx or shorten it)")
        out.append(ex)
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def split_validation(examples: list[Example], fraction: float, seed: int
                     ) -> tuple[list[Example], list[Example]]:
    """Hold out a seeded `fraction` of the examples (at least one) for validation."""
    if not 0 < fraction < 1:
        raise DataError(f"validation fraction must be in (0, 1), got {fraction}")
    if len(examples) < 2:
        raise DataError("need at least 2 examples to split off a validation set")
    perm = permutation(len(examples), seed ^ 0x7A11D, 0)
    k = max(1, int(round(len(examples) * fraction)))
    held = set(perm[:k])
    return ([e for i, e in enumerate(examples) if i not in held],
            [e for i, e in enumerate(examples) if i in held])


def pack(examples: list[Example], ctx: int) -> list[Example]:
    """Concatenate consecutive examples into rows of at most `ctx` positions (first fit, in
    order). Attention stays causal across the joins: a later example in a row sees the
    earlier ones (the plain packing most SFT trainers default to), labels never cross."""
    rows: list[Example] = []
    for e in examples:
        if rows and len(rows[-1].ids) + len(e.ids) <= ctx:
            rows[-1] = Example(rows[-1].ids + e.ids, rows[-1].labels + e.labels)
        else:
            rows.append(Example(list(e.ids), list(e.labels)))
    return rows
