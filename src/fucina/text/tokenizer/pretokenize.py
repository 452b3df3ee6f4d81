"""Pretokenizers: how a byte-level BPE vocabulary cuts text into words before merging.

`tokenizer.ggml.pre` names a pretokenizer; llama.cpp (b11434, llama-vocab.cpp) maps it
to a list of regexes applied in turn, each refining the pieces the previous one left
(matches and the gaps between them both become pieces). Some regexes run through
hand-written loops there (gpt2, llama3, qwen2, qwen35) and the rest through std::regex
on a "collapsed" text where every non-ASCII code point stands for its category.
Both reduce to the same thing: a regex whose \\p{L}, \\p{N}, ... and \\s mean llama.cpp's
category and whitespace tables. We translate each regex once into Python `re` syntax
with those classes spelled out (Unicode 15.1.0, `unicode.py`) and run it in C.

The loops' equivalence with their regexes is checked in the tests against a line-by-
line port of the loops, and the whole against llama-tokenize on the corpus.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from fucina.text.tokenizer.unicode import CATEGORY_RANGES, bmp_ranges, class_body, classes, collapse_astral

# Contractions, spelled case-insensitively the way llama.cpp adapts them for std::regex.
_CONTR = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTR + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# (?=[\p{L}])([^a-z]) is "a letter other than a-z": written as the classes \p{Lx}/\p{Ly}.
_GPT4O = (r"[^\r\n\p{L}\p{N}]?\p{Lx}*\p{Ly}+" + _CONTR + r"?|[^\r\n\p{L}\p{N}]?\p{Lx}+\p{Ly}*"
          + _CONTR + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?\p{Lx}*\p{Ly}+|[^\r\n\p{L}\p{N}]?\p{Lx}+\p{Ly}*|\p{N}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"

# pretokenizer kind -> its regexes, in llama.cpp's order
PATTERNS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "gpt4o": (_GPT4O,),
    "tekken": (_TEKKEN,),
    "deepseek3": (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
               "[0-9][0-9][0-9]"),
    "seed-coder": (_CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "bailingmoe": (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
    "minicpm5": (r"\p{N}{1,3}", _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "poro": (r" ?[^(\s|.,!?…。，、।۔،)]+",),
    "viking": (r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"),
}


# Faster single regexes with the same output as a kind's pipeline (tested against it).
# starcoder/smollm: digits isolated first, GPT-2 rules in the gaps. A gap ends at a
# digit as at the end of text, so "\s+(?!\S)" may stop before a digit, and the
# GPT-2 number rule never fires. GPT-2 itself: a lone whitespace before a non-space is
# matched by no alternative and becomes its own piece; a final "|\s+" says so.
FUSED: dict[str, str] = {
    "gpt2": _GPT2 + r"|\s+",
    "starcoder": r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+",
}


@dataclass(frozen=True)
class PreSpec:
    kind: str                    # key of PATTERNS
    ignore_merges: bool = False  # a word already in the vocabulary skips BPE (llama3, tekken, ...)
    clean_spaces: bool = False   # decode removes " ," " ." ... (clean_up_tokenization_spaces)
    add_bos: bool | None = None  # default BOS policy the pre implies (metadata still wins)
    bos_null: bool = False       # chatglm: no BOS token by default


def _spec_table() -> dict[str, PreSpec]:
    t: dict[str, PreSpec] = {}

    def add(names: str, spec: PreSpec) -> None:
        for n in names.split():
            t[n] = spec

    add("default", PreSpec("default", clean_spaces=True))
    add("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        PreSpec("llama3", ignore_merges=True, add_bos=True, clean_spaces=True))
    add("dbrx smaug-bpe", PreSpec("llama3", clean_spaces=True))
    add("deepseek-v3 hunyuan-dense joyai-llm hy_v4", PreSpec("deepseek3"))
    add("falcon", PreSpec("falcon", clean_spaces=True))
    add("mpt gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "jina-v1-en jina-v2-code roberta-bpe olmo jais exaone4",
        PreSpec("gpt2", clean_spaces=True))
    add("trillion granite-docling", PreSpec("gpt2"))
    add("starcoder refact codeshell exaone minerva-7b mellum2", PreSpec("starcoder", clean_spaces=True))
    add("smollm command-r", PreSpec("starcoder"))
    add("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2",
        PreSpec("qwen2"))
    add("stablelm2 megrez", PreSpec("qwen2", clean_spaces=True))
    add("qwen35", PreSpec("qwen35"))
    add("chatglm-bpe", PreSpec("llama3", clean_spaces=True, bos_null=True))
    add("glm4 glm5", PreSpec("llama3", clean_spaces=True, bos_null=True, ignore_merges=True))
    add("gpt-4o llama4 kanana2 talkie minimax-m2", PreSpec("gpt4o"))
    add("tekken", PreSpec("tekken", ignore_merges=True, add_bos=True))
    add("seed-coder", PreSpec("seed-coder"))
    add("ufakzeka", PreSpec("ufakzeka"))
    add("bailingmoe bailingmoe2 llada-moe", PreSpec("bailingmoe"))
    add("minicpm5", PreSpec("minicpm5", ignore_merges=True, clean_spaces=True))
    add("poro-chat", PreSpec("poro"))
    add("bloom gpt3-finnish", PreSpec("poro", clean_spaces=True))
    add("viking", PreSpec("viking"))
    return t


PRE_SPECS: dict[str, PreSpec] = _spec_table()
FALLBACK_PRE = "qwen2"


def translate(pattern: str) -> str:
    """llama.cpp regex syntax -> Python `re` with the category classes spelled out."""
    cls = classes()
    named = dict(cls)
    # letters other than ASCII a-z / other than ASCII A-Z (for o200k-style case splits)
    letters = bmp_ranges(CATEGORY_RANGES["L"])
    named["Lx"] = class_body([r for r in letters if r != (0x61, 0x7A)])
    named["Ly"] = class_body([r for r in letters if r != (0x41, 0x5A)])
    for k in ("Lu", "Ll", "Lt", "Lm", "Lo"):   # llama.cpp folds every letter class into \p{L}
        named[k] = cls["L"]
    out: list[str] = []
    inside = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1]
            if nxt == "p" and pattern[i + 2] == "{":
                close = pattern.index("}", i)
                body = named[pattern[i + 3:close]]
                out.append(body if inside else f"[{body}]")
                i = close + 1
                continue
            if nxt in "sS":
                body = cls["WS"]
                if inside:
                    assert nxt == "s", "\\S inside a class is not supported"
                    out.append(body)
                else:
                    out.append(f"[{body}]" if nxt == "s" else f"[^{body}]")
                i += 2
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        out.append(c)
        i += 1
    return "".join(out)


@lru_cache(maxsize=None)
def compiled(kind: str, fused: bool = True) -> tuple[re.Pattern[str], ...]:
    if fused and kind in FUSED:
        return (re.compile(translate(FUSED[kind])),)
    return tuple(re.compile(translate(p)) for p in PATTERNS[kind])


class Splitter:
    """Cuts text into pretokens: every regex refines the pieces left by the one before."""

    def __init__(self, kind: str, fused: bool = True):
        self.kind = kind
        self.patterns = compiled(kind, fused)

    def split(self, text: str) -> list[str]:
        if text.isascii() or max(text) <= "\uffff":
            return self._split(text)
        # astral characters: split a same-length stand-in text, cut the original alike
        out, pos = [], 0
        for part in self._split(collapse_astral(text)):
            out.append(text[pos:pos + len(part)])
            pos += len(part)
        return out

    def _split(self, text: str) -> list[str]:
        *firsts, last = self.patterns
        if not firsts:
            parts = last.findall(text)
            if sum(map(len, parts)) == len(text):      # every char matched: no gaps to add
                return parts
            return _refine(last, text, [(0, len(text))], as_text=True)
        spans = [(0, len(text))]
        for pat in firsts:
            spans = _refine(pat, text, spans)
        out: list[str] = []
        findall = last.findall
        for a, b in spans:
            parts = findall(text, a, b)
            if sum(map(len, parts)) == b - a:
                out.extend(parts)
            else:
                out.extend(_refine(last, text, [(a, b)], as_text=True))
        return out


def _refine(pat: re.Pattern[str], text: str, spans, as_text: bool = False):
    out = []
    for a, b in spans:
        pos = a
        for m in pat.finditer(text, a, b):
            s, e = m.span()
            if s > pos:
                out.append((pos, s))
            out.append((s, e))
            pos = e
        if pos < b:
            out.append((pos, b))
    if as_text:
        return [text[s:e] for s, e in out]
    return out
