"""`fucina finetune` (LoRA SFT on the quantized GGUF itself) and `fucina export` (merge
adapters back into a GGUF); `--lora` for the inference commands.

    fucina finetune [MODEL] --data train.jsonl --out DIR [--steps N | --epochs E] ...
    torchrun --nproc-per-node 2 -m fucina finetune ...     # data-parallel (gloo)
    fucina export [MODEL] --lora DIR/adapter.gguf --out merged.gguf [--type keep]
"""
from __future__ import annotations

import json
import os
import sys

from fucina.errors import FucinaError

#: fucina.train.forward's CHECKPOINT_MODES and DEFAULT_CHECKPOINT (spelled here: building
#: the parser imports no torch)
GRAD_CHECKPOINT, GRAD_CHECKPOINT_DEFAULT = ("auto", "full", "keep-matmul", "off"), "auto"

MODEL_HELP = "base GGUF file or packaged name (default: SmolLM2-135M-Instruct Q4_1)"


def add_lora_args(p) -> None:
    """--lora/--lora-scale for run, chat and serve."""
    p.add_argument("--lora", action="append", default=None, metavar="ADAPTER.gguf",
                   help="LoRA adapter in llama.cpp's format, applied unmerged in f32 over the "
                        "frozen weights (FUCINA_LORA_MERGE=Q8_0|F16|F32 merges; repeatable)")
    p.add_argument("--lora-scale", action="append", type=float, default=None, metavar="S",
                   help="strength of each --lora (one value applies to all; default 1.0)")


def apply_lora_args(model, args) -> None:
    if getattr(args, "lora", None):
        from fucina.weights.lora import load_adapters
        load_adapters(model, args.lora, args.lora_scale)


def add_parser(sub) -> None:
    s = sub.add_parser("finetune", help="LoRA fine-tune on the quantized GGUF, by gradients or --method es (writes DIR/adapter.gguf)",
                       description="Train LoRA adapters over the frozen, still-quantized model. Data: "
                       "JSONL lines with 'messages' (chat template; loss on assistant turns), "
                       "'prompt'/'completion', or 'text'. Ctrl-C writes a checkpoint; --resume DIR "
                       "continues it bit-exactly.")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--data", required=True, help="training JSONL")
    s.add_argument("--method", choices=("sft", "es"), default="sft",
                   help="sft: gradients on the supervised tokens (default); es: evolution strategies "
                        "on a reward, forward passes only (see the ES options below)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--valid", help="validation JSONL (--method es: held-out examples for keep-best)")
    g.add_argument("--valid-split", type=float, default=None, metavar="F",
                   help="hold out this fraction of --data for validation")
    s.add_argument("--out", required=True, help="output directory (adapter.gguf, checkpoint.pt, "
                                                 "summary.json)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="optimizer steps")
    g.add_argument("--epochs", type=float, help="passes over the data (default 1)")
    s.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    s.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha; scale = alpha/rank (default 16)")
    s.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (default 0)")
    s.add_argument("--targets", default="q,v", help="projections: q,k,v,o,gate,up,down or all (default q,v)")
    s.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-4; ES: step "
                                                         "size, default 0.002)")
    s.add_argument("--optimizer", choices=("adamw", "sgd", "muon"), default="adamw")
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--warmup", type=int, default=None, help="warmup steps (default 5%% of the run)")
    s.add_argument("--clip", type=float, default=1.0, help="max gradient norm; 0 = off (default 1)")
    s.add_argument("--batch", type=int, default=None, help="examples per micro-batch (default 4; ES: "
                                                          "examples scored per member, default 8, 0 = all)")
    s.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    s.add_argument("--ctx", type=int, default=512, help="max tokens per row; longer examples are "
                                                        "an error (default 512)")
    s.add_argument("--no-pack", action="store_true", help="one example per row (default: pack a "
                                                          "micro-batch's examples into rows)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--save-every", type=int, default=0, metavar="N", help="checkpoint every N steps")
    s.add_argument("--eval-every", type=int, default=0, metavar="M",
                   help="validation loss every M steps (ES with --valid: held-out score every M iterations, "
                        "default 10)")
    s.add_argument("--grad-checkpoint", choices=GRAD_CHECKPOINT, default=GRAD_CHECKPOINT_DEFAULT,
                   help="what the backward recomputes: full (every layer: least memory), "
                        "keep-matmul (all but the frozen quantized matmuls, whose outputs are kept), "
                        "off (nothing: every activation kept, fastest), auto (off while a row's "
                        "estimated activations fit FUCINA_TRAIN_ACT_BUDGET_MB, default 1024, else "
                        f"keep-matmul) (default {GRAD_CHECKPOINT_DEFAULT})")
    s.add_argument("--no-grad-checkpoint", action="store_true", help="the same as --grad-checkpoint off")
    s.add_argument("--resume", metavar="DIR", help="continue from DIR/checkpoint.pt (same flags)")
    s.add_argument("--threads", "-t", type=int)
    s.add_argument("--no-progress", action="store_true")
    from fucina.cli.finetune_es import add_es_args
    add_es_args(s)
    s.set_defaults(func=cmd_finetune)

    s = sub.add_parser("export", help="merge LoRA adapters into a standalone GGUF")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--lora", action="append", required=True, metavar="ADAPTER.gguf", help="repeatable")
    s.add_argument("--lora-scale", action="append", type=float, default=None, metavar="S")
    s.add_argument("--out", required=True, help="merged GGUF to write")
    s.add_argument("--type", default="keep", choices=("keep", "F16", "Q8_0", "Q4_K_M"),
                   help="keep (default): untouched tensors keep their bytes, merged ones take "
                        "--merged-type; or re-encode every matrix to F16/Q8_0/Q4_K_M")
    s.add_argument("--merged-type", default="F16", choices=("F16", "Q8_0", "base"),
                   help="with --type keep: the type of the merged tensors (default F16; 'base' "
                        "re-encodes to the base's own type, which on 4-bit bases rounds most of "
                        "the adapter away)")
    s.add_argument("--threads", "-t", type=int)
    s.set_defaults(func=cmd_export)


