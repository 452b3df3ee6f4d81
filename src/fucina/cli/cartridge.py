"""`fucina cartridge equiv|train|fleet`: the equivalence gate and self-study training of a
cartridge (a document compressed into a trained KV prefix), fleets of them (add, list,
train, query), and the `--cartridge` option of run, chat and serve."""
from __future__ import annotations

import argparse
import json
import os
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
    from fucina.train.cartridge import train_cartridge

    model = _load(args)
    tok = _tokenizer(model)
    text = read_corpus(args.corpus)
    cfg = _config(args, p=args.p, init=args.init, embed_corpus=not args.no_corpus)
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    distractors = [_distractor(model, tok, path, args.p) for path in args.distractor]
    cart = train_cartridge(model, tok, text, cfg, out=args.out, resume=args.resume, log=log,
                           save_passes=args.save_passes, distractors=distractors)
    print(f"wrote {args.out}: p {cart.p}, {cart.nbytes() / 1e6:.2f} MB of f16 KV")
    return 0


def _distractor(model, tok, path: str, p: int):
    """A distractor for --distract: a cartridge file, or a document's own first p rows."""
    from fucina.models.cartridge import Cartridge

    if path.endswith(".safetensors"):
        cart = Cartridge.load(path)
        cart.check_model(model)
        return cart
    return Cartridge.capture(model, corpus_ids(tok, read_corpus(path))[:p])


def _training_args(s) -> None:
    from fucina.cli.common import positive

    # the defaults are the recipe measured on the quality benchmark (docs/CARTRIDGES.md):
    # 128 four-turn conversations spread over the document (64 met the gate on one seed of
    # three, 128 on all three), five passes of one-conversation Adam steps in channel units
    s.add_argument("--conversations", type=positive, default=128,
                   help="self-study conversations (default 128)")
    s.add_argument("--turns", type=positive, default=4,
                   help="question-answer exchanges per conversation: bot A asks again, about something else, "
                        "after each answer (default 4)")
    s.add_argument("--accum", type=positive, default=1, help="conversations per optimizer step (default 1)")
    s.add_argument("--batch", type=positive, default=8,
                   help="self-study conversations generated together in lockstep (default 8; "
                        "the result does not depend on it)")
    s.add_argument("--epochs", type=positive, default=5,
                   help="passes over the conversations (each made once; default 5)")
    s.add_argument("--lr", type=float, default=1e-2,
                   help="Adam learning rate (default 1e-2: a hundredth of a channel's size a step)")
    s.add_argument("--channel-lr", action=argparse.BooleanOptionalAction, default=True,
                   help="Adam in units of each (head, channel)'s size: --lr is the step as a fraction of a "
                        "channel's size (default); --no-channel-lr: one absolute step for every channel")
    s.add_argument("--decay", action="store_true", help="the learning rate falls linearly to zero over the run")
    s.add_argument("--spread", action=argparse.BooleanOptionalAction, default=True,
                   help="conversation i's chunk at the i-th point of a golden-ratio sequence over the document "
                        "and the seed prompts in turn, so any first n conversations cover both evenly "
                        "(default; --no-spread: drawn at random)")
    s.add_argument("--chunk", type=positive, default=384, help="corpus tokens shown per conversation (default 384)")
    s.add_argument("--teacher", choices=("chunk", "document"), default="chunk",
                   help="what the answering bot (the teacher) reads: the conversation's chunk (default) or "
                        "the whole document; the questions are about the chunk either way")
    s.add_argument("--max-question", type=positive, default=48, help="question tokens (default 48)")
    s.add_argument("--max-answer", type=positive, default=96, help="answer tokens (default 96)")
    s.add_argument("--top-k", type=positive, default=20, help="teacher log-probabilities kept per token")
    s.add_argument("--distract", type=_fraction, default=0.0, metavar="P",
                   help="joint training against composition collapse: this fraction of the conversations "
                        "train with a distractor cartridge composed before or after the rows (default 0)")


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction from 0 to 1, got {text!r}")
    return v


def _config(args, **kw):
    from fucina.train.cartridge import SelfStudyConfig

    return SelfStudyConfig(conversations=args.conversations, seed=getattr(args, "seed", 0), lr=args.lr,
                           accum=args.accum, chunk_tokens=args.chunk, max_question=args.max_question,
                           max_answer=args.max_answer, top_k=args.top_k, batch=args.batch, epochs=args.epochs,
                           scaled=args.channel_lr, turns=args.turns, decay=args.decay, distract=args.distract,
                           spread=args.spread, teacher=args.teacher,
                           **kw)


def cmd_fleet_add(args) -> int:
    from fucina.models.cartridge_fleet import Fleet

    fleet = Fleet.create(args.fleet)
    for i, corpus in enumerate(args.corpus):
        name = args.name if args.name and len(args.corpus) == 1 else \
            os.path.splitext(os.path.basename(corpus))[0]
        read_corpus(corpus)
        e = fleet.add(name, corpus, p=args.p, seed=args.seed + i if args.seed is not None else None)
        print(f"added {e.name}: {e.corpus}, p {e.p}, seed {e.seed}")
    return 0


