"""`fucina chat [MODEL] MESSAGE [--system S] [--no-think] [--gen N] [--repl] [--ids-out F]`.

With one positional argument it is the message and the chat default answers:
Qwen2.5-Coder-0.5B-Instruct (`CHAT_DEFAULT`; 11/12 on benchmarks/chat_default.py's
questions where SmolLM2-135M, every other command's default, gets 7/12). With
--repl the conversation continues turn by turn (see fucina.cli.repl). Also home of
the sampling flags other commands share (`add_sampling_args`).

Sampling: the model's own recommendation (`general.sampling.*`) or llama.cpp's
defaults, a fresh seed per run; `--greedy` (or `--temp 0`) is argmax. A model without
a chat template (a base model) is warned about and continues the text as a raw
completion instead of being driven through a format it never saw.
"""
from __future__ import annotations

import os
import sys

from fucina.errors import FucinaError

MODEL_HELP = "GGUF file or packaged name (smollm2, gemma3, qwen2.5-coder; default: SmolLM2-135M-Instruct Q4_1)"
#: the packaged model `fucina chat` talks to when no MODEL is given (README: "Which chat model")
CHAT_DEFAULT = "qwen2.5-coder"


def add_sampling_args(p) -> None:
    g = p.add_argument_group("sampling (llama.cpp names; chat/serve default: the model's "
                             "recommendation, else temp 0.8, top-k 40, top-p 0.95, min-p 0.05; run: greedy)")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temp 0)")
    g.add_argument("--temp", type=float, default=None, help="temperature; 0 is greedy")
    g.add_argument("--top-k", type=int, default=None, help="0 = off")
    g.add_argument("--top-p", type=float, default=None, help="in [0, 1]; 1 = off")
    g.add_argument("--min-p", type=float, default=None, help="in [0, 1]; 0 = off")
    g.add_argument("--repeat-penalty", type=float, default=None, help="1 = off")
    g.add_argument("--repeat-last-n", type=int, default=None, help="penalty window (-1: all)")
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="default: a fresh seed per run")
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


def sampling_from_args(args, base=None):
    """The flags over `base` (the model's defaults); no --seed means a fresh one."""
    from fucina.text.defaults import fresh_seed
    from fucina.text.sampler import SamplingConfig

    temp = 0.0 if getattr(args, "greedy", False) else args.temp
    return SamplingConfig.from_kwargs(
        base, temperature=temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        seed=fresh_seed() if args.seed is None else args.seed)


def add_parser(sub) -> None:
    from fucina.cli.common import count, positive

    s = sub.add_parser("chat", help="chat with a model (one message, or --repl)")
    s.add_argument("args", nargs="*", metavar="[MODEL] MESSAGE",
                   help=f"GGUF file or packaged name (default: {CHAT_DEFAULT}, Qwen2.5-Coder-0.5B-Instruct "
                        f"Q4_K_M; also smollm2, gemma3); the user message")
    s.add_argument("--system", "-s", help="system prompt")
    s.add_argument("--no-think", action="store_true", help="turn reasoning off (enable_thinking=false)")
    s.add_argument("--gen", "-n", type=count, default=512, help="max tokens per reply (default 512)")
    s.add_argument("--repl", action="store_true",
                   help="multi-turn with line editing and history; /help lists the commands, "
                        "Ctrl-C stops a reply, Ctrl-D quits")
    s.add_argument("--ids-out", help="write the generated ids here, one per line (every reply's, in order)")
    s.add_argument("--ctx", "-c", type=positive, default=None, help="context size (default min(train, 4096))")
    s.add_argument("--cache-type", choices=("f16", "q8_0"), default="f16")
    s.add_argument("--fleet", metavar="DIR",
                   help="a cartridge fleet (fucina cartridge fleet): the conversation runs behind the "
                        "cartridges its first message is closest to")
    s.add_argument("--fleet-top-k", type=positive, default=1, metavar="K",
                   help="cartridges --fleet composes (default 1)")
    s.add_argument("--threads", "-t", type=positive)
    add_sampling_args(s)
    from fucina.cli.grammar_args import add_grammar_args
    add_grammar_args(s)
    add_spec_args(s)
    from fucina.cli.diffusion_args import add_diffusion_args
    add_diffusion_args(s)
    s.set_defaults(func=cmd_chat)


