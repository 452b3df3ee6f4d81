"""Tokenizer speed: load time and encode throughput on a 1 MB text, per vocabulary.

    python benchmarks/tokenizer_speed.py [--text FILE] [--write-text FILE] [GGUF ...]

The default text is 1,000,000 bytes of this Python's own documentation (the pydoc
topics: English prose with code samples) topped up with standard-library source;
`--write-text` saves it so llama-tokenize can be timed on the very same bytes:

    llama-tokenize -m M.gguf -f FILE --ids --log-disable --no-escape

Encode figures exclude load. "cold" is a fresh tokenizer's first pass (its piece cache
empty), "warm" the best of three further passes.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import sysconfig
import time
from pathlib import Path

SIZE = 1_000_000
DEFAULT_MODELS = [
    Path.home() / ".cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf",
    Path.home() / ".cache/fucina/gemma-3-270m-q4_k_m.gguf",
    *(Path(__file__).resolve().parents[2] / "shared/data/vocab" / f"vocab-{n}.gguf"
      for n in ("qwen3", "llama3", "o200k")),
]


def bench_text() -> str:
    import pydoc_data.topics as topics

    parts = ["\n\n".join(topics.topics[k] for k in sorted(topics.topics))]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "argparse.py", "difflib.py", "inspect.py", "typing.py"):
        parts.append((stdlib / name).read_text("utf-8"))
    data = "\n\n".join(parts).encode("utf-8")[:SIZE]
    return data.decode("utf-8", "ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--text", type=Path)
    ap.add_argument("--write-text", type=Path)
    args = ap.parse_args()
    text = args.text.read_text("utf-8") if args.text else bench_text()
    nbytes = len(text.encode("utf-8"))
    if args.write_text:
        args.write_text.write_text(text, "utf-8")
    print(f"text: {nbytes} bytes, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")

    from fucina.gguf import GGUFFile
    from fucina.text.tokenizer import Tokenizer

    print(f"{'vocabulary':38} {'read':>6} {'build':>6} {'cold MB/s':>9} {'warm MB/s':>9} {'tokens':>8}")
    for path in args.models or DEFAULT_MODELS:
        if not path.exists():
            print(f"{path.name}: missing", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        meta = GGUFFile(path).metadata
        t1 = time.perf_counter()
        tok = Tokenizer.from_metadata(meta)
        tok.encode("warm up the special-token splitter")
        t2 = time.perf_counter()
        ids = tok.encode(text)
        t3 = time.perf_counter()
        warm = min(_timed(tok, text) for _ in range(3))
        print(f"{path.name:38} {t1 - t0:6.2f} {t2 - t1:6.2f} {nbytes / (t3 - t2) / 1e6:9.2f} "
              f"{nbytes / warm / 1e6:9.2f} {len(ids):8d}")


def _timed(tok, text: str) -> float:
    t = time.perf_counter()
    tok.encode(text)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
