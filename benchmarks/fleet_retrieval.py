"""Retrieval accuracy over a cartridge fleet: for each question, is its document the
one (or among the k) that `text.retrieval` picks? No cartridge is trained: retrieval
reads the documents only.

    python benchmarks/fleet_retrieval.py MODEL [--chunk 128] [--threads 2]

The fleet is benchmarks/data/cartridge_doc.txt (the handbook, its 24 questions) plus
the four documents under benchmarks/data/fleet/ (8 questions each). Besides the
shipped recipe (chunks, centred) it scores two ablations on the same embeddings: no
centring, and one embedding per whole document.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import fucina
    from fucina.models.cartridge_fleet import Fleet
    from fucina.text.retrieval import FleetIndex, _unit, chunks_of, embed

    llm = fucina.load(args.model)
    model, tok = llm.model, llm.tokenizer
    questions = {"handbook": json.load(open(os.path.join(DATA, "cartridge_questions.json")))}
    questions.update(json.load(open(os.path.join(DATA, "fleet", "questions.json"))))
    root = tempfile.mkdtemp(prefix="fleet-retrieval-")
    try:
        fleet = Fleet.create(root)
        fleet.add("handbook", os.path.join(DATA, "cartridge_doc.txt"))
        for name in questions:
            if name != "handbook":
                fleet.add(name, os.path.join(DATA, "fleet", name + ".txt"))
        names = [e.name for e in fleet.entries]
        t0 = time.perf_counter()
        idx = FleetIndex.build(model, tok, fleet, names, args.chunk)
        build_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # the ablations score the same embeddings: the raw chunk ones, and whole documents
    paths = {n: os.path.join(DATA, "cartridge_doc.txt" if n == "handbook" else f"fleet/{n}.txt") for n in names}
    doc_ids = {n: tok.encode(open(paths[n]).read(), add_special=False, parse_special=False) for n in names}
    raw = torch.stack([embed(model, c) for n in names for c in chunks_of(doc_ids[n], args.chunk)])
    doc_vecs = torch.stack([embed(model, doc_ids[n]) for n in names])

    def rank_chunks(q, centre: bool):
        mean = raw.mean(0) if centre else torch.zeros_like(q)
        cos = _unit(raw - mean) @ _unit(q - mean)
        best = torch.full((len(names),), -2.0).scatter_reduce(0, idx.owner, cos, "amax")
        return best.argsort(descending=True).tolist()

    def rank_docs(q):
        mean = doc_vecs.mean(0)
        return (_unit(doc_vecs - mean) @ _unit(q - mean)).argsort(descending=True).tolist()

    recipes = {"chunks, centred (shipped)": lambda q: rank_chunks(q, True),
               "chunks, not centred": lambda q: rank_chunks(q, False),
               "whole documents, centred": rank_docs}
    hits = {r: [0, 0] for r in recipes}
    per_doc = {n: 0 for n in names}
    total, t_query = 0, []
    for d, name in enumerate(names):
        for q, _ in questions[name]:
            t0 = time.perf_counter()
            v = embed(model, tok.encode(q, add_special=False, parse_special=False))
            t_query.append(time.perf_counter() - t0)
            total += 1
            for r, fn in recipes.items():
                order = fn(v)
                hits[r][0] += order[0] == d
                hits[r][1] += d in order[:2]
            per_doc[name] += rank_chunks(v, True)[0] == d
    print(f"model {os.path.basename(args.model)}, {len(names)} documents, {raw.shape[0]} chunks of "
          f"{args.chunk} tokens, {total} questions; index built in {build_s:.1f} s, "
          f"a query embedded in {1000 * sorted(t_query)[len(t_query) // 2]:.0f} ms (median)")
    for r, (top1, top2) in hits.items():
        print(f"  {r:28s} top-1 {top1}/{total} ({top1 / total:.0%})  top-2 {top2}/{total} ({top2 / total:.0%})")
    print("  shipped recipe, top-1 by document: " +
          ", ".join(f"{n} {per_doc[n]}/{len(questions[n])}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
