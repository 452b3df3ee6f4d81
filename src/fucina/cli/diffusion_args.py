"""`fucina run|chat` on a text-diffusion model (dream, llada): llama-diffusion-cli's flag
names, `--canvas N` for its `-ub N` (the canvas, prompt included), and a live view of the
canvas settling when stdout is a terminal (masked positions shown as `_`)."""
from __future__ import annotations

import shutil
import sys

from fucina.errors import FucinaError

FLAGS = {"diffusion_steps": "steps", "diffusion_eps": "eps", "diffusion_block_length": "block_length",
         "diffusion_algorithm": "algorithm", "canvas": "canvas", "diffusion_add_gumbel_noise": "add_gumbel_noise"}
# diffusion-gemma's entropy-bound sampler (with --diffusion-steps for its max steps and --seed)
EB_FLAGS = {"entropy_bound": "entropy_bound", "t_min": "t_min", "t_max": "t_max",
            "no_self_conditioning": "self_conditioning"}
# dream/llada's loop: what diffusion-gemma has no use for (its canvas is the file's)
CANVAS_ONLY = ("diffusion_eps", "diffusion_block_length", "diffusion_algorithm", "diffusion_add_gumbel_noise",
               "canvas", "temp", "top_k", "top_p")
# autoregressive-only flags a denoiser cannot honour
AR_ONLY = ("min_p", "repeat_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty", "stop", "spec",
           "spec_ref", "json_schema", "json_object", "regex", "lark", "grammar", "greedy", "tokens")


def add_diffusion_args(p) -> None:
    g = p.add_argument_group("text diffusion (dream, llada; llama-diffusion-cli's names; --temp/--top-k/--top-p/--seed "
                             "as there: temp 0.8, top-k 40, top-p 0.95; temp 0 samples at 1, top-k 1 is deterministic)")
    g.add_argument("--diffusion-steps", type=int, default=None, metavar="N", help="denoising steps (default 128)")
    g.add_argument("--diffusion-eps", type=float, default=None, metavar="F",
                   help="timestep schedule (Dream's); default 0.001 when no block length is given")
    g.add_argument("--diffusion-block-length", type=int, default=None, metavar="N",
                   help="block schedule (LLaDA's): blocks of N committed one after another")
    g.add_argument("--diffusion-algorithm", type=int, default=None, metavar="N",
                   help="0 origin, 1 entropy, 2 margin, 3 random, 4 confidence (default)")
    g.add_argument("--diffusion-add-gumbel-noise", action="store_true", default=None,
                   help="gumbel noise on the logits when temp > 0 (as llama.cpp: the first row only)")
    g.add_argument("--canvas", type=int, default=None, metavar="N",
                   help="the canvas length, prompt included (llama-diffusion-cli -ub); default: prompt + --gen")
    e = p.add_argument_group("block text diffusion (diffusion-gemma: the entropy-bound sampler; --diffusion-steps "
                             "is its max steps per canvas, defaults from the file, else 48)")
    e.add_argument("--entropy-bound", type=float, default=None, metavar="F",
                   help="accept positions while the lower-entropy ones sum to at most F nats (default 0.1)")
    e.add_argument("--t-max", type=float, default=None, metavar="F", help="temperature of the first step (0.8)")
    e.add_argument("--t-min", type=float, default=None, metavar="F", help="temperature approached at the last (0.4)")
    e.add_argument("--no-self-conditioning", action="store_true", default=None,
                   help="denoise without feeding each step's distribution to the next")


def given(args) -> dict:
    """The diffusion settings the command line gave, by DiffusionConfig name."""
    return {name: getattr(args, flag) for flag, name in FLAGS.items() if getattr(args, flag, None) is not None}


def _named(args, names) -> list[str]:
    return ["--" + f.replace("_", "-") for f in names if getattr(args, f, None) not in (None, False)]


def check_flags(model, args) -> bool:
    """True when `model` denoises; a diffusion flag on an autoregressive model, or an
    autoregressive-only flag on a diffusion model, or one family's diffusion flag on the
    other's, is an error."""
    from fucina.text.diffusion import is_diffusion

    arch = model.config.arch
    if not is_diffusion(model):
        flags = _named(args, list(FLAGS) + list(EB_FLAGS))
        if flags:
            raise FucinaError(f"{', '.join(flags)}: {arch} is not a diffusion model "
                              "(these apply to dream, llada and diffusion-gemma)")
        return False
    if getattr(model, "block_diffusion", False):
        flags = _named(args, CANVAS_ONLY)
        if flags:
            raise FucinaError(f"{', '.join(flags)}: {arch} denoises its own canvases with the entropy-bound sampler "
                              "(it takes --diffusion-steps, --entropy-bound, --t-max, --t-min, "
                              "--no-self-conditioning, --seed)")
    elif _named(args, EB_FLAGS):
        raise FucinaError(f"{', '.join(_named(args, EB_FLAGS))}: these apply to diffusion-gemma, not {arch}")
    bad = [f for f in AR_ONLY if getattr(args, f, None) not in (None, False, [], ())]
    if bad:
        raise FucinaError(f"{', '.join('--' + f.replace('_', '-') for f in bad)}: {model.config.arch} is a "
                          "diffusion model, which denoises a canvas (no next-token sampling, stops or grammars)")
    return True


def config(args, n_prompt: int):
    from fucina.text.defaults import fresh_seed
    from fucina.text.diffusion import DiffusionConfig, fit

    kw = dict(given(args), temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
              seed=args.seed if args.seed is not None else fresh_seed())
    return DiffusionConfig.from_kwargs(None, **fit(n_prompt, args.gen, kw))


