"""Pretokenizer equivalence: our translated regexes vs a line-by-line port of
llama.cpp's hand-written splitters (unicode.cpp: gpt2, llama3, qwen2, qwen35), on
random text drawn to hit the category boundaries. No model needed."""
from __future__ import annotations

import random

import pytest

from fucina.text.tokenizer import unicode as U
from fucina.text.tokenizer.bpe import bpe_merge
from fucina.text.tokenizer.merge import heap_merge
from fucina.text.tokenizer.pretokenize import FUSED, PATTERNS, PRE_SPECS, Splitter, translate

OUT = -1


def _port(text: str, kind: str) -> list[str]:
    """unicode_regex_split_custom_{gpt2,llama3,qwen2,qwen35}, transcribed."""
    cpts = [ord(c) for c in text]
    end = len(cpts)

    def cpt(p):
        return cpts[p] if 0 <= p < end else OUT

    def fl(p):
        return U.flags(cpts[p]) if 0 <= p < end else 0

    def is_(f, bit):
        return bool(f & bit)

    L, N, M, WS = U.LETTER, U.NUMBER, U.MARK, U.WS_FLAG
    out: list[int] = []
    prev = 0

    def add(e):
        nonlocal prev
        n = e - prev
        if n > 0:
            out.append(n)
        prev = e
        return n

    def lower(c):
        return ord(chr(c).lower()) if c != OUT and len(chr(c).lower()) == 1 else c

    pos = 0
    while pos < end:
        c, f = cpt(pos), fl(pos)
        if c == ord("'") and pos + 1 < end:
            n1 = cpt(pos + 1) if kind == "gpt2" else lower(cpt(pos + 1))
            if n1 in (ord("s"), ord("t"), ord("m"), ord("d")):
                pos += add(pos + 2)
                continue
            if pos + 2 < end:
                n2 = cpt(pos + 2) if kind == "gpt2" else lower(cpt(pos + 2))
                if (n1, n2) in ((ord("r"), ord("e")), (ord("v"), ord("e")), (ord("l"), ord("l"))):
                    pos += add(pos + 3)
                    continue
        if kind == "gpt2":
            f2 = fl(pos + 1) if c == 32 else f
            done = False
            for bit in (L, N):
                if is_(f2, bit):
                    pos += c == 32
                    while is_(f2, bit):
                        pos += 1
                        f2 = fl(pos)
                    add(pos)
                    done = True
                    break
            if done:
                continue
            if not (f2 & (WS | L | N)) and f2:
                pos += c == 32
                while not (f2 & (WS | L | N)) and f2:
                    pos += 1
                    f2 = fl(pos)
                add(pos)
                continue
        else:
            word = L | M if kind == "qwen35" else L
            if not (c in (10, 13) or is_(f, N)):
                if f & word or fl(pos + 1) & word:
                    pos += 1
                    while fl(pos) & word:
                        pos += 1
                    add(pos)
                    continue
            if is_(f, N):
                if kind == "llama3":
                    ini = pos
                    while is_(fl(pos), N):
                        pos += 1
                        if pos - ini >= 3:
                            add(pos)
                            ini = pos
                    add(pos)
                else:
                    pos += 1
                    add(pos)
                continue
            f2 = fl(pos + 1) if c == 32 else f
            if not (f2 & (WS | word | N)) and f:
                pos += c == 32
                while not (f2 & (WS | word | N)) and f2:
                    pos += 1
                    f2 = fl(pos)
                while cpt(pos) in (10, 13):
                    pos += 1
                add(pos)
                continue
        nws = 0
        last_rn = 0
        while is_(fl(pos + nws), WS):
            if kind != "gpt2" and cpt(pos + nws) in (10, 13):
                last_rn = pos + nws + 1
            nws += 1
        if last_rn > 0:
            pos = last_rn
            add(pos)
            continue
        if nws > 1 and cpt(pos + nws) != OUT:
            pos += nws - 1
            add(pos)
            continue
        if nws > 0:
            pos += nws
            add(pos)
            continue
        pos += 1
        add(pos)
    words, s = [], 0
    for n in out:
        words.append(text[s:s + n])
        s += n
    return words


