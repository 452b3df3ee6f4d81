"""The harmony reply parser's streaming cost against the `<think>` parser's, per piece.

    python benchmarks/harmony_parser.py

Both parse a reply of reasoning then answer (about 4,100 characters) fed in 4-character
pieces (about a token each); the best of 20 runs, in microseconds a piece."""
from __future__ import annotations

import time

from fucina.serve.parsing import OutputParser
from fucina.text.harmony import HarmonyStream

BODY = "The user asks about the weather in Paris; let me think about units and the tool. " * 25
HARMONY = ("<|channel|>analysis<|message|>" + BODY + "<|end|><|start|>assistant<|channel|>final<|message|>"
           + BODY)
THINK = "<think>\n" + BODY + "\n</think>\n\n" + BODY


def per_piece(make, text: str, n: int = 4, reps: int = 20) -> float:
    best = float("inf")
    for _ in range(reps):
        p = make()
        t = time.perf_counter()
        for i in range(0, len(text), n):
            p.feed(text[i:i + n])
        p.finish()
        best = min(best, time.perf_counter() - t)
    return best / (len(text) / n) * 1e6


def main() -> None:
    h = per_piece(HarmonyStream, HARMONY)
    t = per_piece(lambda: OutputParser(reasoning=True), THINK)
    print(f"harmony {h:.2f} us/piece, <think> {t:.2f} us/piece, ratio {h / t:.2f}")


if __name__ == "__main__":
    main()
