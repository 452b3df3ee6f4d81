"""`fucina chat [MODEL] MESSAGE [--system S] [--no-think] [--gen N] [--repl]`.

With one positional argument it is the message and the default model answers. With
--repl the conversation continues turn by turn until end of input (Ctrl-D). Also
home of the sampling flags other commands share (`add_sampling_args`).
"""
from __future__ import annotations

import os
import sys

from fucina.errors import FucinaError

MODEL_HELP = "GGUF file or packaged name (default: SmolLM2-135M-Instruct Q4_1)"


def add_sampling_args(p) -> None:
    g = p.add_argument_group("sampling (llama.cpp names; default greedy)")
    g.add_argument("--temp", type=float, default=None, help="temperature; <= 0 is greedy (default 0)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repeat-penalty", type=float, default=None)
    g.add_argument("--repeat-last-n", type=int, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def add_spec_args(p) -> None:
    g = p.add_argument_group("speculative decoding (lossless: drafts are verified, never trusted)")
    g.add_argument("--spec", action="store_true",
                   help="draft from text already seen (prompt, reply, --spec-ref) and verify "
                        "several tokens per pass; the cost gate turns it off where it does not pay")
    g.add_argument("--spec-ref", action="append", default=None, metavar="FILE",
                   help="a reference document the reply may copy from (repeatable; implies --spec)")
    g.add_argument("--spec-max", type=int, default=16, metavar="N", help="max draft tokens per pass (16)")
    g.add_argument("--verbose", "-v", action="store_true", help="print speculation stats to stderr")


def spec_options(args) -> dict:
    """speculative/references/spec_max keywords for LLM and Conversation."""
    refs = []
    for path in args.spec_ref or ():
        try:
            with open(path, encoding="utf-8", errors="surrogateescape") as fh:
                refs.append(fh.read())
        except OSError as e:
            raise FucinaError(f"cannot read --spec-ref {path}: {e.strerror}") from e
    if args.spec_max < 0:
        raise FucinaError(f"--spec-max must be >= 0, got {args.spec_max}")
    return dict(speculative=bool(args.spec or refs), references=refs, spec_max=args.spec_max)


def print_spec_stats(args, spec) -> None:
    if args.verbose and spec is not None:
        print(spec.summary(), file=sys.stderr)


def sampling_from_args(args):
    from fucina.text.sampler import SamplingConfig

    return SamplingConfig.from_kwargs(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        seed=args.seed)


def add_parser(sub) -> None:
    s = sub.add_parser("chat", help="chat with a model (one message, or --repl)")
    s.add_argument("args", nargs="*", metavar="[MODEL] MESSAGE", help=f"{MODEL_HELP}; the user message")
    s.add_argument("--system", "-s", help="system prompt")
    s.add_argument("--no-think", action="store_true", help="turn reasoning off (enable_thinking=false)")
    s.add_argument("--gen", "-n", type=int, default=512, help="max tokens per reply (default 512)")
    s.add_argument("--repl", action="store_true", help="multi-turn; Ctrl-D quits")
    s.add_argument("--ctx", "-c", type=int, default=None, help="context size (default min(train, 4096))")
    s.add_argument("--cache-type", choices=("f16", "q8_0"), default="f16")
    s.add_argument("--threads", "-t", type=int)
    s.add_argument("--ids-out", help="write each reply's generated ids here, one per line")
    add_sampling_args(s)
    from fucina.cli.grammar_args import add_grammar_args
    add_grammar_args(s)
    add_spec_args(s)
    s.set_defaults(func=cmd_chat)


def _split_positionals(args) -> tuple[str | None, str | None]:
    pos = list(args.args)
    if len(pos) > 2:
        raise FucinaError("chat takes at most MODEL and MESSAGE (quote the message)")
    if len(pos) == 2:
        return pos[0], pos[1]
    if len(pos) == 1:
        if args.repl and (os.path.exists(pos[0]) or pos[0].endswith(".gguf")):
            return pos[0], None
        return None, pos[0]
    if not args.repl:
        raise FucinaError("give a MESSAGE (or --repl)")
    return None, None


def load_llm(model_arg, *, threads=None, n_ctx=None, cache_type="f16", lora=None, lora_scale=None):
    import fucina.kernels as kernels
    from fucina.text.api import load

    n = threads or os.cpu_count() or 1
    if hasattr(kernels, "set_threads"):
        kernels.set_threads(n)
    else:
        import torch
        torch.set_num_threads(n)
    return load(model_arg, n_ctx=n_ctx, cache_type=cache_type, lora=lora, lora_scale=lora_scale)


def cmd_chat(args) -> int:
    model_arg, message = _split_positionals(args)
    llm = load_llm(model_arg, threads=args.threads, n_ctx=args.ctx, cache_type=args.cache_type,
                   lora=getattr(args, "lora", None), lora_scale=getattr(args, "lora_scale", None))
    from fucina.cli.grammar_args import reply_constraint
    from fucina.text.conversation import Conversation

    conv = Conversation(llm.model, llm.tokenizer, llm.template, system=args.system, max_tokens=args.gen,
                        think=not args.no_think, sampling=sampling_from_args(args),
                        stop=args.stop or (), capacity=llm.n_ctx, cache_type=args.cache_type,
                        processor=reply_constraint(llm, args, think=not args.no_think),
                        **spec_options(args))
    try:
        ids_out = open(args.ids_out, "w") if args.ids_out else None
    except OSError as e:
        raise FucinaError(f"cannot write --ids-out {args.ids_out}: {e.strerror}") from e

    def turn(text: str) -> None:
        conv.send(text, on_piece=lambda p: (sys.stdout.write(p), sys.stdout.flush()))
        sys.stdout.write("\n")
        sys.stdout.flush()
        if ids_out is not None:
            ids_out.writelines(f"{t}\n" for t in conv.last.tokens)
            ids_out.flush()
        print_spec_stats(args, conv.spec)

    if message is not None:
        turn(message)
    if not args.repl:
        return 0
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                sys.stdout.write("\n")
            return 0
        if line.strip():
            try:
                turn(line)
            except FucinaError as e:          # e.g. ContextFull: say so, keep the session
                print(f"fucina: error: {e}", file=sys.stderr)
