#!/usr/bin/env python3
"""Regenerate the committed parity goldens from the llama.cpp oracle.

usage: FUCINA_LLAMA_CPP=/path/to/llama.cpp/bin python tests/goldens/make_goldens.py

For each case: the prompt's token ids (llama-tokenize), the top-k logits of the scored
positions (llama-logits), and llama.cpp's 32-token greedy continuation (argmax, one
llama-logits call per step so it is the same computation the logits come from).
"""
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import oracle  # noqa: E402
from conftest import VOCAB_DIR, cached_model  # noqa: E402
from parity_cases import CASES, GREEDY, SYNTH, TOPK  # noqa: E402


def model_path(src, tmp):
    if src in SYNTH:
        return SYNTH[src](Path(tmp) / f"{src}.gguf", VOCAB_DIR / "vocab-qwen3.gguf")
    return str(cached_model(src))


def logits(model, ids, tmp, last=0):
    out = Path(tmp) / "l.f32"
    args = [model, ",".join(map(str, ids)), str(out)]
    if last:
        args += ["--last", str(last)]
    oracle.run("llama-logits", *args)
    return np.fromfile(out, dtype="<f4")


def main():
    assert oracle.oracle_dir(), "set FUCINA_LLAMA_CPP"
    with tempfile.TemporaryDirectory() as tmp:
        only = sys.argv[1:]
        for name, (src, text, scored) in CASES.items():
            if only and name not in only:
                continue
            model = model_path(src, tmp)
            tf = Path(tmp) / "p.txt"
            tf.write_text(text)
            ids = [int(x) for x in oracle.run("llama-tokenize", "-m", model, "-f", str(tf), "--ids",
                                              "--log-disable").strip().strip("[]").split(",")]
            n_last = len(ids) if scored == "all" else scored
            lg = logits(model, ids, tmp, n_last).reshape(n_last, -1)
            top = np.argsort(-lg, axis=1)[:, :TOPK]
            seq, greedy = list(ids), []
            for _ in range(GREEDY):
                t = int(np.argmax(logits(model, seq, tmp, 1)))
                greedy.append(t)
                seq.append(t)
            rec = {"case": name, "model": src, "n_vocab": lg.shape[1], "ids": ids,
                   "first_scored": len(ids) - n_last,
                   "topk_ids": top.tolist(),
                   "topk_logits": np.take_along_axis(lg, top, 1).round(4).tolist(),
                   "logsumexp": [float(np.log(np.exp(r - r.max()).sum()) + r.max()) for r in lg],
                   "greedy": greedy}
            (HERE / f"{name}.json").write_text(json.dumps(rec))
            print(f"{name}: {len(ids)} prompt tokens, {n_last} scored, greedy {greedy[:8]}...")


if __name__ == "__main__":
    main()
