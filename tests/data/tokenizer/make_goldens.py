"""Regenerate the tokenizer goldens: llama-tokenize's ids for every corpus file.

    FUCINA_LLAMA_CPP=/path/to/llama.cpp/bin python tests/data/tokenizer/make_goldens.py

Writes expected/<vocab>.json.gz: {"case": [ids]}. A case is a corpus file name, with
":raw" for `--no-bos --no-parse-special` (the special-marker file only). Files are
read verbatim (`--no-escape`: llama-tokenize otherwise expands backslash escapes).
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))          # tests/, for oracle.py and conftest.py

from conftest import VOCAB_DIR, cached_model  # noqa: E402
from oracle import oracle_dir, run  # noqa: E402

CORPUS = HERE / "corpus"
EXPECTED = HERE / "expected"
RAW_CASES = ("special_markers.txt",)


def vocab_paths() -> dict[str, Path | None]:
    return {
        "smollm2": cached_model("smollm2"),
        "gemma3": cached_model("gemma3"),
        "qwen3": VOCAB_DIR / "vocab-qwen3.gguf",
        "llama3": VOCAB_DIR / "vocab-llama3.gguf",
        "o200k": VOCAB_DIR / "vocab-o200k.gguf",
    }


def corpus_files() -> list[Path]:
    return sorted(p for p in CORPUS.iterdir() if p.is_file())


def tokenize(model: Path, path: Path, *flags: str) -> list[int]:
    out = run("llama-tokenize", "-m", str(model), "-f", str(path), "--ids", "--log-disable",
              "--no-escape", *flags)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    if oracle_dir() is None:
        sys.exit("set FUCINA_LLAMA_CPP to llama.cpp's bin/ directory")
    EXPECTED.mkdir(exist_ok=True)
    for name, model in vocab_paths().items():
        if model is None or not Path(model).exists():
            print(f"skip {name}: model unavailable")
            continue
        cases: dict[str, list[int]] = {}
        for f in corpus_files():
            cases[f.name] = tokenize(model, f)
            if f.name in RAW_CASES:
                cases[f.name + ":raw"] = tokenize(model, f, "--no-bos", "--no-parse-special")
        data = json.dumps(cases, separators=(",", ":")).encode()
        (EXPECTED / f"{name}.json.gz").write_bytes(gzip.compress(data, 9, mtime=0))
        print(f"{name}: {len(cases)} cases, {sum(map(len, cases.values()))} ids")


if __name__ == "__main__":
    main()