_POOLS = [
    "aZ", "é", "ß", "İ", "ı", "中文", "カ", "ａ", "\u0301", "\u0915\u093f", "\u0e34",  # letters, marks
    "0", "7", "٣", "²", "½", "Ⅻ", "𝟘",                                           # numbers
    " ", "  ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\u2009", "\u0085", "\u2028",  # spaces
    "\u001c", "\u000b", "\u000c",
    "'", "'s", "'S", "'re", "'Ve", "'LL", "'d", "'x", "’",                          # contractions
    ".", ",", "!", "?", "-", "_", "/", "(", "<|", "|>", "$", "+", "€", "😀", "\u200d", "\ufe0f",
    "\U0010fffd", "\u0378", "\U00031350", "\x00", "\x7f",
]


def _random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOLS) for _ in range(rng.randint(0, 40))) for _ in range(n)]


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "qwen2", "qwen35"])
def test_regex_matches_llama_cpp_loop(kind):
    sp = Splitter(kind)
    for text in _random_texts(hash(kind) & 0xFFFF, 3000):
        assert sp.split(text) == _port(text, kind), repr(text)


def test_multi_regex_pipeline_refines_pieces():
    # smollm: digits are isolated first, the GPT-2 rules run inside the gaps
    sp = Splitter("starcoder")
    assert sp.split("ab 12 x") == ["ab", " ", "1", "2", " x"]
    for text in _random_texts(7, 1000):
        parts = sp.split(text)
        assert "".join(parts) == text and all(parts)
        # every number char stands alone
        assert all(len(p) == 1 for p in parts if U.flags(ord(p[0])) & U.NUMBER)


@pytest.mark.parametrize("kind", sorted(FUSED))
def test_fused_regex_equals_pipeline(kind):
    fast, slow = Splitter(kind), Splitter(kind, fused=False)
    assert len(fast.patterns) == 1
    for text in _random_texts(17, 3000):
        assert fast.split(text) == slow.split(text), repr(text)


@pytest.mark.parametrize("kind", sorted(PATTERNS))
def test_every_pattern_translates_and_covers_text(kind):
    for p in PATTERNS[kind]:
        translate(p)
    sp = Splitter(kind)
    for text in _random_texts(11, 300):
        assert "".join(sp.split(text)) == text


def test_gpt4o_case_split():
    sp = Splitter("gpt4o")
    assert sp.split("HelloWorld THE dog's CamelCase") == ["Hello", "World", " THE", " dog's", " Camel", "Case"]
    # llama.cpp's collapsed-category regex counts a non-ASCII letter as both cases, so
    # (unlike tiktoken) an accented capital ends an upper-case run: we follow llama.cpp
    assert sp.split("ÉCOLE école") == ["É", "COLE", " école"]


def test_pre_table_names():
    for name in ("default", "gpt-2", "smollm", "qwen2", "qwen35", "llama-bpe", "gpt-4o",
                 "deepseek-r1-qwen", "glm4", "joyai-llm", "tekken", "deepseek-v3"):
        assert name in PRE_SPECS


def test_flags_categories():
    assert U.flags(ord("a")) == U.LETTER
    assert U.flags(ord("5")) == U.NUMBER
    assert U.flags(0x20) == U.SEPARATOR | U.WS_FLAG
    assert U.flags(0x09) == U.CONTROL | U.WS_FLAG
    assert U.flags(0x1C) == U.CONTROL           # not whitespace for llama.cpp
    assert U.flags(0x0378) == U.UNDEFINED
    assert U.flags(0x31350) == U.LETTER          # CJK Ext H, Unicode 15.0
    assert U.flags(0x10D40) == U.UNDEFINED       # Garay, assigned only in Unicode 16
    assert U.flags(0xD800) == U.CONTROL


def test_gpt2_byte_map_round_trips():
    assert len(set(U.BYTE_CHARS)) == 256
    assert U.BYTE_CHARS[0x20] == "Ġ" and U.BYTE_CHARS[ord("a")] == "a"
    assert all(U.BYTE_OF_CHAR[U.BYTE_CHARS[b]] == b for b in range(256))


def test_short_and_heap_merges_agree():
    rng = random.Random(3)
    alphabet = "abcd"
    ranks = {}
    for _ in range(60):
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        ranks.setdefault(f"{a} {b}", len(ranks))
    for _ in range(2000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        heap = heap_merge(list(s), lambda a, b: ranks.get(a + " " + b))
        assert bpe_merge(s, ranks) == heap, s
