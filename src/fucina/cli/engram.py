"""`fucina engram`: Engram n-gram memory grafts (docs/ENGRAM.md); `--engram` for the
inference commands.

    fucina engram equiv [MODEL] [--layers 1,15]         # zero-init graft == bare, bitwise (exit 0 iff)
    fucina engram train [MODEL] --corpus FILE --out E.safetensors [--steps N] [--seed S]
                        [--capacity ROWS] [--layers ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from fucina.errors import FucinaError

MODEL_HELP = "GGUF file or packaged name (default: SmolLM2-135M-Instruct Q4_1)"


class _MmapAction(argparse.Action):
    """--engram-mmap: every graft this process loads keeps its tables mapped from the file."""

    def __call__(self, parser, namespace, values, option_string=None):
        from fucina.models.engram import graft
        graft.MMAP_DEFAULT = True
        setattr(namespace, self.dest, True)


def add_engram_args(p) -> None:
    p.add_argument("--engram", metavar="E.safetensors", default=None,
                   help="graft this Engram n-gram memory (made by `fucina engram train` for this model)")
    p.add_argument("--engram-mmap", action=_MmapAction, nargs=0, default=False,
                   help="read the graft's tables through a map of its file (tables larger than RAM; each step's "
                        "rows are read ahead), not copied into RAM; automatic above 1 GiB a table")


def apply_engram_args(model, args) -> None:
    if getattr(args, "engram", None):
        from fucina.models.engram import attach_file
        attach_file(model, args.engram)


def _layers(spec: str | None, n_layer: int) -> list[int]:
    if not spec:
        return sorted({min(1, n_layer - 1), n_layer // 2})
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise FucinaError(f"--layers takes comma-separated layer indices, got {spec!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("engram", help="Engram n-gram memory grafts: equiv, train",
                       description="Engram (arXiv 2601.07372): hashed n-gram embedding tables gated into "
                       "the residual stream of a frozen model.")
    esub = p.add_subparsers(dest="engram_cmd", metavar="{equiv,train}")
    s = esub.add_parser("equiv", help="check that a zero-initialised graft leaves the logits bitwise unchanged "
                        "(native step and torch blocks; exit 0 iff)")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--layers", help="memory layers, comma-separated (default: 1 and n_layer/2)")
    s.add_argument("--threads", "-t", type=int)
    s.set_defaults(func=cmd_equiv)
    s = esub.add_parser("train", help="train a graft (only its parameters) on a text file")
    s.add_argument("model", nargs="?", help=MODEL_HELP)
    s.add_argument("--corpus", required=True, help="UTF-8 text file to learn")
    s.add_argument("--out", required=True, help="output .safetensors")
    s.add_argument("--steps", type=int, default=200, help="Adam steps (default 200)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--capacity", type=int, default=20011,
                   help="rows per table head (primes from there; 1 = the one-row control) (default 20011)")
    s.add_argument("--layers", help="memory layers, comma-separated (default: 1 and n_layer/2)")
    s.add_argument("--heads", type=int, default=4, help="hash heads per n-gram order (default 4)")
    s.add_argument("--head-dim", type=int, default=32, help="row width of a head (default 32)")
    s.add_argument("--max-ngram", type=int, default=3, help="longest n-gram (default 3)")
    s.add_argument("--lr", type=float, default=3e-3, help="peak Adam learning rate (default 3e-3)")
    s.add_argument("--ctx", type=int, default=256, help="tokens per training window (default 256)")
    s.add_argument("--no-compress", action="store_true", help="hash raw token ids (no normalised-text table)")
    s.add_argument("--threads", "-t", type=int)
    s.set_defaults(func=cmd_train)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _logits(model, ids, native: bool):
    """Prefill then four single-token steps: every logit row, as one tensor."""
    import torch

    model.use_native_step = native
    try:
        cache = model.init_cache(len(ids) + 8)
        rows = [model.forward_step_all_logits(cache, ids[:-4], 0)]
        for i in range(len(ids) - 4, len(ids)):
            rows.append(model.forward_step_all_logits(cache, [ids[i]], i))
        return torch.cat(rows)
    finally:
        model.use_native_step = True


def cmd_equiv(args) -> int:
    import torch

    from fucina.cli.main import _load, _tokenizer
    from fucina.models.engram import Engram

    model = _load(args)
    tok = _tokenizer(model)
    ids = tok.encode("Engram equivalence: a zero-initialised graft must leave every logit of this prompt "
                     "unchanged, bit for bit, on the native step and on the torch blocks.")
    layers = _layers(args.layers, model.config.n_layer)
    bare = {n: _logits(model, ids, n) for n in (True, False)}
    eng = Engram.for_model(model, layers).attach(model)
    try:
        ok = True
        for native in (True, False):
            got = _logits(model, ids, native)
            same = torch.equal(got, bare[native])
            ok &= same
            diff = float((got - bare[native]).abs().max())
            print(f"{'native step' if native else 'torch blocks'}: {got.shape[0]} rows x {got.shape[1]} logits, "
                  f"layers {layers}: {'bitwise equal' if same else f'DIFFER (max |diff| {diff:.3g})'}")
    finally:
        eng.detach()
    return 0 if ok else 1


def cmd_train(args) -> int:
    from fucina.cli.main import _load, _tokenizer
    from fucina.models.engram import Engram
    from fucina.train.engram import compress_table, train, trainable_parameters

    try:
        with open(args.corpus, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise FucinaError(f"cannot read the corpus {args.corpus}: {e}") from None
    if args.capacity < 1:
        raise FucinaError(f"--capacity must be >= 1, got {args.capacity}")
    model = _load(args)
    tok = _tokenizer(model)
    ids = tok.encode(text)
    lookup = None if args.no_compress else compress_table(tok)
    layers = _layers(args.layers, model.config.n_layer)
    eng = Engram.for_model(model, layers, capacity=args.capacity, n_head=args.heads, head_dim=args.head_dim,
                           max_ngram=args.max_ngram, seed=args.seed, lookup=lookup,
                           pad_id=tok.bos_id if tok.bos_id is not None else 0)
    print(f"engram: layers {layers}, {trainable_parameters(eng):,} parameters "
          f"(tables {eng.plan.table_rows} rows x {args.head_dim}), corpus {len(ids)} tokens", file=sys.stderr)
    t = time.perf_counter()
    losses = train(model, eng, ids, steps=args.steps, lr=args.lr, ctx=args.ctx, seed=args.seed,
                   log=lambda s: print(s, file=sys.stderr))
    eng.save(args.out, extra=dict(train=dict(steps=args.steps, seed=args.seed, lr=args.lr, ctx=args.ctx,
                                             corpus_tokens=len(ids), final_loss=losses[-1],
                                             seconds=round(time.perf_counter() - t, 1))))
    print(json.dumps(dict(out=args.out, steps=args.steps, first_loss=round(losses[0], 4),
                          final_loss=round(losses[-1], 4), seconds=round(time.perf_counter() - t, 1))))
    return 0
