"""`fucina finetune --method es`: reward fine-tuning by evolution strategies (fucina.train.es).

    fucina finetune [MODEL] --method es --reward nll|acc|regex:P --data F.jsonl --out DIR \\
        [--iterations N] [--population N] [--sigma S] [--seed S] [--mode lora|full] [--workers W]

Writes DIR/adapter.gguf (mode lora: what --lora, `fucina export` and llama.cpp's --lora
take) or DIR/model.gguf (mode full), DIR/checkpoint.pt and DIR/summary.json; one progress
line per iteration on stderr.
"""
from __future__ import annotations

import json
import os
import sys

from fucina.errors import FucinaError

#: the flags only ES reads (the gradient path refuses them), with their ES defaults
ES_DEFAULTS = dict(reward=None, iterations=100, population=8, sigma=0.02, mode="lora", workers=1,
                   norm="rank", anchor="none", anchor_lambda=0.0, max_tokens=32, init=None)
ES_LR, ES_BATCH = 0.002, 8


def add_es_args(s) -> None:
    g = s.add_argument_group("evolution strategies (--method es)")
    g.add_argument("--reward", help="nll (log-likelihood of the dataset's reply, teacher-forced), acc "
                                    "(the greedy reply contains the answer: the record's 'answer' or its "
                                    "reply), or regex:PATTERN (the greedy reply matches, re.search)")
    g.add_argument("--iterations", type=int, help=f"ES iterations (default {ES_DEFAULTS['iterations']})")
    g.add_argument("--population", type=int, help="members per iteration, even: mirrored pairs "
                                                   f"(default {ES_DEFAULTS['population']})")
    g.add_argument("--sigma", type=float, help=f"perturbation scale (default {ES_DEFAULTS['sigma']})")
    g.add_argument("--mode", choices=("lora", "full"), help="perturb LoRA A/B over the frozen quantized "
                   "weights (default; writes adapter.gguf) or the target projections themselves as F32 "
                   "copies (small models; writes model.gguf)")
    g.add_argument("--workers", type=int, help="processes evaluating members in parallel, each loading "
                                               "the model; the same result for any count (default 1)")
    g.add_argument("--norm", choices=("rank", "zscore"), help="reward shaping (default rank)")
    g.add_argument("--anchor", choices=("none", "l1", "l2"), help="anchored weight decay toward the "
                                                                   "start (default none)")
    g.add_argument("--anchor-lambda", type=float, help="anchored decay strength (default 0)")
    g.add_argument("--max-tokens", type=int, help="reply length for acc/regex (default 32)")
    g.add_argument("--init", metavar="ADAPTER.gguf", help="start from this adapter (same --targets, --rank, "
                   "--alpha), e.g. an nll run's before a sparse acc/regex reward")


def es_flags_given(args) -> list[str]:
    return ["--" + k.replace("_", "-") for k in ES_DEFAULTS if getattr(args, k, None) is not None]


def cmd_finetune_es(args) -> int:
    from fucina.cli.finetune import _threads
    from fucina.cli.common import resume_gc
    from fucina.models import load_model, resolve_model
    from fucina.text.chat_template import ChatTemplate
    from fucina.text.tokenizer import Tokenizer
    from fucina.train.es import ESConfig, ESTrainer, read_es_jsonl

    opt = {k: (v if getattr(args, k, None) is None else getattr(args, k)) for k, v in ES_DEFAULTS.items()}
    if opt["reward"] is None:
        raise FucinaError("--method es needs --reward nll|acc|regex:PATTERN")
    if opt["iterations"] < 1:
        raise FucinaError(f"--iterations must be at least 1, got {opt['iterations']}")
    if opt["workers"] < 1:
        raise FucinaError(f"--workers must be at least 1, got {opt['workers']}")
    _threads(args.threads, opt["workers"])
    path = resolve_model(args.model)
    model = load_model(path)
    resume_gc()
    meta = model.gguf.metadata
    tok = Tokenizer.from_metadata(meta)
    tpl = ChatTemplate.from_metadata(meta, tok)
    examples = read_es_jsonl(args.data, tok, tpl)
    cfg = ESConfig(population=opt["population"], sigma=opt["sigma"],
                   lr=args.lr if args.lr is not None else ES_LR, seed=args.seed, mode=opt["mode"],
                   rank=args.rank, alpha=args.alpha, targets=args.targets,
                   batch=args.batch if args.batch is not None else ES_BATCH, norm=opt["norm"],
                   anchor=opt["anchor"], anchor_lambda=opt["anchor_lambda"], max_tokens=opt["max_tokens"])

    def log(msg: str) -> None:
        print(f"fucina: {msg}", file=sys.stderr)

    trainer = ESTrainer(model, tok, tpl, cfg, examples, opt["reward"], args.out, workers=opt["workers"],
                        model_path=str(path), threads=args.threads, log=log, progress=not args.no_progress,
                        init=opt["init"])
    try:
        if args.resume:
            trainer.resume(args.resume)
            log(f"resumed at iteration {trainer.iteration}")
        log(f"{len(examples)} examples; ES {cfg.mode} on {','.join(cfg.targets)} "
            f"({sum(t.numel() for t in trainer.theta)} parameters), population {cfg.population}, "
            f"sigma {cfg.sigma}, lr {cfg.lr}, reward {opt['reward']}, {opt['workers']} worker(s)")
        summary = trainer.fit(opt["iterations"], checkpoint_every=args.save_every)
    finally:
        trainer.close()
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump(dict(summary, history=trainer.history), fh, indent=1)
    log(f"done: {summary['iterations']} iterations, mean reward {summary['first_mean']:.4f} -> "
        f"{summary['final_mean']:.4f}, {summary['s_per_iteration']:.2f} s per iteration; "
        f"wrote {summary['out']}")
    return 0
