"""Cartridge vs the document in the prompt (ICL) vs nothing: KV bytes per conversation,
time to first token, and answer quality on short factual questions.

    python benchmarks/cartridge.py MODEL --doc benchmarks/data/cartridge_doc.txt \
        --questions benchmarks/data/cartridge_questions.json --cartridge C.safetensors [--json]

Quality: each question is asked greedily as a fresh one-turn chat (up to --max-tokens tokens) and
counts as right when the reference answer appears in the reply (case-insensitive);
also the teacher-forced NLL (nats/token) of the reference answer right after the
generation prompt. ICL puts the document in the system message; the cartridge and
the bare model get no system message (as self-study trains the student).
Time to first token: a fresh cache, the prompt prefilled and one token sampled, for a
question with the document in the prompt vs behind the cartridge (its rows written
into the cache first, included in the time); medians of --reps, alternated in one run.
Without --cartridge, an untrained corpus-initialised cartridge of --p rows is used.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--doc", required=True)
    ap.add_argument("--questions", required=True, help="JSON list of [question, answer]")
    ap.add_argument("--cartridge", action="append", default=[],
                    help="a trained cartridge (default: corpus-initialised, untrained); repeat to compose "
                         "several in order, a .txt standing for that document's untrained first --p rows")
    ap.add_argument("--p", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--conditions", default="bare,icl,cartridge", help="quality conditions to run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import fucina
    from fucina import kernels
    from fucina.models.cartridge import Cartridge, compose
    from fucina.text.api import LLM
    from fucina.text.chat_template import prompt_ids

    kernels.set_threads(args.threads)
    doc = open(args.doc, encoding="utf-8").read()
    questions = json.load(open(args.questions))
    llm = fucina.load(args.model, n_ctx=4096)
    model, tok = llm.model, llm.tokenizer
    doc_ids = tok.encode(doc, add_special=True)
    def one(spec: str) -> Cartridge:       # a cartridge file, or a document's own first p rows
        if spec.endswith(".safetensors"):
            return Cartridge.load(spec)
        return Cartridge.capture(model, tok.encode(open(spec, encoding="utf-8").read(), add_special=True)[:args.p])
    cart = compose([one(c) for c in args.cartridge]) if args.cartridge else \
        Cartridge.capture(model, doc_ids[:args.p])
    cart.check_model(model)
    icl_system = f"Answer using the following document.\n\n{doc}"
    render = lambda msgs: prompt_ids(tok, llm.template.render(msgs, add_generation_prompt=True,  # noqa: E731
                                                              enable_thinking=False))

    def messages(q, icl):
        return ([{"role": "system", "content": icl_system}] if icl else []) + [{"role": "user", "content": q}]

    # -- KV bytes and time to first token ---------------------------------------------------
    q0 = questions[0][0]
    icl_ids, plain_ids = render(messages(q0, True)), render(messages(q0, False))
    per_pos = model.init_cache(16).bytes_per_position()

    def ttft(icl: bool) -> float:
        t = time.perf_counter()
        cache = model.init_cache(4096)
        if icl:
            logits = model.forward_step(cache, icl_ids, 0)
        else:
            cart.write_to_cache(cache)
            logits = model.forward_step(cache, plain_ids, cache.len)
        int(logits.argmax())
        return time.perf_counter() - t

    t_icl, t_cart = [float("nan")], [float("nan")]
    if not args.skip_ttft:
        ttft(True), ttft(False)   # warm-up
        t_icl, t_cart = [], []
        for _ in range(args.reps):
            t_icl.append(ttft(True))
            t_cart.append(ttft(False))
    res = {"model": model.gguf.path.name if hasattr(model.gguf.path, "name") else str(model.gguf.path),
           "doc_tokens": len(doc_ids), "p": cart.p, "threads": args.threads,
           "icl_prompt_tokens": len(icl_ids), "cartridge_prompt_tokens": len(plain_ids),
           "kv_bytes_icl": len(icl_ids) * per_pos, "kv_bytes_cartridge": cart.p * per_pos + len(plain_ids) * per_pos,
           "ttft_icl_s": statistics.median(t_icl), "ttft_cartridge_s": statistics.median(t_cart)}
    res["ttft_speedup"] = res["ttft_icl_s"] / res["ttft_cartridge_s"]
    res["kv_ratio"] = res["kv_bytes_icl"] / res["kv_bytes_cartridge"]

    # -- quality --------------------------------------------------------------------------
    if not args.skip_quality:
        from fucina.text.cartridge import Prefix
        from fucina.text.generate import prefill

        wanted = args.conditions.split(",")
        for name, icl, behind in (("bare", False, False), ("icl", True, False), ("cartridge", False, True)):
            if name not in wanted:
                continue
            right, nlls, answers = 0, [], []
            front = LLM(model, tok, llm.template, n_ctx=4096, cartridge=cart if behind else None)
            # one conversation and one scoring cache per condition: the document (or the
            # cartridge) stays cached across questions (prefix reuse), as a server slot would
            conv = front.chat(max_tokens=args.max_tokens, temperature=0, think=False)
            pre = Prefix(cart) if behind else None
            cache, hist = model.init_cache(4096), []
            for q, a in questions:
                reply = conv.send_messages(messages(q, icl))
                ok = a.lower() in reply.lower()
                right += ok
                answers.append({"q": q, "reply": reply.strip()[:120], "ok": ok})
                ids = render(messages(q, icl))
                ids = pre.add(ids) if pre else ids
                if pre:
                    pre.ensure(cache, hist, ids)
                first = prefill(model, cache, hist, ids)[0]
                ans = tok.encode(" " + a, add_special=False)
                rest = model.forward_step_all_logits(cache, ans[:-1], cache.len) if len(ans) > 1 else first[None][:0]
                lp = torch.log_softmax(torch.cat([first[None], rest]).float(), -1)
                nlls.append(float(-lp[torch.arange(len(ans)), torch.tensor(ans)].mean()))
                cache.truncate(len(hist))
            res[f"right_{name}"] = right
            res[f"nll_{name}"] = statistics.mean(nlls)
            res[f"answers_{name}"] = answers
            print(f"{name}: {right}/{len(questions)} right, reference NLL {statistics.mean(nlls):.3f}",
                  file=sys.stderr, flush=True)
        if len(wanted) == 3:
            gain_icl = res["right_icl"] - res["right_bare"]
            res["recovered"] = (res["right_cartridge"] - res["right_bare"]) / gain_icl if gain_icl else None
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            if not k.startswith("answers_"):
                print(f"{k:<26} {v:.4g}" if isinstance(v, float) else f"{k:<26} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