def cmd_fleet_list(args) -> int:
    from fucina.models.cartridge_fleet import Fleet

    fleet = Fleet.open(args.fleet)
    rows = []
    for e in fleet.entries:
        path = fleet.path(e.file)
        size = os.path.getsize(path) if os.path.exists(path) else 0
        rows.append({"name": e.name, "corpus": e.corpus, "p": e.p, "seed": e.seed, "conversations": e.conversations,
                     "steps": e.steps, "file": e.file if size else None, "bytes": size})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'name':<24} {'p':>5} {'conversations':>13} {'steps':>6} {'file MB':>8}  corpus")
    for r in rows:
        print(f"{r['name']:<24} {r['p']:>5} {r['conversations']:>13} {r['steps']:>6} "
              f"{r['bytes'] / 1e6 if r['bytes'] else float('nan'):>8.2f}  {r['corpus']}")
    return 0


def cmd_fleet_train(args) -> int:
    from fucina.cli.main import _load, _tokenizer
    from fucina.models.cartridge_fleet import Fleet
    from fucina.train.cartridge_fleet import train_fleet

    fleet = Fleet.open(args.fleet)
    model = _load(args)
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    res = train_fleet(model, _tokenizer(model), fleet, _config(args), budget=args.ram << 20, turn=args.turn,
                      names=args.only or None, log=log)
    print(f"trained {len(res['trained'])} cartridges to {args.conversations} conversations "
          f"({res['loads']} loads, {res['evictions']} evictions)")
    return 0


def cmd_fleet_query(args) -> int:
    from fucina.cli.main import _load, _tokenizer
    from fucina.text.cartridge import FleetPrefixes
    from fucina.text.retrieval import embed

    model = _load(args)
    fleet = FleetPrefixes(args.fleet, model, tokenizer=_tokenizer(model), top_k=args.top_k)
    if not fleet.names():
        raise FucinaError(f"the fleet {args.fleet} has no trained cartridge yet (fucina cartridge fleet train)")
    index = fleet.build_index(log=lambda s: print(s, file=sys.stderr, flush=True))
    ids = fleet.tokenizer.encode(args.text, add_special=False, parse_special=False)
    if not ids:
        raise FucinaError("the query is empty")
    ranked = index.scores(embed(model, ids))
    picked = fleet.index.pick(model, fleet.tokenizer, args.text, args.top_k)
    if args.json:
        print(json.dumps({"picked": picked, "scores": [{"name": n, "score": round(v, 4)} for n, v in ranked]}))
        return 0
    for n, v in ranked:
        print(f"{v:7.4f}  {n}{'  <- picked' if n in picked else ''}")
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
    _training_args(s)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--init", choices=("corpus", "random"), default="corpus",
                   help="initial rows: the first p corpus tokens (default) or random vectors")
    s.add_argument("--no-corpus", action="store_true",
                   help="do not embed the corpus token ids (the speculation reference) in the file")
    s.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint (OUT.ckpt)")
    s.add_argument("--distractor", action="append", default=[], metavar="FILE",
                   help="what --distract mixes in: a cartridge (.safetensors) or a document (its first --p "
                        "rows); repeatable")
    s.add_argument("--save-passes", action="store_true",
                   help="also write the cartridge after every pass, as OUT.passK.safetensors (to pick --epochs)")
    s.add_argument("--threads", "-t", type=positive)
    s.set_defaults(func=cmd_train)

    s = cs.add_parser("fleet", help="a fleet: one cartridge per document, trained and served together")
    fs = s.add_subparsers(dest="fleet_command", metavar="ACTION")
    f = fs.add_parser("add", help="register documents in a fleet directory (made if missing)")
    f.add_argument("fleet", help="fleet directory (its manifest is DIR/fleet.json)")
    f.add_argument("corpus", nargs="+", help="text files, one cartridge each (named after the file)")
    f.add_argument("--name", help="the cartridge's name (one document only; default: the file's stem)")
    f.add_argument("--p", type=positive, default=128, help="cartridge rows (default 128)")
    f.add_argument("--seed", type=int, default=None, help="first seed (default: the document's position)")
    f.set_defaults(func=cmd_fleet_add)
    f = fs.add_parser("list", help="the fleet's documents and their training")
    f.add_argument("fleet")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_fleet_list)
    f = fs.add_parser("train", help="train every document's cartridge by self-study under a RAM budget")
    f.add_argument("model", help=model_help)
    f.add_argument("fleet")
    _training_args(f)
    f.add_argument("--ram", type=positive, default=512, metavar="MB",
                   help="training state (rows, gradients, Adam) kept in RAM; the least recently used "
                        "document is evicted to disk beyond it (default 512)")
    f.add_argument("--turn", type=positive, default=4, help="optimizer steps a document trains per turn (default 4)")
    f.add_argument("--only", action="append", metavar="NAME", help="train only these documents (repeatable)")
    f.add_argument("--threads", "-t", type=positive)
    f.set_defaults(func=cmd_fleet_train)

    f = fs.add_parser("query", help="which trained cartridges retrieval picks for a text (what serve --fleet "
                                    "does with a request that names none), with every document's score")
    f.add_argument("model", help=model_help)
    f.add_argument("fleet")
    f.add_argument("text", help="the query (a request's last user message)")
    f.add_argument("--top-k", type=positive, default=1, help="cartridges picked (default 1)")
    f.add_argument("--json", action="store_true")
    f.add_argument("--threads", "-t", type=positive)
    f.set_defaults(func=cmd_fleet_query)

    def fleet_action(args):
        s.print_help()
        return 2
    s.set_defaults(func=fleet_action)

    def need_action(args):
        top.print_help()
        return 2
    top.set_defaults(func=need_action)


def add_cartridge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cartridge", action="append", default=[], metavar="C.safetensors",
                   help="serve behind a trained KV prefix; repeat to compose several in order")
