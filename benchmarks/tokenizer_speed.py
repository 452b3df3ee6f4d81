"""Tokenizer speed: load time and encode throughput on a 1 MB text, per vocabulary.

    python benchmarks/tokenizer_speed.py [--text FILE] [--write-text FILE] [GGUF ...]

The default text is 1,000,000 bytes of this Python's own documentation (the pydoc
topics: English prose with code samples) topped up with standard-library source;
`--write-text` saves it so llama-tokenize can be timed on the very same bytes:

    llama-tokenize -m M.gguf -f FILE --ids --log-disable --no-escape

Encode figures exclude load. "cold" is a fresh tokenizer's first pass (its piece cache
empty), "warm" the best of three further passes; MB/s from wall time, and in brackets
from process CPU time (steadier on a shared machine). The unseen pieces of a cold pass
merge in C++ when fucina.text.tokenizer._merge is built; FUCINA_TOKENIZER_NATIVE=0
times the pure-Python merge loop instead.
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
    for name in ("textwrap.py", "argparse.py", "difflib.py", "inspect.py", "typing.py",
                 "turtle.py", "tarfile.py", "pathlib.py"):
        parts.append((stdlib / name).read_text("utf-8"))
    data = "\n\n".join(parts).encode("utf-8")[:SIZE]
    return data.decode("utf-8", "ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--text", type=Path)
    ap.add_argument("--write-text", type=Path)
    ap.add_argument("--once", action="store_true",
                    help="load the first model, encode --text once, print the ids (for "
                         "whole-process timing beside llama-tokenize --ids)")
    args = ap.parse_args()
    if args.once:
        from fucina.text.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(args.models[0])
        print(tok.encode(args.text.read_bytes()))
        return
    text = args.text.read_text("utf-8") if args.text else bench_text()
    nbytes = len(text.encode("utf-8"))
    if args.write_text:
        args.write_text.write_text(text, "utf-8")
    print(f"text: {nbytes} bytes, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")

    from fucina.gguf import GGUFFile
    from fucina.text.tokenizer import Tokenizer

    print(f"{'vocabulary':34} {'read s':>6} {'build s':>7} {'cold MB/s (cpu)':>16} "
          f"{'warm MB/s (cpu)':>16} {'tokens':>8}")
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
        cold = _timed(tok, text)
        warm = [_timed(tok, text) for _ in range(3)]
        w, c = min(x[0] for x in warm), min(x[1] for x in warm)
        mb = nbytes / 1e6
        print(f"{path.name:34} {t1 - t0:6.2f} {t2 - t1:7.2f} {mb / cold[0]:8.2f} ({mb / cold[1]:5.2f}) "
              f"{mb / w:8.2f} ({mb / c:5.2f}) {cold[2]:8d}")


def _timed(tok, text: str) -> tuple[float, float, int]:
    t, c = time.perf_counter(), time.process_time()
    n = len(tok.encode(text))
    return time.perf_counter() - t, time.process_time() - c, n


if __name__ == "__main__":
    main()
