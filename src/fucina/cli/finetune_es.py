"""`fucina finetune --method es`: reward fine-tuning by evolution strategies (fucina.train.es).

    fucina finetune [MODEL] --method es --reward nll|acc|regex:P --data F.jsonl --out DIR \\
        [--iterations N] [--population N] [--sigma S] [--seed S] [--mode lora|full|ternary] [--workers W]
        [--schedule constant|cosine|step] [--valid HELD.jsonl [--eval-every N]]

Writes DIR/adapter.gguf (mode lora: what --lora, `fucina export` and llama.cpp's --lora
take) or DIR/model.gguf (mode full; mode ternary: the TQ2_0 model with its trained trits),
DIR/checkpoint.pt and DIR/summary.json; one progress line per iteration on stderr. With
--valid, the best held-out theta is also DIR/best/ and (--keep best) the final output.
"""
from __future__ import annotations

import json
import os
import sys

from fucina.errors import FucinaError

#: the flags only ES reads (the gradient path refuses them), with their ES defaults
ES_DEFAULTS = dict(reward=None, iterations=100, population=8, sigma=0.02, mode="lora", workers=1,
                   norm="rank", anchor="none", anchor_lambda=0.0, max_tokens=32, init=None,
                   schedule="constant", final_scale=0.1, step_every=50, step_gamma=0.5, decay_sigma=None,
                   eval_reward=None, keep="best", flip_rate=0.001, update_fraction=0.005)
ES_EVAL_EVERY = 10
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
    g.add_argument("--mode", choices=("lora", "full", "ternary"), help="perturb LoRA A/B over the frozen "
                   "quantized weights (default; writes adapter.gguf), the target projections themselves as F32 "
                   "copies (small models; writes model.gguf), or, on a TQ2_0 model, flip the targets' trits in "
                   "the packed bytes the kernels read (writes the trained TQ2_0 model.gguf)")
    g.add_argument("--flip-rate", type=float, help="ternary: share of a tensor's trits a member moves "
                                                   "(default 0.001)")
    g.add_argument("--update-fraction", type=float, help="ternary: share of the trits an update moves one "
                                                         "bin, by vote (default 0.005)")
    g.add_argument("--workers", type=int, help="processes evaluating members in parallel, each loading "
                                               "the model; the same result for any count (default 1)")
    g.add_argument("--norm", choices=("rank", "zscore"), help="reward shaping (default rank)")
    g.add_argument("--anchor", choices=("none", "l1", "l2"), help="anchored weight decay toward the "
                                                                   "start (default none)")
    g.add_argument("--anchor-lambda", type=float, help="anchored decay strength (default 0)")
    g.add_argument("--max-tokens", type=int, help="reply length for acc/regex (default 32)")
    g.add_argument("--init", metavar="ADAPTER.gguf", help="start from this adapter (same --targets, --rank, "
                   "--alpha), e.g. an nll run's before a sparse acc/regex reward")
    g.add_argument("--schedule", choices=("constant", "cosine", "step"),
                   help="step-size decay over the iterations: lr_t = lr s(t); constant (default), cosine "
                        "(to --final-scale at --iterations) or step (x --step-gamma every --step-every)")
    g.add_argument("--final-scale", type=float, help="cosine: s at the last iteration (default 0.1)")
    g.add_argument("--step-every", type=int, help="step: iterations between decays (default 50)")
    g.add_argument("--step-gamma", type=float, help="step: factor per decay (default 0.5)")
    g.add_argument("--decay-sigma", action="store_true", default=None,
                   help="sigma follows the schedule too (finer probes; the move lr_t/sigma_t then stays)")
    g.add_argument("--eval-reward", help="with --valid (held-out examples, scored every --eval-every "
                   f"iterations, default {ES_EVAL_EVERY}): the held-out score (default: --reward), e.g. "
                   "regex:P while training on nll")
    g.add_argument("--keep", choices=("best", "last"), help="with --valid: DIR/adapter.gguf is the best "
                   "held-out theta (default; also in DIR/best/, the last in DIR/last/) or the last")


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
    if getattr(args, "valid_split", None) is not None:
        raise FucinaError("--method es takes held-out examples as --valid F.jsonl, not --valid-split")
    eval_every = args.eval_every or ES_EVAL_EVERY
    if eval_every < 1:
        raise FucinaError(f"--eval-every must be at least 1, got {args.eval_every}")
    for k in ("eval_every", "eval_reward", "keep"):
        if getattr(args, k, None) and not args.valid:
            raise FucinaError(f"--{k.replace('_', '-')} needs --valid (the held-out examples)")
    _threads(args.threads, opt["workers"])
    path = resolve_model(args.model)
    model = load_model(path)
    resume_gc()
    meta = model.gguf.metadata
    tok = Tokenizer.from_metadata(meta)
    tpl = ChatTemplate.from_metadata(meta, tok)
    examples = read_es_jsonl(args.data, tok, tpl)
    held_out = read_es_jsonl(args.valid, tok, tpl) if args.valid else None
    cfg = ESConfig(population=opt["population"], sigma=opt["sigma"],
                   lr=args.lr if args.lr is not None else ES_LR, seed=args.seed, mode=opt["mode"],
                   rank=args.rank, alpha=args.alpha, targets=args.targets,
                   batch=args.batch if args.batch is not None else ES_BATCH, norm=opt["norm"],
                   anchor=opt["anchor"], anchor_lambda=opt["anchor_lambda"], max_tokens=opt["max_tokens"],
                   schedule=opt["schedule"], horizon=opt["iterations"] if opt["schedule"] == "cosine" else 0,
                   final_scale=opt["final_scale"], step_every=opt["step_every"], step_gamma=opt["step_gamma"],
                   decay_sigma=bool(opt["decay_sigma"]), flip_rate=opt["flip_rate"],
                   update_fraction=opt["update_fraction"])

    def log(msg: str) -> None:
        print(f"fucina: {msg}", file=sys.stderr)

    trainer = ESTrainer(model, tok, tpl, cfg, examples, opt["reward"], args.out, workers=opt["workers"],
                        model_path=str(path), threads=args.threads, log=log, progress=not args.no_progress,
                        init=opt["init"], eval_examples=held_out, eval_every=eval_every if held_out else 0,
                        eval_reward=opt["eval_reward"], keep=opt["keep"])
    try:
        if args.resume:
            trainer.resume(args.resume)
            log(f"resumed at iteration {trainer.iteration}")
        step = (f"flip rate {cfg.flip_rate}, update fraction {cfg.update_fraction}" if cfg.mode == "ternary"
                else f"sigma {cfg.sigma}, lr {cfg.lr}")
        log(f"{len(examples)} examples; ES {cfg.mode} on {','.join(cfg.targets)} "
            f"({trainer.summary()['parameters']} parameters), population {cfg.population}, "
            f"{step} ({cfg.schedule}), reward {opt['reward']}, {opt['workers']} worker(s)"
            + (f"; {len(held_out)} held-out examples scored every {eval_every}" if held_out else ""))
        summary = trainer.fit(opt["iterations"], checkpoint_every=args.save_every)
    finally:
        trainer.close()
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump(dict(summary, history=trainer.history), fh, indent=1)
    best = (f"; kept the best held-out theta (iteration {summary['best_iteration']}, "
            f"{summary['best_eval']:.4f})" if summary["kept"] == "best" else "")
    log(f"done: {summary['iterations']} iterations, mean reward {summary['first_mean']:.4f} -> "
        f"{summary['final_mean']:.4f}, {summary['s_per_iteration']:.2f} s per iteration; "
        f"wrote {summary['out']}{best}")
    return 0