def _threads(n: int | None, world: int = 1) -> None:
    import fucina.kernels as kernels
    kernels.set_threads(n or max(1, (os.cpu_count() or 1) // world))


def cmd_finetune(args) -> int:
    from fucina.cli.finetune_es import cmd_finetune_es, es_flags_given
    if args.method == "es":
        return cmd_finetune_es(args)
    if es_flags_given(args):
        raise FucinaError(f"{', '.join(es_flags_given(args))}: only with --method es")
    args.lr = 2e-4 if args.lr is None else args.lr
    args.batch = 4 if args.batch is None else args.batch
    from fucina.cli.common import resume_gc
    from fucina.models import load_model, resolve_model
    from fucina.text.chat_template import ChatTemplate
    from fucina.text.tokenizer import Tokenizer
    from fucina.train.data import read_jsonl, split_validation
    from fucina.train.lora import LoRAConfig
    from fucina.train.trainer import TrainConfig, Trainer, finish_distributed, init_distributed

    rank, world = init_distributed()
    _threads(args.threads, world)
    model = load_model(resolve_model(args.model))
    resume_gc()
    meta = model.gguf.metadata
    tok = Tokenizer.from_metadata(meta)
    tpl = ChatTemplate.from_metadata(meta, tok)
    if args.ctx < 2 or args.ctx > model.config.n_ctx_train:
        raise FucinaError(f"--ctx must be in [2, {model.config.n_ctx_train}], got {args.ctx}")
    train = read_jsonl(args.data, tok, tpl, args.ctx)
    valid = read_jsonl(args.valid, tok, tpl, args.ctx) if args.valid else None
    if args.valid_split:
        train, valid = split_validation(train, args.valid_split, args.seed)
    lora = LoRAConfig(rank=args.rank, alpha=args.alpha, dropout=args.dropout, targets=args.targets)
    cfg = TrainConfig(steps=args.steps, epochs=args.epochs if args.steps is None else None,
                      lr=args.lr, optimizer=args.optimizer, weight_decay=args.weight_decay,
                      warmup=args.warmup, clip=args.clip, batch=args.batch, grad_accum=args.grad_accum,
                      ctx=args.ctx, seed=args.seed, pack=not args.no_pack,
                      checkpoint_every=args.save_every, valid_every=args.eval_every,
                      grad_checkpoint="off" if args.no_grad_checkpoint else args.grad_checkpoint, world_size=world, rank=rank)
    if cfg.steps is None and cfg.epochs is None:
        cfg.epochs = 1.0

    def log(msg: str) -> None:
        if rank == 0:
            print(f"fucina: {msg}", file=sys.stderr)

    trainer = Trainer(model, lora, cfg, train, valid, args.out, progress=not args.no_progress, log=log)
    if args.resume:
        trainer.resume(args.resume)
        log(f"resumed at step {trainer.step}")
    log(f"{len(train)} training examples, {len(valid or [])} validation; {cfg.steps} steps of "
        f"{trainer.per_step} examples; LoRA r={lora.rank} alpha={lora.alpha} on "
        f"{','.join(lora.targets)} ({sum(p.numel() for p in trainer.lm.params())} parameters)")
    summary = trainer.fit()
    trainer.close()
    if rank == 0:
        with open(os.path.join(args.out, "summary.json"), "w") as fh:
            json.dump(dict(summary, history=trainer.history), fh, indent=1)
        v = summary["valid_loss"]
        log(f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> "
            f"{summary['final_loss']:.4f}" + (f", validation {v:.4f}" if v is not None else "") +
            f"; {summary['tok_s']:.0f} tok/s, peak RSS {summary['peak_rss_mb']:.0f} MB; "
            f"wrote {summary['adapter']}")
    finish_distributed()
    if world > 1:
        # a torchrun rank leaves without the interpreter's teardown: there gloo's threads have
        # aborted the rank (SIGABRT, "terminate called without an active exception") after
        # its work was done and written, twice in a row once in the two-rank CLI test
        # (tests/test_scaling.py). Everything this command writes is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_export(args) -> int:
    from fucina.cli.common import resume_gc
    from fucina.models import load_model, resolve_model
    from fucina.train.adapters import read_adapter
    from fucina.train.export import export_merged
    from fucina.weights.lora import with_scales

    _threads(args.threads)
    path = resolve_model(args.model)
    model = load_model(path)
    resume_gc()
    adapters = [(read_adapter(p), s) for p, s in with_scales(args.lora, args.lora_scale)]
    stats = export_merged(path, model, adapters, args.out, args.type, args.merged_type)
    print(f"fucina: wrote {args.out} ({stats['merged']} merged, {stats['requantized']} re-encoded, "
          f"{stats['copied']} copied tensors)", file=sys.stderr)
    return 0