class LiveView:
    """The reply part of the canvas redrawn in place before every step (masks as `_`),
    with a step counter; nothing when stdout is not a terminal."""

    def __init__(self, tokenizer, n_input: int, mask: int, out=None):
        self.tok, self.n, self.mask = tokenizer, n_input, mask
        self.out = out or sys.stdout
        self.on = self.out.isatty()
        self.lines = 0

    def __call__(self, step: int, steps: int, canvas) -> None:
        if not self.on:
            return
        text = "".join("_" if t == self.mask else self.tok.token_to_piece(int(t)).decode("utf-8", "replace")
                       for t in canvas[self.n:])
        self.show(f"[step {step}/{steps}]", text)

    def show(self, header: str, text: str) -> None:
        if not self.on:
            return
        width = max(shutil.get_terminal_size().columns, 20)
        body = f"{header}\n{text}"
        self.clear()
        self.out.write(body + "\n")
        self.out.flush()
        self.lines = sum(1 + len(line) // width for line in body.split("\n"))

    def clear(self) -> None:
        if self.on and self.lines:
            self.out.write(f"\x1b[{self.lines}F\x1b[J")
            self.lines = 0


def gemma_config(model, args):
    from fucina.text.defaults import fresh_seed
    from fucina.text.diffusion_gemma import GemmaDiffusionConfig

    return GemmaDiffusionConfig.for_model(
        model, steps=args.diffusion_steps, entropy_bound=args.entropy_bound, t_min=args.t_min, t_max=args.t_max,
        self_conditioning=False if args.no_self_conditioning else None,
        seed=args.seed if args.seed is not None else fresh_seed())


class BlockView(LiveView):
    """diffusion-gemma's live view: the committed reply, then the canvas being denoised
    (its argmax at each step)."""

    def __init__(self, tokenizer, out=None):
        super().__init__(tokenizer, 0, -1, out)
        self.committed, self.block = "", -1

    def step(self, info) -> None:
        if info.index == 0:
            self.block += 1
        canvas = "".join(self.tok.token_to_piece(int(t)).decode("utf-8", "replace") for t in info.argmax)
        self.show(f"[block {self.block} step {info.index + 1}/{info.total}]", self.committed + canvas)


def denoise_to(out, model, tok, ids: list[int], args) -> "object":
    """Denoise after `ids` with the command line's settings, the live view on a terminal,
    then the reply written to `out`; returns the generate.Reply."""
    from fucina.text.diffusion import reply

    if getattr(model, "block_diffusion", False):
        from fucina.text import diffusion_gemma

        view = BlockView(tok, out)
        n_ctx = getattr(args, "ctx", None) or min(model.config.n_ctx_train, 4096)

        def pieces():
            gen = diffusion_gemma.reply(model, tok, ids, args.gen, gemma_config(model, args), n_ctx,
                                        on_step=view.step)
            while True:
                try:
                    text = next(gen)
                except StopIteration as done:
                    return done.value
                view.committed += text
                yield text
        return _drain(out, pieces(), view)
    cfg = config(args, len(ids))
    view = LiveView(tok, len(ids), model.config.mask_token_id, out)
    gen = reply(model, tok, ids, cfg, on_step=view)
    return _drain(out, gen, view)


def _drain(out, gen, view) -> "object":
    text = []
    while True:
        try:
            text.append(next(gen))
        except StopIteration as done:
            result = done.value
            break
    view.clear()
    out.write("".join(text))
    out.flush()
    return result


def run(model, tok, args) -> int:
    """`fucina run` on a diffusion model: the prompt through the chat template when the
    model has one (as llama-diffusion-cli does), then the denoised reply."""
    from fucina.text.chat_template import ChatTemplate

    if args.prompt is None:
        raise FucinaError("give --prompt TEXT")
    meta = model.gguf.metadata
    if meta.get("tokenizer.chat_template"):
        text = ChatTemplate.from_metadata(meta, tok).render([{"role": "user", "content": args.prompt}],
                                                            add_generation_prompt=True)
    else:
        text = args.prompt
    ids = tok.encode(text, add_special=True, parse_special=True)
    result = denoise_to(sys.stdout, model, tok, ids, args)
    sys.stdout.write("\n")
    if args.ids_out:
        with open(args.ids_out, "w") as fh:
            fh.writelines(f"{t}\n" for t in result.tokens)
    return 0


class DiffusionChat:
    """`fucina chat` on a diffusion model: each turn renders the whole conversation through
    the chat template and denoises the reply's canvas (the prompt + --gen, or --canvas);
    the repl offers /help, /exit and /quit."""

    raw = True     # the repl's conversation commands (/reset, /system, ...) need a Conversation

    def __init__(self, llm, args):
        from fucina.text.sampler import SamplingConfig

        self.llm, self.args = llm, args
        self.messages = [{"role": "system", "content": args.system}] if args.system else []
        self.ids: list[int] = []
        cfg = config(args, 1)
        self.sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed)
        self.seed = cfg.seed

    @property
    def name(self) -> str:
        return self.llm._name()

    def reply(self, text: str, out) -> None:
        llm = self.llm
        msgs = self.messages + [{"role": "user", "content": text}]
        ids = llm.tokenizer.encode(llm.template.render(msgs, add_generation_prompt=True),
                                   add_special=True, parse_special=True)
        if self.args.seed is None:
            self.args.seed = self.seed     # one seed for the session, as a Conversation keeps one sampler
        result = denoise_to(out, llm.model, llm.tokenizer, ids, self.args)
        self.messages = msgs + [{"role": "assistant", "content": result.text}]
        self.ids += result.tokens
        if self.args.ids_out:
            with open(self.args.ids_out, "w") as fh:
                fh.writelines(f"{t}\n" for t in self.ids)
        out.write("\n")
        out.flush()
