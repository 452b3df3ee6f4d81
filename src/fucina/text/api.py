"""The Python API.

    import fucina
    llm = fucina.load()                       # the default model (SmolLM2-135M-Instruct)
    llm.generate("The capital of France is", max_tokens=16)
    for piece in llm.stream("Once upon a time", temperature=0.8, seed=1):
        print(piece, end="")
    chat = llm.chat(system="Be terse.")
    chat.send("Hi!")                          # -> str; chat.stream("...") yields pieces

Sampling keywords follow llama.cpp/OpenAI: temperature, top_k, top_p, min_p,
repeat_penalty, frequency_penalty, presence_penalty, repeat_last_n, seed, plus stop
(a string or a list of strings). Unset keywords take the model's recommended sampling
(`general.sampling.*` in the GGUF) or llama.cpp's defaults (temperature 0.8, top-k 40,
top-p 0.95, min-p 0.05), with a fresh seed per call unless `seed` is given;
`temperature=0` is greedy.

Structured output (one of): json_schema= (a dict, JSON text or a pydantic model),
regex=, lark=, grammar= (GBNF or Lark), choices= (a list of strings); strict=True makes
a schema keyword the engine cannot enforce an error (by default: a SchemaWarning, the
rest enforced, the finished reply checked against the whole schema):

    llm.generate("Name a colour:", regex=" (red|green|blue)")
    chat = llm.chat(json_schema=MyModel)      # every reply is valid MyModel JSON

`speculative=True` (with optional `references=[text, ...]`, `spec_max=N`) decodes
speculatively: drafts from what the model has seen, verified in one pass; same tokens.
"""
from __future__ import annotations

import contextlib
import gc
import numbers
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from fucina.errors import CartridgeError, InvalidArgument
from fucina.text.chat_template import ChatTemplate
from fucina.text.defaults import default_sampling, fresh_seed

if TYPE_CHECKING:   # torch-heavy: imported where a method computes (`fucina.load()` computes nothing)
    from fucina.gguf import GGUFFile
    from fucina.text.conversation import Conversation
    from fucina.text.generate import Reply
    from fucina.text.sampler import Sampler, SamplingConfig
    from fucina.text.speculative import Speculation

#: the KV cache formats (fucina.models.cache_q8.make_cache builds them; a test keeps the two equal)
CACHE_TYPES = ("f16", "q8_0")