def _split_positionals(args) -> tuple[str | None, str | None]:
    from fucina.models.hub import PACKAGED

    pos = list(args.args)
    if len(pos) > 2:
        raise FucinaError("chat takes at most MODEL and MESSAGE (quote the message)")
    if len(pos) == 2:
        return pos[0], pos[1]
    if len(pos) == 1:
        if args.repl and (os.path.exists(pos[0]) or pos[0].endswith(".gguf") or pos[0] in PACKAGED):
            return pos[0], None
        return None, pos[0]
    if not args.repl:
        raise FucinaError("give a MESSAGE (or --repl)")
    return None, None


def load_llm(model_arg, *, threads=None, n_ctx=None, cache_type="f16", lora=None, lora_scale=None, moe_ram=None,
             moe_policy="heat", engram=None, mtp=None, cartridge=None, **stages):
    import fucina.kernels as kernels
    from fucina.text.api import load

    if stages.get("pipeline") and not threads:
        threads = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    n = threads or os.cpu_count() or 1
    if hasattr(kernels, "set_threads"):
        kernels.set_threads(n)
    else:
        import torch
        torch.set_num_threads(n)
    llm = load(model_arg, n_ctx=n_ctx, cache_type=cache_type, lora=lora, lora_scale=lora_scale, moe_ram=moe_ram,
               moe_policy=moe_policy, engram=engram, mtp=mtp, cartridge=cartridge, **stages)
    llm.model                     # chat computes at once: build the decoder inside the start-up GC pause
    from fucina.cli.common import resume_gc
    resume_gc()
    return llm


class HarmonyView:
    """gpt-oss's reply as `fucina chat` shows it: the analysis channel as a think block
    (the way a Qwen-style model's reasoning prints), then the answer; a tool call as
    `[call NAME ARGS]`. The conversation keeps the raw reply."""

    def __init__(self, emit):
        from fucina.text.harmony import HarmonyStream

        self.emit, self.stream, self.mode = emit, HarmonyStream(), "start"

    def feed(self, piece: str) -> None:
        self._show(self.stream.feed(piece))

    def finish(self) -> None:
        self._show(self.stream.finish())
        if self.mode == "think":
            self.emit("\n</think>\n")

    def _show(self, events) -> None:
        for kind, value in events:
            if kind == "reasoning":
                if self.mode != "think":
                    self.emit("<think>\n")
                self.mode = "think"
                self.emit(value)
                continue
            if self.mode == "think":
                self.emit("\n</think>\n\n")
            self.mode = "answer"
            if kind == "content":
                self.emit(value)
            elif kind == "call":
                self.emit(f"[call {value} ")
            elif kind == "args":
                self.emit(value)
            elif kind == "end_call":
                self.emit("]")


