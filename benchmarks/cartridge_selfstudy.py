"""Self-study generation speed: conversations per minute, one at a time vs batched.

    python benchmarks/cartridge_selfstudy.py MODEL --doc benchmarks/data/cartridge_doc.txt \
        [--n 8] [--batches 1,8] [--threads 1] [--json]

Generates conversations 0..n-1 (bot A's question, bot B's answer with the teacher's top-k
log-probabilities, the settings of `fucina cartridge train`) once per batch size, in
one process, and reports conversations per minute for each plus whether every batch size
produced the same conversations bit for bit. On a tree without batched generation it
times the one-at-a-time path (the "before" figure).
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--doc", required=True)
    ap.add_argument("--n", type=int, default=8, help="conversations per batch size")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-question", type=int, default=48)
    ap.add_argument("--max-answer", type=int, default=96)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    import fucina
    from fucina import kernels
    from fucina.train.cartridge import SelfStudy, SelfStudyConfig

    kernels.set_threads(args.threads)
    llm = fucina.load(args.model)
    doc = open(args.doc, encoding="utf-8").read()
    batched = hasattr(SelfStudy, "samples")
    rows, ref = [], None
    for b in [int(x) for x in args.batches.split(",")] if batched else [1]:
        kw = {"batch": b} if batched else {}
        cfg = SelfStudyConfig(max_question=args.max_question, max_answer=args.max_answer, **kw)
        study = SelfStudy(llm.model, llm.tokenizer, doc, cfg)
        t = time.perf_counter()
        got = study.samples(range(args.n)) if batched else [study.sample(i) for i in range(args.n)]
        dt = time.perf_counter() - t
        same = None
        if ref is None:
            ref = got
        else:
            same = all(a.ids == c.ids and all(torch.equal(x, y) for x, y in zip(a.logprobs, c.logprobs))
                       for a, c in zip(ref, got))
        tokens = sum(len(s.rows) for s in got)
        rows.append({"batch": b, "batched_code": batched, "conversations": args.n, "seconds": round(dt, 1),
                     "per_minute": round(60 * args.n / dt, 2), "answer_tokens": tokens, "same_as_first": same})
        if not args.json:
            note = "" if same is None else f", same as batch {rows[0]['batch']}: {same}"
            print(f"batch {b}: {args.n} conversations in {dt:.1f} s = {60 * args.n / dt:.2f}/min "
                  f"({tokens} answer tokens){note}", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
