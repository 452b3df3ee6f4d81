"""`fucina mtp train MODEL --out HEAD.gguf`: a multi-token-prediction head trained by
self-distillation (train/mtp.py), and `--mtp` for run, chat and serve: a head drafts
for speculative decoding (`--spec`; lossless, the verify pass decides)."""
from __future__ import annotations

import json
import sys

from fucina.errors import FucinaError

MTP_HELP = ("multi-token-prediction drafts for --spec: a head GGUF trained for this model (`fucina mtp "
            "train`), or `own` for the NextN block the model's file carries (glm4moe)")


def add_mtp_args(p) -> None:
    p.add_argument("--mtp", metavar="HEAD.gguf|own", default=None, help=MTP_HELP)


def mtp_value(args):
    """--mtp as fucina.load's `mtp=`: None, True (own) or a path."""
    v = getattr(args, "mtp", None)
    return True if v == "own" else v


def apply_mtp_args(model, args) -> None:
    v = mtp_value(args)
    if v is not None:
        from fucina.models.mtp import attach_from
        attach_from(model, v)


def add_parser(sub) -> None:
    from fucina.cli.common import positive

    s = sub.add_parser("mtp", help="multi-token-prediction heads: train one for a model that ships none")
    msub = s.add_subparsers(dest="mtp_command", metavar="MTP_COMMAND")
    t = msub.add_parser("train", help="self-distil a NextN-shaped head from the model's own greedy continuations")
    t.add_argument("model", help="GGUF file or packaged name (smollm2, gemma3)")
    t.add_argument("--out", required=True, help="the head GGUF to write")
    t.add_argument("--seed", type=int, default=0, help="prompt order, sampled openings, training order (default 0)")
    t.add_argument("--data", help="prompts to continue, one per line (default: a built-in varied set)")
    t.add_argument("--steps", type=positive, default=600, help="optimizer steps, one sequence each (default 600)")
    t.add_argument("--sequences", type=positive, default=48, help="self-distilled sequences (default 48)")
    t.add_argument("--tokens", type=positive, default=160, help="generated tokens per sequence (default 160)")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    t.add_argument("--draft-vocab", type=positive, default=8192,
                   help="tokens the head scores when drafting: the continuations' most frequent (default 8192)")
    t.add_argument("--threads", "-t", type=positive)
    t.add_argument("--json", action="store_true", help="the run's figures as one JSON object on stdout")
    t.set_defaults(func=cmd_train)
    s.set_defaults(func=lambda args: (s.print_help(), 2)[1])


def cmd_train(args) -> int:
    import os

    import fucina.kernels as kernels
    from fucina.text.api import load
    from fucina.train.mtp import TrainOptions, train_head

    n = args.threads or os.cpu_count() or 1
    kernels.set_threads(n)
    import torch
    torch.set_num_threads(n)
    prompts = None
    if args.data:
        try:
            with open(args.data, encoding="utf-8") as fh:
                prompts = [line.strip() for line in fh if line.strip()]
        except OSError as e:
            raise FucinaError(f"cannot read --data {args.data}: {e.strerror}") from e
        if not prompts:
            raise FucinaError(f"--data {args.data} holds no prompts")
    if args.lr <= 0:
        raise FucinaError(f"--lr must be > 0, got {args.lr}")
    llm = load(args.model)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    opts = TrainOptions(steps=args.steps, sequences=args.sequences, tokens=args.tokens, lr=args.lr, seed=args.seed,
                        draft_vocab=args.draft_vocab, log=log, **({"prompts": prompts} if prompts else {}))
    stats = train_head(llm, args.out, opts)
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"{args.out}: {stats['steps']} steps on {stats['tokens']} self-distilled tokens in "
              f"{stats['total_seconds']:.0f} s (distillation {stats['distill_seconds']:.0f} s); next-token accuracy "
              f"{stats['accuracy']:.1%} over a {stats['draft_vocab']}-token draft vocabulary")
    return 0
