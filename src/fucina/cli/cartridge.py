"""`fucina cartridge equiv|train`: the equivalence gate and self-study training of a
cartridge (a document compressed into a trained KV prefix), and the `--cartridge`
option of run, chat and serve."""
from __future__ import annotations

import argparse
import json
import sys

from fucina.errors import FucinaError


def read_corpus(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as e:
        raise FucinaError(f"cannot read the corpus {path}: {e.strerror or e}") from None
    if not text.strip():
        raise FucinaError(f"the corpus {path} is empty")
    return text


def corpus_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special=True, parse_special=False)


def cmd_equiv(args) -> int:
    from fucina.cli.main import _load, _tokenizer
    from fucina.models.cartridge import equivalence

    model = _load(args)
    ids = corpus_ids(_tokenizer(model), read_corpus(args.corpus))
    res = equivalence(model, ids, args.p, suffix=args.suffix, greedy=args.greedy, cache_type=args.cache_type)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"p {res['p']}, suffix {res['suffix']}: max |d logit| {res['max_abs']:.3g}"
              f"{' (bitwise)' if res['bitwise'] else ''}, next-token argmax {res['argmax_agree']}/{res['suffix']}, "
              f"greedy agreement {res['greedy_agree']}/{res['greedy']} tokens; "
              f"one-pass prefill max |d| {res['one_pass_max_abs']:.3g}; cartridge KV {res['kv_bytes'] / 1e6:.2f} MB")
    ok = res["bitwise"] if args.cache_type == "f16" else res["argmax_agree"] == res["suffix"]
    return 0 if ok and res["greedy_agree"] == res["greedy"] else 1


def cmd_train(args) -> int:
    from fucina.cli.main import _load, _tokenizer
    from fucina.train.cartridge import SelfStudyConfig, train_cartridge

    model = _load(args)
    tok = _tokenizer(model)
    text = read_corpus(args.corpus)
    cfg = SelfStudyConfig(p=args.p, conversations=args.conversations, seed=args.seed, lr=args.lr,
                          accum=args.accum, chunk_tokens=args.chunk, max_question=args.max_question,
                          max_answer=args.max_answer, top_k=args.top_k, init=args.init,
                          embed_corpus=not args.no_corpus, batch=args.batch)
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    cart = train_cartridge(model, tok, text, cfg, out=args.out, resume=args.resume, log=log)
    print(f"wrote {args.out}: p {cart.p}, {cart.nbytes() / 1e6:.2f} MB of f16 KV")
    return 0


def add_parser(sub) -> None:
    from fucina.cli.common import count, positive

    model_help = "GGUF file or packaged name (smollm2, gemma3, qwen2.5-coder)"
    top = sub.add_parser("cartridge", help="compress a document into a trained KV prefix (a cartridge)")
    cs = top.add_subparsers(dest="cartridge_command", metavar="ACTION")

    s = cs.add_parser("equiv", help="gate: an untrained corpus-initialised cartridge equals the real "
                                    "prefill of those p tokens (exit 0 iff equal)")
    s.add_argument("model", nargs="?", help=model_help)
    s.add_argument("--corpus", required=True, help="text file")
    s.add_argument("--p", type=positive, default=256, help="cartridge rows (default 256)")
    s.add_argument("--suffix", type=positive, default=32, help="corpus tokens after p compared (default 32)")
    s.add_argument("--greedy", type=count, default=16, help="greedy tokens compared after them (default 16)")
    s.add_argument("--cache-type", choices=("f16", "q8_0"), default="f16")
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")
    s.add_argument("--threads", "-t", type=positive)
    s.set_defaults(func=cmd_equiv)

    s = cs.add_parser("train", help="train a cartridge on a document by self-study distillation")
    s.add_argument("model", nargs="?", help=model_help)
    s.add_argument("--corpus", required=True, help="text file (the document)")
    s.add_argument("--p", type=positive, default=128, help="cartridge rows (default 128)")
    s.add_argument("--out", required=True, help="output .safetensors")
    s.add_argument("--conversations", type=positive, default=64,
                   help="self-study conversations (default 64)")
    s.add_argument("--accum", type=positive, default=4, help="conversations per optimizer step (default 4)")
    s.add_argument("--batch", type=positive, default=8,
                   help="self-study conversations generated together in lockstep (default 8; "
                        "the result does not depend on it)")
    s.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default 2e-3)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--chunk", type=positive, default=384, help="corpus tokens shown per conversation (default 384)")
    s.add_argument("--max-question", type=positive, default=48, help="question tokens (default 48)")
    s.add_argument("--max-answer", type=positive, default=96, help="answer tokens (default 96)")
    s.add_argument("--top-k", type=positive, default=20, help="teacher log-probabilities kept per token")
    s.add_argument("--init", choices=("corpus", "random"), default="corpus",
                   help="initial rows: the first p corpus tokens (default) or random vectors")
    s.add_argument("--no-corpus", action="store_true",
                   help="do not embed the corpus token ids (the speculation reference) in the file")
    s.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint (OUT.ckpt)")
    s.add_argument("--threads", "-t", type=positive)
    s.set_defaults(func=cmd_train)

    def need_action(args):
        top.print_help()
        return 2
    top.set_defaults(func=need_action)


def add_cartridge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cartridge", action="append", default=[], metavar="C.safetensors",
                   help="serve behind a trained KV prefix; repeat to compose several in order")
