"""Splitting special tokens out of text before pretokenizing (tokenizer_st_partition).

llama.cpp takes the special tokens longest first and, for each, cuts every occurrence
out of the text fragments still unclaimed. When no two special tokens can overlap
(one inside another except as a prefix, or a suffix of one starting another) that
is the same as scanning left to right and taking the longest token at each place —
which a trie-shaped regex does in C. Runs of one repeated character (Gemma's "\\n\\n",
"   ", ...) overlap only with each other and give the same answer both ways too.
Any other overlap switches to the literal longest-first algorithm.
"""
from __future__ import annotations

import re
import weakref

from fucina.text.tokenizer.vocab import (ATTR_CONTROL, ATTR_LSTRIP, ATTR_RSTRIP, ATTR_UNKNOWN, ATTR_UNUSED,
                                         ATTR_USER_DEFINED)

_CSPACE = " \t\n\v\f\r"   # C isspace, what lstrip/rstrip trim


def _trie_regex(words: list[str]) -> str:
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = True

    def rx(node: dict) -> str:
        alts = [re.escape(ch) + rx(child) for ch, child in node.items() if ch != ""]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        if "" in node:        # a token ends here: try the longer ones first
            return f"(?:{body})?" if len(alts) == 1 else body + "?"
        return body

    return rx(trie)


def _is_run(s: str) -> bool:
    return len(set(s)) == 1


def _overlapping(texts: list[str], pattern: re.Pattern[str]) -> bool:
    """Could two different tokens' occurrences overlap other than as same-start prefixes?"""
    runs = [t for t in texts if _is_run(t)]
    others = [t for t in texts if not _is_run(t)]
    prefixes_all = {t[:i] for t in texts for i in range(1, len(t))}
    prefixes_others = {t[:i] for t in others for i in range(1, len(t))}
    for a in others:
        if pattern.search(a, 1):                                  # a token inside `a`
            return True
        if any(a[i:] in prefixes_all for i in range(1, len(a))):  # `a` ends where one starts
            return True
    # a run's tail starting a token that is not a run of the same character
    return any(a[i:] in prefixes_others for a in runs for i in range(1, len(a)))


class SpecialSplitter:
    """text -> [fragment, id, fragment, id, ..., fragment]: text fragments (str, maybe
    empty) at even positions, special token ids at odd ones."""

    def __init__(self, specials: list[tuple[str, int, int]]):
        self.specials = specials                      # (text, id, attr), longest first
        self.by_text = {t: i for t, i, _ in reversed(specials)}
        self.strip = {i: a & (ATTR_LSTRIP | ATTR_RSTRIP) for _, i, a in specials
                      if a & (ATTR_LSTRIP | ATTR_RSTRIP)}
        texts = [t for t, _, _ in specials]
        self.pattern = re.compile("(" + _trie_regex(texts) + ")") if texts else None
        self.exact = bool(texts) and _overlapping(texts, self.pattern)

    def split(self, text: str) -> list:
        if self.pattern is None:
            return [text]
        if self.exact:
            parts = _alternating(self._split_exact(text))
        else:
            parts = self.pattern.split(text)
            if len(parts) > 1:
                parts[1::2] = map(self.by_text.__getitem__, parts[1::2])
        if self.strip and len(parts) > 1:
            self._apply_strip(parts)
        return parts

    def _split_exact(self, text: str) -> list[str | int]:
        frags: list[str | int] = [text]
        for tok, tid, _ in self.specials:
            if tok not in text:
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                pieces = f.split(tok)
                for k, p in enumerate(pieces):
                    if k:
                        out.append(tid)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def _apply_strip(self, parts: list) -> None:
        for k in range(1, len(parts), 2):
            flags = self.strip.get(parts[k], 0)
            if flags & ATTR_LSTRIP:
                parts[k - 1] = parts[k - 1].rstrip(_CSPACE)
            if flags & ATTR_RSTRIP:
                parts[k + 1] = parts[k + 1].lstrip(_CSPACE)


def _alternating(parts: list[str | int]) -> list:
    out: list = []
    for p in parts:
        if isinstance(p, int):
            if not out or isinstance(out[-1], int):
                out.append("")
        out.append(p)
    if not out or isinstance(out[-1], int):
        out.append("")
    return out


_SPECIALS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def special_ids(tokenizer) -> frozenset[int]:
    """Ids a grammar engine must treat as special: control, unknown and unused tokens, and
    user-defined ones shaped like a marker (`<think>`, `<tool_call>`), as llama.cpp's
    llguidance integration decides. Cached per tokenizer."""
    out = _SPECIALS.get(tokenizer)
    if out is None:
        v = tokenizer.vocab
        ids = []
        for i, a in enumerate(v.attrs):
            if a & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_UNUSED):
                ids.append(i)
            elif a & ATTR_USER_DEFINED:
                t = v.tokens[i]
                if (t.startswith("<") and t.endswith(">")) or (t.startswith("[") and t.endswith("]")):
                    ids.append(i)
        out = _SPECIALS[tokenizer] = frozenset(ids)
    return out