@contextlib.contextmanager
def gc_paused():
    """No cyclic GC while torch imports and a model builds: both allocate hundreds of
    thousands of long-lived objects, and collections re-scanning them were ~0.25 s CPU
    of a cold start. The previous state comes back after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _split_options(kw: dict[str, Any], base: SamplingConfig) -> tuple[SamplingConfig, list[str]]:
    from fucina.text.sampler import SAMPLING_KEYS, SamplingConfig

    stop = kw.pop("stop", None)
    unknown = sorted(set(kw) - SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(unknown)}")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise InvalidArgument(f"stop must be a string or a list of strings, got {stop!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if kw.get("seed") is None:
        kw["seed"] = fresh_seed()
    return SamplingConfig.from_kwargs(base, **kw), stops


def _count(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidArgument(f"{name} must be a non-negative integer, got {v!r}")
    return v


class LLM:
    """A model with its tokenizer and chat template. `model` is a built decoder, or None
    with `build` (a function returning it) and `gguf` (the opened file): then the decoder,
    and torch with it, is built on first use of `llm.model` (every method that computes),
    once, under a lock. What does not compute (tokenize, detokenize, template, metadata,
    arch, n_ctx) never builds it."""

    def __init__(self, model, tokenizer, template: ChatTemplate | None = None, *,
                 n_ctx: int | None = None, cache_type: str = "f16",
                 build: Callable[[], Any] | None = None, gguf: GGUFFile | None = None, config=None,
                 cartridge=None, fleet=None, fleet_top_k: int = 1):
        if (model is None) == (build is None):
            raise InvalidArgument("LLM takes a built model or a build function (with gguf), not both or neither")
        self._model, self._build, self._build_lock = model, build, threading.Lock()
        self._config = config       # the checked config the build will use (fucina.load())
        self.gguf = gguf if gguf is not None else getattr(model, "gguf", None)
        self.tokenizer = tokenizer
        meta = self.metadata
        self.template = template or ChatTemplate.from_metadata(meta, tokenizer)
        src = meta.get("tokenizer.chat_template")
        self.has_chat_template = template is not None or (isinstance(src, str) and bool(src.strip()))
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1):
            raise InvalidArgument(f"n_ctx must be a positive integer, got {n_ctx!r}")
        if cache_type not in CACHE_TYPES:
            raise InvalidArgument(f"cache_type must be one of {', '.join(CACHE_TYPES)}, got {cache_type!r}")
        self.n_ctx = n_ctx or min(self._context_length(), 4096)
        self.cache_type = cache_type
        self._sampling: SamplingConfig | None = None
        self._cache = None
        self._history: list[int] = []
        self.last: Reply | None = None
        self.spec: Speculation | None = None     # the raw-completion speculative state
        self.cartridge = cartridge   # path(s) or Cartridge(s): every cache starts behind it (text.cartridge)
        self._prefix = None
        if fleet is not None and cartridge is not None:
            raise InvalidArgument("give a cartridge or a fleet, not both (a fleet picks the cartridges)")
        if isinstance(fleet_top_k, bool) or not isinstance(fleet_top_k, int) or fleet_top_k < 1:
            raise InvalidArgument(f"fleet_top_k must be a positive integer, got {fleet_top_k!r}")
        self._fleet_spec, self.fleet_top_k, self._fleet = fleet, fleet_top_k, None

    @property
    def model(self):
        """The decoder, built on first use (torch is imported then)."""
        if self._model is None:
            with self._build_lock:
                if self._model is None:
                    with gc_paused():
                        self._model = self._build()
                    self._build = None
        return self._model

    @property
    def built(self) -> bool:
        """Whether the decoder exists yet (fucina.load() defers it to the first compute)."""
        return self._model is not None

    @property
    def metadata(self) -> dict:
        return getattr(self.gguf, "metadata", None) or {}

    @property
    def arch(self) -> str:
        return self.gguf.architecture if self.gguf is not None else self.model.config.arch

    @property
    def sampling(self) -> SamplingConfig:
        """What unset sampling keywords mean (the model's recommendation or llama.cpp's)."""
        if self._sampling is None:
            self._sampling = default_sampling(self.metadata)
        return self._sampling

    @sampling.setter
    def sampling(self, cfg: SamplingConfig) -> None:
        self._sampling = cfg

    def _context_length(self) -> int:
        if self._model is None and self._config is None:
            from fucina.models.registry import context_length
            return context_length(self.gguf)
        return self.config.n_ctx_train

    @property
    def config(self):
        """The family's config: the one load() checked (no build, no torch), else the decoder's."""
        return self._config if self._model is None and self._config is not None else self.model.config

    @property
    def prefix(self):
        """The cartridge(s) as a text.cartridge.Prefix (None without one), checked
        against the model on first use."""
        if self.cartridge is not None and self._prefix is None:
            from fucina.text.cartridge import Prefix, load_cartridges
            cart = load_cartridges(self.cartridge, self.model)
            self._prefix = Prefix(cart) if cart is not None else None
        return self._prefix

    @property
    def fleet(self):
        """The cartridge fleet (text.cartridge.FleetPrefixes) a call's text retrieves its
        cartridges from, opened and indexed on first use; None without one."""
        if self._fleet_spec is not None and self._fleet is None:
            from fucina.text.cartridge import FleetPrefixes
            fleet = FleetPrefixes(self._fleet_spec, self.model, tokenizer=self.tokenizer, top_k=self.fleet_top_k)
            if not fleet.names():
                raise CartridgeError(f"the fleet {self._fleet_spec} has no trained cartridge yet "
                                     f"(fucina cartridge fleet train)")
            fleet.build_index()
            self._fleet = fleet
        return self._fleet

    def _prefix_for(self, text: str):
        """The prefix a call starts behind: the cartridge's, or what the fleet retrieves for `text`."""
        return self.fleet.retrieve(text) if self._fleet_spec is not None else self.prefix

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=True)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- raw completion ----------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256, **options: Any) -> Iterator[str]:
        """Continue `prompt` (text, or token ids), yielding UTF-8-safe text pieces. The
        cache is kept between calls and its longest common prefix with the next prompt
        is reused."""
        from fucina.models.cache_q8 import make_cache
        from fucina.text import grammar as grammars
        from fucina.text.constraint import for_reply, pop_options
        from fucina.text.diffusion import DIFFUSION_ONLY, is_diffusion
        from fucina.text.sampler import Sampler

        from fucina.text.diffusion_gemma import ONLY as BLOCK_DIFFUSION_ONLY

        if is_diffusion(self.model):
            return self._denoise(prompt, max_tokens, options)
        if (DIFFUSION_ONLY | BLOCK_DIFFUSION_ONLY) & set(options):
            raise InvalidArgument(f"{self._name()} is not a diffusion model: "
                                  f"{', '.join(sorted((DIFFUSION_ONLY | BLOCK_DIFFUSION_ONLY) & set(options)))} "
                                  "apply only to dream/llada/diffusion-gemma models")
        options = dict(options)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else _token_ids(prompt, self.tokenizer)
        prefix = self._prefix_for(prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
        spec = self._speculation(options.pop("speculative", False), options.pop("references", ()),
                                 options.pop("spec_max", 16), prefix)
        grammar = grammars.from_options(**pop_options(options))
        cfg, stops = _split_options(options, self.sampling)
        max_tokens = _count("max_tokens", max_tokens)
        if self._cache is None:
            self._cache = make_cache(self.model, self.n_ctx, self.cache_type)
        processor = for_reply(self.tokenizer, grammar, stop_ids=self._stop_ids(), n_vocab=self.config.n_vocab)
        return self._complete(ids, max_tokens, Sampler(cfg, processor), stops, spec, prefix)

    def _denoise(self, prompt: str | Sequence[int], max_tokens: int, options: dict) -> Iterator[str]:
        """A diffusion model's reply, pieces per committed block: dream/llada's (text.diffusion:
        a canvas of the prompt + max_tokens, or `canvas`, denoised with llama-diffusion-cli's
        settings) or diffusion-gemma's (text.diffusion_gemma: canvases denoised by the
        entropy-bound sampler, committed one after another)."""
        from fucina.text import diffusion_gemma as dg
        from fucina.text.diffusion import DIFFUSION_KEYS, DiffusionConfig, fit, reply

        blocks = getattr(self.model, "block_diffusion", False)
        keys = dg.KEYS if blocks else DIFFUSION_KEYS
        options = dict(options)
        bad = sorted(set(options) - keys)
        if bad:
            raise InvalidArgument(f"{self._name()} is a {'block-' * blocks}diffusion model: {', '.join(bad)} "
                                  f"do not apply to it (it takes {', '.join(sorted(keys - {'temp'}))})")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else _token_ids(prompt, self.tokenizer)
        if options.get("seed") is None:
            options["seed"] = fresh_seed()
        max_tokens = _count("max_tokens", max_tokens)
        if blocks:
            cfg = dg.GemmaDiffusionConfig.for_model(self.model, **options)
            gen = dg.reply(self.model, self.tokenizer, ids, max_tokens, cfg, self.n_ctx)
        else:
            gen = reply(self.model, self.tokenizer, ids, DiffusionConfig.from_kwargs(None, **fit(len(ids), max_tokens,
                                                                                                 options)))

        def run():
            self.last = yield from gen
            return self.last.text
        return run()

    def _stop_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "eog_ids", ()) or ())

    def _speculation(self, on: bool, references, spec_max: int, prefix=None) -> Speculation | None:
        from fucina.text.speculative import Speculation, reference_ids

        if not on:
            return None
        if self.spec is None or self.spec.decoder.max_draft != spec_max:
            self.spec = Speculation(self.config.n_vocab, max_draft=spec_max)
        self.spec.index.clear_references()
        for ref in [references] if isinstance(references, str) else references:
            self.spec.add_reference(reference_ids(self.tokenizer, ref))
        if prefix is not None and prefix.cart.corpus:
            self.spec.add_reference(prefix.cart.corpus)   # the cartridge's own document
        return self.spec

    def _complete(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: list[str],
                  spec: Speculation | None = None, prefix=None):
        from fucina.text.generate import Reply, decode, prefill

        p = 0
        if prefix is not None:
            ids = prefix.add(ids)
            prefix.ensure(self._cache, self._history, ids)
            p = prefix.p
        logits, reused = prefill(self.model, self._cache, self._history, ids)
        reply = Reply(prompt_tokens=len(ids) - p, reused_tokens=max(0, reused - p))
        stop_ids = self._stop_ids()
        try:
            yield from decode(self.model, self._cache, self._history, logits, sampler, self.tokenizer,
                              max_tokens=max_tokens, stop_ids=stop_ids, stop=stops, reply=reply,
                              spec=spec)
        finally:
            self.last = reply
        return reply.text

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, **options: Any) -> str:
        """Continue `prompt`; returns the generated text (`llm.last` has the details)."""
        from fucina.text.generate import run

        return run(self.stream(prompt, max_tokens, **options))

    # -- chat --------------------------------------------------------------------------
    def chat(self, system: str | None = None, max_tokens: int = 1024, *, think: bool = True,
             tools: Sequence[dict] | None = None, persist: str | os.PathLike | None = None,
             speculative: bool = False, references: Sequence[str] = (), spec_max: int = 16,
             **options: Any) -> Conversation:
        """A new multi-turn Conversation with its own KV cache (a constraint keyword
        governs every reply; on a thinking model, what follows the think block;
        speculative: every reply decoded speculatively, drafting from the chat and
        `references`)."""
        from fucina.text import grammar as grammars
        from fucina.text.constraint import for_reply, pop_options
        from fucina.text.conversation import Conversation

        options = dict(options)
        grammar = grammars.from_options(**pop_options(options))
        cfg, stops = _split_options(options, self.sampling)
        max_tokens = _count("max_tokens", max_tokens)
        if system is not None and not isinstance(system, str):
            raise InvalidArgument(f"system must be a string, got {type(system).__name__}")
        if not self.has_chat_template:
            warnings.warn(f"{self._name()} has no chat template (a base model?): chat uses the "
                          f"built-in {self.template.name} format, which it was not trained on; "
                          f"generate() continues text as a raw completion", stacklevel=2)
        processor = for_reply(self.tokenizer, grammar, stop_ids=self.template.stop_ids(self.tokenizer),
                              n_vocab=self.config.n_vocab, template=self.template, think=think)
        return Conversation(self.model, self.tokenizer, self.template, system=system,
                            max_tokens=max_tokens, think=think, sampling=cfg, stop=stops,
                            capacity=self.n_ctx, cache_type=self.cache_type, tools=tools,
                            persist=persist, processor=processor, speculative=speculative,
                            references=references, spec_max=spec_max,
                            cartridge=self.prefix.cart if self.prefix is not None else None,
                            retrieve=self.fleet.retrieve if self._fleet_spec is not None else None)

    def _name(self) -> str:
        return os.path.basename(str(getattr(self.gguf, "path", "the model")))

    def __repr__(self) -> str:
        return f"LLM({self._name()}, arch={self.arch}, template={self.template.name})"


