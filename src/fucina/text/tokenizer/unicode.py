"""Unicode facts the tokenizers share: category classes, whitespace, the GPT-2 byte map.

Categories are Unicode 15.1.0 (see `_gen_unicode.py`), the version llama.cpp's table
was generated from. Whitespace is llama.cpp's set (PropList's White_Space), which
differs from Python's `str.isspace` (that one also counts U+001C..U+001F).
"""
from __future__ import annotations

import bisect
import re
from functools import lru_cache

from fucina.text.tokenizer._unicode_data import RANGES

# llama.cpp's whitespace set (unicode-data: White_Space from PropList.txt).
WHITESPACE: tuple[int, ...] = (
    *range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
    0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
)


def _parse(text: str) -> list[tuple[int, int]]:
    out = []
    for part in "".join(text).split(","):
        a, _, b = part.partition("-")
        out.append((int(a, 16), int(b or a, 16)))
    return out


CATEGORY_RANGES: dict[str, list[tuple[int, int]]] = {k: _parse("".join(v)) for k, v in RANGES.items()}


def _class_char(cp: int) -> str:
    ch = chr(cp)
    return "\\" + ch if ch in "\\]^-[" else ch


def class_body(ranges: list[tuple[int, int]]) -> str:
    """The inside of a regex character class matching exactly these code point ranges."""
    return "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}"
                   for a, b in ranges)


def bmp_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(a, min(b, 0xFFFF)) for a, b in ranges if a <= 0xFFFF]


@lru_cache(maxsize=None)
def classes() -> dict[str, str]:
    """Character-class bodies by name: L N M P S Z C (categories), WS (whitespace).

    Only the Basic Multilingual Plane: Python's `re` tests a class's astral ranges one
    by one (its fast bitmap covers the BMP only), which made every regex 10x slower.
    Astral characters are first replaced by a BMP stand-in of the same category
    (`collapse_astral`), the trick llama.cpp itself plays with std::regex.
    """
    out = {k: class_body(bmp_ranges(v)) for k, v in CATEGORY_RANGES.items()}
    out["WS"] = class_body([(c, c) for c in WHITESPACE])
    return out


# Flag bits, as llama.cpp's unicode_cpt_flags (only the ones the splitters read).
UNDEFINED, NUMBER, LETTER, SEPARATOR, MARK, PUNCTUATION, SYMBOL, CONTROL = (
    0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80)
WS_FLAG = 0x100
_BITS = {"N": NUMBER, "L": LETTER, "Z": SEPARATOR, "M": MARK, "P": PUNCTUATION,
         "S": SYMBOL, "C": CONTROL}


@lru_cache(maxsize=1)
def _flag_table() -> tuple[list[int], list[int], list[int]]:
    spans = sorted((a, b, _BITS[name]) for name, rs in CATEGORY_RANGES.items() for a, b in rs)
    return [a for a, _, _ in spans], [b for _, b, _ in spans], [f for _, _, f in spans]


_WS_SET = frozenset(WHITESPACE)


def flags(cp: int) -> int:
    """llama.cpp's category flags for one code point (plus WS_FLAG for whitespace)."""
    if cp >= 0x110000:
        return UNDEFINED
    starts, ends, fl = _flag_table()
    i = bisect.bisect_right(starts, cp) - 1
    f = fl[i] if i >= 0 and cp <= ends[i] else UNDEFINED
    return f | WS_FLAG if cp in _WS_SET else f


# A BMP stand-in per category for astral code points: non-ASCII and outside every
# literal range a pretokenizer names (CJK, kana, the poro punctuation list).
_STAND_IN = {LETTER: "\u00aa", NUMBER: "\u00b2", MARK: "\u0300", PUNCTUATION: "\u00a1",
             SYMBOL: "\u00a2", CONTROL: "\u00ad", UNDEFINED: "\u0378"}   # (no astral Z exists)
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _stand_in(m: re.Match[str]) -> str:
    return _STAND_IN[flags(ord(m.group())) & 0xFF]


def collapse_astral(text: str) -> str:
    """`text` with every astral character replaced by its category's BMP stand-in
    (same length, same positions). Only call it when `max(text) > "\uffff"`."""
    return _ASTRAL.sub(_stand_in, text)


def _gpt2_byte_chars() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {}
    n = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


BYTE_CHARS: list[str] = _gpt2_byte_chars()           # byte -> printable stand-in
BYTE_OF_CHAR: dict[str, int] = {c: b for b, c in enumerate(BYTE_CHARS)}
# str.translate table: a latin-1 decoded byte string -> its GPT-2 stand-in string.
BYTES_TO_UNICODE = {b: c for b, c in enumerate(BYTE_CHARS)}
