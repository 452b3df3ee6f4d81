"""Drafting policies replayed offline on a greedy reply, priced by a verify cost table.

    python benchmarks/spec_replay.py [MODEL.gguf] [--workloads edit,summary,copy,story]
                                     [--table "1:1.03,2:1.22,..."]

Speculation is lossless, so a greedy reply's tokens do not depend on how it was drafted;
and under greedy a verify row's top-1 is the next committed token, so the conversation's
suffix automaton and the recycling table evolve from the committed stream alone. A policy
can therefore be replayed exactly on one plain reply: at each pass the drafts the sources
would offer, the prefix of each the reply confirms, the pass's cost by the table. Policies:

  chain         the conversation's draft after a match of >= 2 tokens (budget
                2 x (1 + match), at most 16), else the recycling chain's first token
  tree          as chain, and where both sources have a draft whose first tokens differ,
                both verified in one pass as siblings (rows = both drafts); the longer
                accepted one commits
  tree-rec2     tree with a 2-token recycling chain
  hindsight     chain, but a pass verifies only the prefix that will be accepted (none when
                the first token fails): the bound no gate on these drafts can pass

The cost gate is left out (the replay prices every pass the policy makes), so `chain` is
below what `benchmarks/speculative.py --priced` reports; the ratios between policies are
the point. Default table: SmolLM2-135M Q4_1's two-thread AVX-512 one (measured 2026-12-02).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fucina  # noqa: E402
from fucina.text.generate import common_prefix  # noqa: E402
from fucina.text.speculative.gate import table_cost  # noqa: E402
from fucina.text.speculative.recycling import TokenRecycling  # noqa: E402
from fucina.text.speculative.sam import SamIndex  # noqa: E402
import speculative as B  # noqa: E402

DEFAULT_TABLE = "1:1.03,2:1.22,3:1.35,4:1.44,5:1.70,6:1.74,7:1.85,8:2.80,12:3.22,16:3.71"
POLICIES = ("chain", "tree", "tree-rec2", "hindsight")


def replay(prefix: list[int], reply: list[int], n_vocab: int, table, policy: str) -> tuple[float, float]:
    """(priced speedup, tokens per pass) of `policy` decoding `reply` after `prefix`."""
    sam, rec = SamIndex(), TokenRecycling(n_vocab)
    sam.append(prefix + reply[:1])
    rec.observe(prefix + reply[:1])
    rec_len = 2 if policy == "tree-rec2" else 1
    p, cost, passes = 1, 0.0, 0        # reply[:p] committed (the first token came from prefill)
    while p < len(reply):
        future = reply[p:]
        m = sam.match_len()
        a = sam.draft(min(16, 2 * (1 + m))) if m >= 2 else []
        b = rec.draft_chain(reply[p - 1], rec_len)
        if policy.startswith("tree") and a and b and a[0] != b[0]:
            accepted, rows = max(common_prefix(a, future), common_prefix(b, future)), len(a) + len(b)
        else:
            d = a or b
            accepted, rows = common_prefix(d, future), len(d)
            if policy == "hindsight":
                rows = accepted
        n = min(accepted + 1, len(reply) - p)
        cost += table_cost(table, rows)
        passes += 1
        sam.append(reply[p:p + n])
        rec.observe(reply[p:p + n])
        p += n
    return (len(reply) - 1) / cost, (len(reply) - 1) / passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(Path.home() / ".cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--workloads", default="edit,summary,copy,story")
    ap.add_argument("--table", default=DEFAULT_TABLE, help="k:cost,... (verify of 1 + k rows in plain steps)")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    table = ((0, 1.0),) + tuple((int(k), float(c)) for k, c in (kv.split(":") for kv in args.table.split(",")))
    llm = fucina.load(args.model)
    for name in args.workloads.split(","):
        if name in B.OPTIONS:
            print(f"{name}: a constrained workload (its forced spans are not replayed), skipped")
            continue
        conv = llm.chat(max_tokens=args.max_tokens, temperature=0)
        for turn in B.WORKLOADS[name]:
            conv.send(turn)
        reply, hist = list(conv.last.tokens), list(conv.tokens)
        cut = next(c for c in range(len(hist) - len(reply), -1, -1) if hist[c:c + len(reply)] == reply)
        res = {pol: replay(hist[:cut], reply, llm.model.config.n_vocab, table, pol) for pol in POLICIES}
        print(f"{name:10} {len(reply):4d} tok  " +
              "  ".join(f"{pol} x{s:.3f} ({t:.2f} tok/pass)" for pol, (s, t) in res.items()))


if __name__ == "__main__":
    main()
