"""Which packaged model should `fucina chat` default to? Answers and speed, side by side.

    python benchmarks/chat_default.py MODEL_OR_NAME [...] [--threads 2] [--gen 48]

For each model: greedy answers to a small question set (a question passes when its
reply contains one of the expected strings, case-insensitive), the median time to load
(`fucina.load`), to the first token and the decode rate over the replies. Run on
`smollm2 qwen2.5-coder`, it made the decision README.md "Which chat model" records:
`fucina chat` defaults to Qwen2.5-Coder-0.5B-Instruct (11/12 against SmolLM2's 7/12).
"""
from __future__ import annotations

import argparse
import statistics
import time

QUESTIONS = [
    ("What is the capital of France?", ["paris"]),
    ("What is 12 + 7? Answer with the number.", ["19"]),
    ("Which planet is known as the Red Planet?", ["mars"]),
    ("What is the chemical symbol for gold?", ["au"]),
    ("Who wrote 'Romeo and Juliet'?", ["shakespeare"]),
    ("How many days are there in a week?", ["7", "seven"]),
    ("What is the largest ocean on Earth?", ["pacific"]),
    ("Translate 'thank you' into French.", ["merci"]),
    ("Write a Python expression that reverses a string s.", ["[::-1]", "reversed("]),
    ("What is the boiling point of water at sea level in Celsius?", ["100"]),
    ("What language is spoken in Brazil?", ["portuguese"]),
    ("What is the square root of 81?", ["9", "nine"]),
]


def measure(name: str, gen: int) -> dict:
    import fucina

    t = time.perf_counter()
    llm = fucina.load(name)
    load_s = time.perf_counter() - t
    passed, first, rates, answers = 0, [], [], []
    for question, expected in QUESTIONS:
        chat = llm.chat(max_tokens=gen, temperature=0)
        t0 = time.perf_counter()
        stamps = []
        text = "".join(p for p in chat.stream(question) if not stamps.append(time.perf_counter()))
        ok = any(e in text.lower() for e in expected)
        passed += ok
        answers.append((question, ok, " ".join(text.split())[:70]))
        if stamps:
            first.append(stamps[0] - t0)
        n = len(chat.last.tokens)
        if n > 1 and len(stamps) > 1:
            rates.append((n - 1) / (stamps[-1] - stamps[0]))
    return {"model": name, "passed": passed, "of": len(QUESTIONS), "load_s": load_s,
            "first_token_s": statistics.median(first) if first else float("nan"),
            "decode_tok_s": statistics.median(rates) if rates else float("nan"), "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="GGUF paths or packaged names")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=48, help="max tokens per answer")
    args = ap.parse_args()
    import fucina.kernels as kernels

    kernels.set_threads(args.threads)
    rows = [measure(m, args.gen) for m in args.models]
    for r in rows:
        print(f"\n## {r['model']}")
        for q, ok, a in r["answers"]:
            print(f"{'PASS' if ok else 'fail'}  {q[:48]:<48}  {a}")
    print("\n| model | correct | load s | first token s | decode tok/s |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['passed']}/{r['of']} | {r['load_s']:.2f} | {r['first_token_s']:.2f} | "
              f"{r['decode_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