def _token_ids(prompt: Any, tokenizer) -> list[int]:
    n = getattr(tokenizer, "n_vocab", None)
    try:
        ids = [i for i in prompt]
    except TypeError:
        raise InvalidArgument(f"prompt must be a string or a sequence of token ids, got "
                              f"{type(prompt).__name__}") from None
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 or (n is not None and i >= n):
            raise InvalidArgument(f"prompt holds {i!r}, not a token id in [0, {n})")
    return [int(i) for i in ids]


@contextlib.contextmanager
def one_thread():
    """Run a model load on one thread, then restore the count: fusing the weights is a
    few memory-bound copies a second thread does not speed up, and on a busy machine an
    OpenMP team waiting on its slowest member made `load` several times slower."""
    from fucina import kernels

    before = kernels.get_threads()
    kernels.set_threads(1)
    try:
        yield
    finally:
        kernels.set_threads(before)


def load(path: str | os.PathLike | None = None, *, n_ctx: int | None = None,
         cache_type: str = "f16", lora: str | os.PathLike | Sequence[str] | None = None,
         lora_scale: float | Sequence[float] | None = None, moe_ram: float | str | None = None,
         moe_policy: str = "heat", pipeline: bool = False, split: Sequence[int] | None = None,
         pipeline_timeout: float | None = None, cartridge=None, fleet: str | os.PathLike | None = None,
         fleet_top_k: int = 1, engram: str | os.PathLike | None = None,
         mtp: bool | str | os.PathLike | None = None) -> LLM:
    """Open a GGUF (None: the default model, fetched on first use) as an LLM; `lora`: one or
    more llama.cpp-format LoRA adapters, applied unmerged (scaled by `lora_scale`, default 1.0);
    `moe_ram` (GiB, or a share of the experts' bytes like "50%"): a MoE model's experts
    stream from the file under that RAM budget (models/expert_store.py, `moe_policy` heat
    or lru), with the same output.

    Computes nothing: the file is parsed and checked (structure, tensor data in bounds, a
    supported architecture, the family's config and every tensor's presence and shape, from
    the torch-free schemas in models/schema/), the tokenizer and template are built, and the
    decoder (torch, weight fusing) is built on the first compute. With `lora` or `moe_ram`
    it is built here: both are checked against it.

    `pipeline=True` (under torchrun, on every rank): the layers split over the group's ranks
    (`split`: layers per rank; default balanced by bytes), each mapping only its own
    (models/pipeline.py). Rank 0 gets the LLM; every other rank serves rank 0's steps inside
    this call and leaves with SystemExit(0) when rank 0's process ends.

    `cartridge`: a trained KV prefix (path or Cartridge; a list is composed in order)
    every cache starts behind (fucina.models.cartridge); checked on the first compute.
    `fleet`: a cartridge fleet directory (`fucina cartridge fleet`) instead: each
    generate() and each conversation's first message runs behind the `fleet_top_k`
    cartridges its text is closest to (text.retrieval), as `fucina serve --fleet` does.

    `engram`: an Engram n-gram memory file (`fucina engram train`) grafted onto the decoder
    (checked against it here).


    `mtp`: a multi-token-prediction head drafts for speculative decoding (`speculative=True`,
    the server, Predicted Outputs): True for the NextN block the file carries (glm4moe), or a
    head GGUF trained for this model (`fucina mtp train`); checked here (the model is built)."""
    from fucina.gguf import GGUFFile
    from fucina.models.hub import resolve_model
    from fucina.models.registry import check
    from fucina.text.tokenizer import Tokenizer

    if pipeline and (lora or moe_ram is not None or engram):
        raise InvalidArgument("pipeline stages take neither LoRA adapters, an expert RAM budget nor an Engram yet")
    f = GGUFFile(resolve_model(path))
    checked = check(f)          # the family's config and tensor schema (torch-free): a broken file fails here

    def build():
        from fucina.models.registry import load_model

        if pipeline:      # outside one_thread(): the other ranks compute inside this call
            from fucina.models.pipeline import start
            model = start(f, split=split, timeout=pipeline_timeout, checked=checked)
        else:
            with one_thread():
                model = load_model(f, checked, group_experts=moe_ram is None)
        if moe_ram is not None:
            from fucina.models.expert_store import stream_experts
            stream_experts(model, moe_ram, policy=moe_policy)
        if mtp is not None and mtp is not False:
            from fucina.models.mtp import attach_from
            attach_from(model, mtp)
        if lora:
            from fucina.weights.lora import load_adapters
            scales = [lora_scale] if isinstance(lora_scale, (int, float)) else lora_scale
            load_adapters(model, [lora] if isinstance(lora, (str, os.PathLike)) else list(lora), scales)
        if engram:
            from fucina.models.engram import attach_file
            attach_file(model, engram)
        return model

    llm = LLM(None, Tokenizer.from_metadata(f.metadata), n_ctx=n_ctx, cache_type=cache_type, build=build, gguf=f,
              config=checked.config, cartridge=cartridge, fleet=fleet, fleet_top_k=fleet_top_k)
    if lora or moe_ram is not None or pipeline or engram or (mtp is not None and mtp is not False):
        llm.model
    return llm