class ChatSession:
    """What one `fucina chat` talks to: a Conversation over the model's chat template,
    or, for a model without one, raw completions of each message."""

    def __init__(self, llm, args):
        from fucina.cli.grammar_args import reply_constraint
        from fucina.text.conversation import Conversation

        self.llm, self.args = llm, args
        self.sampling = sampling_from_args(args, llm.sampling)
        self.raw = not llm.has_chat_template
        from fucina.text.harmony import is_harmony
        self.harmony = not self.raw and is_harmony(llm.template)
        self.ids: list[int] = []           # every reply's ids, for --ids-out
        self.conv = Conversation(llm.model, llm.tokenizer, llm.template, system=args.system,
                                 max_tokens=args.gen, think=not args.no_think, sampling=self.sampling,
                                 stop=args.stop or (), capacity=llm.n_ctx, cache_type=args.cache_type,
                                 processor=None if self.raw else reply_constraint(llm, args, think=not args.no_think),
                                 cartridge=llm.prefix.cart if llm.prefix is not None else None,
                                 retrieve=llm.fleet.retrieve if llm.fleet is not None else None,
                                 **spec_options(args))

    @property
    def name(self) -> str:
        return self.llm._name()

    def reply(self, text: str, out) -> None:
        """One turn, streamed to `out`. Ctrl-C (KeyboardInterrupt) propagates after the
        partial reply is kept and the cache is consistent with the conversation."""
        emit = lambda p: (out.write(p), out.flush())          # noqa: E731
        try:
            if self.raw:
                opts = {k: getattr(self.sampling, k) for k in ("temperature", "top_k", "top_p", "min_p",
                                                              "repeat_penalty", "repeat_last_n",
                                                              "frequency_penalty", "presence_penalty", "seed")}
                from fucina.cli.grammar_args import grammar_options

                for piece in self.llm.stream(text, self.args.gen, stop=self.args.stop or [], **opts,
                                             **grammar_options(self.args)):
                    emit(piece)
            else:
                view = HarmonyView(emit) if self.harmony else None
                self.conv.send(text, on_piece=view.feed if view else emit)
                if view:
                    view.finish()
        except KeyboardInterrupt:
            msgs = self.conv.messages
            if not self.raw and not (len(msgs) >= 2 and msgs[-2] == {"role": "user", "content": text}):
                msgs += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
                self.conv._committed_text = None          # stopped during the prefill
            raise
        finally:
            last = self.llm.last if self.raw else self.conv.last
            if last is not None:
                self.ids += last.tokens
            self._settle()
            self.write_ids()
            out.write("\n")
            out.flush()
            print_spec_stats(self.args, None if self.raw else self.conv.spec)

    def _settle(self) -> None:
        c = self.conv
        n = c.cache.truncate_point(min(c.cache.len, len(c.tokens)))   # an interrupt between forward and commit
        c.cache.truncate(n)
        del c.tokens[n:]

    def write_ids(self) -> None:
        if self.args.ids_out:
            with open(self.args.ids_out, "w") as fh:
                fh.writelines(f"{t}\n" for t in self.ids)


def cmd_chat(args) -> int:
    from fucina.cli.moe_args import moe_budget
    from fucina.cli.mtp import mtp_value
    from fucina.cli.pipeline_args import pipeline_kwargs

    model_arg, message = _split_positionals(args)
    llm = load_llm(model_arg or CHAT_DEFAULT, threads=args.threads, n_ctx=args.ctx, cache_type=args.cache_type,
                   lora=getattr(args, "lora", None), lora_scale=getattr(args, "lora_scale", None),
                   moe_ram=moe_budget(args), moe_policy=getattr(args, "moe_policy", "heat"),
                   engram=getattr(args, "engram", None), mtp=mtp_value(args),
                   cartridge=getattr(args, "cartridge", None) or None, **pipeline_kwargs(args),
                   **({"fleet": args.fleet, "fleet_top_k": args.fleet_top_k} if args.fleet else {}))
    from fucina.cli.diffusion_args import DiffusionChat, check_flags
    diffusion = check_flags(llm.model, args)      # a dream/llada model denoises each reply
    session = DiffusionChat(llm, args) if diffusion else ChatSession(llm, args)
    if session.raw and not diffusion:
        print(f"fucina: warning: {session.name} has no chat template (a base model, not a chat "
              f"model): each message is continued as a raw completion. Use a chat model "
              f"(e.g. the default, {CHAT_DEFAULT}) to chat.", file=sys.stderr)
    if message is not None:
        try:
            session.reply(message, sys.stdout)
        except KeyboardInterrupt:
            if not args.repl:
                return 130
    if not args.repl:
        return 0
    from fucina.cli.repl import repl

    return repl(session)
