"""Evolution strategies on SmolLM2-135M-Instruct (Q4_1): the fixed-format task of
benchmarks/finetune.py (reply exactly {"name": "<person>", "city": "<city>"}), trained with
`fucina finetune --method es` and scored on the 40 held-out examples before and after:
format (the reply parses as that template) and exact match. Also the seconds per iteration
against population x tokens.

    python benchmarks/es_finetune.py data --out DIR
    python benchmarks/es_finetune.py eval --out DIR [--adapter DIR/run/adapter.gguf]
    python benchmarks/es_finetune.py train --out DIR [--reward nll] [--iterations 200] [more finetune flags]

`data` also writes DIR/valid.jsonl: 20 examples drawn like the training ones (training names,
cities and templates; none of the test's), the held-out set `train --valid` keeps the best
theta by (keep-best selects on it, never on test.jsonl).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune import TEMPLATES, cmd_data, invented_words, make_split  # noqa: E402  (the gradient path's task)

MODEL = os.path.expanduser("~/.cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf")
FORMAT = r'^\{"name": "[^"]+", "city": "[^"]+"\}$'


def cmd_eval(model: str, out: str, adapter: str | None, threads: int) -> dict:
    import fucina.kernels as K
    from fucina.models import load_model
    from fucina.text.chat_template import ChatTemplate
    from fucina.text.tokenizer import Tokenizer
    from fucina.train.es import _stop_ids, generate_replies, read_es_jsonl
    from fucina.weights.lora import load_adapters

    K.set_threads(threads)
    m = load_model(model)
    if adapter:
        load_adapters(m, [adapter])
    tok = Tokenizer.from_metadata(m.gguf.metadata)
    tpl = ChatTemplate.from_metadata(m.gguf.metadata, tok)
    exs = read_es_jsonl(os.path.join(out, "test.jsonl"), tok, tpl)
    t = time.perf_counter()
    texts = [s.strip() for s in generate_replies(m, tok, exs, 32, _stop_ids(tok, tpl))]
    fmt = sum(re.match(FORMAT, s) is not None for s in texts)
    exact = sum(s == ex.answer for s, ex in zip(texts, exs))
    return dict(n=len(exs), format=fmt / len(exs), exact=exact / len(exs), samples=texts[:3],
                seconds=time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("data", "eval", "train"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--adapter")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reward", default="nll")
    ap.add_argument("--iterations", type=int, default=200)
    a, extra = ap.parse_known_args()   # the rest: more `fucina finetune` flags
    if a.cmd == "data":
        cmd_data(a.out)
        names, cities = invented_words(1, 300, 2), invented_words(2, 300, 3)
        with open(os.path.join(a.out, "valid.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in make_split(3, names[::2], cities[::2], TEMPLATES[:9], 20))
    elif a.cmd == "eval":
        print(json.dumps(cmd_eval(a.model, a.out, a.adapter, a.threads)))
    else:
        run = os.path.join(a.out, "run-" + re.sub(r"\W", "", a.reward))
        cmd = [sys.executable, "-m", "fucina", "finetune", a.model, "--method", "es", "--reward", a.reward,
               "--data", os.path.join(a.out, "train.jsonl"), "--out", run, "--iterations", str(a.iterations),
               "--threads", str(a.threads), "--save-every", "10", *extra]
        print(" ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
