"""Multi-token-prediction drafting against plain and draft-free speculative decoding, paired
in one run (A B C A B C), greedy chat replies.

    python benchmarks/mtp.py MODEL.gguf HEAD.gguf [--reps 2] [--max-tokens 128] [--threads 1]
                             [--workloads story,explain,summary,copy] [--json OUT]

For each workload: decode tokens/s plain, speculative without the head (the draft-free
cascade) and speculative with the head (`fucina.load(..., mtp=HEAD)`), the ratios to plain
(median over reps), the head's own acceptance, tokens per forward pass, whether every
stream equals the plain one, and the acceptance per draft position (all sources, the head
runs). On one thread the clock is process CPU time (a shared box's waits are left out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fucina  # noqa: E402
from fucina import kernels  # noqa: E402
from speculative import WORKLOADS, one_run  # noqa: E402

WORKLOADS = dict(WORKLOADS, explain=["Explain how a refrigerator keeps food cold, in a few paragraphs."])


def mtp_run(llm, head, turns, arm: str, max_tokens: int) -> dict:
    llm.model.mtp = head if arm == "mtp" else None
    return one_run(llm, turns, arm != "plain", max_tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("head")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workloads", default="story,explain,summary,copy")
    p.add_argument("--json")
    a = p.parse_args(argv)
    kernels.set_threads(a.threads)
    import torch
    torch.set_num_threads(a.threads)
    llm = fucina.load(a.model, mtp=a.head)
    head = llm.model.mtp
    from fucina.text.speculative import Speculation
    made = []
    orig = Speculation.__init__

    def keep(self, *args, **kw):      # the last speculative stream's stats, per position
        orig(self, *args, **kw)
        made.append(self)
    Speculation.__init__ = keep
    mtp_run(llm, head, ["Hello!"], "mtp", 8)
    out = []
    for name in a.workloads.split(","):
        runs = {"plain": [], "free": [], "mtp": []}
        pos_d, pos_a, head_d, head_a = [], [], 0, 0
        for _ in range(a.reps):
            for arm in runs:
                made.clear()
                runs[arm].append(mtp_run(llm, head, WORKLOADS[name], arm, a.max_tokens))
                if arm == "mtp" and made:
                    st, g = made[-1].stats, made[-1].index.mtp_gate
                    head_d += g.total_drafted
                    head_a += g.total_accepted
                    for j, (d, acc) in enumerate(zip(st.pos_drafted, st.pos_accepted)):
                        if j >= len(pos_d):
                            pos_d.append(0)
                            pos_a.append(0)
                        pos_d[j] += d
                        pos_a[j] += acc
        plain = runs["plain"]

        def ratio(arm):
            return statistics.median(b["decode_tok_s"] / q["decode_tok_s"] for q, b in zip(plain, runs[arm])
                                     if q["decode_tok_s"])
        r = {"model": os.path.basename(a.model), "workload": name, "tokens": plain[-1]["tokens"],
             "plain_tok_s": statistics.median(x["decode_tok_s"] for x in plain),
             "free_tok_s": statistics.median(x["decode_tok_s"] for x in runs["free"]),
             "mtp_tok_s": statistics.median(x["decode_tok_s"] for x in runs["mtp"]),
             "free_speedup": ratio("free"), "mtp_speedup": ratio("mtp"),
             "head_acceptance": head_a / head_d if head_d else 0.0, "head_drafted": head_d,
             "tokens_per_step": runs["mtp"][-1]["tokens_per_step"],
             "position_acceptance": [round(x / d, 3) for x, d in zip(pos_a, pos_d) if d][:8],
             "identical": all(x["ids"] == y["ids"] for arm in ("free", "mtp") for x, y in zip(plain, runs[arm]))}
        out.append(r)
        print(f"{r['model']:<34} {name:<8} {r['tokens']:>4} tok  plain {r['plain_tok_s']:6.1f}  "
              f"draft-free x{r['free_speedup']:.2f}  mtp x{r['mtp_speedup']:.2f}  head accept "
              f"{r['head_acceptance']:.0%} of {head_d}  {r['tokens_per_step']:.2f} tok/step  "
              f"by position {r['position_acceptance']}  identical {r['identical']}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
