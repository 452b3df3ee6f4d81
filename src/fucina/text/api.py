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
(a string or a list of strings). The default is greedy (temperature 0).

Structured output (one of): json_schema= (a dict, JSON text or a pydantic model),
regex=, lark=, grammar= (GBNF or Lark), choices= (a list of strings):

    llm.generate("Name a colour:", regex=" (red|green|blue)")
    chat = llm.chat(json_schema=MyModel)      # every reply is valid MyModel JSON

`speculative=True` (with optional `references=[text, ...]`, `spec_max=N`) decodes
speculatively: drafts from what the model has seen, verified in one pass; same tokens.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

from fucina.models.cache_q8 import make_cache
from fucina.text import grammar as grammars
from fucina.text.constraint import for_reply, pop_options
from fucina.text.chat_template import ChatTemplate
from fucina.text.conversation import Conversation
from fucina.text.generate import Reply, decode, prefill, run
from fucina.text.sampler import SAMPLING_KEYS, Sampler, SamplingConfig
from fucina.text.speculative import Speculation, reference_ids


def _split_options(kw: dict[str, Any]) -> tuple[SamplingConfig, list[str]]:
    stop = kw.pop("stop", None)
    unknown = sorted(set(kw) - SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(unknown)}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return SamplingConfig.from_kwargs(**kw), stops


class LLM:
    """A loaded model with its tokenizer and chat template."""

    def __init__(self, model, tokenizer, template: ChatTemplate | None = None, *,
                 n_ctx: int | None = None, cache_type: str = "f16"):
        self.model, self.tokenizer = model, tokenizer
        meta = getattr(getattr(model, "gguf", None), "metadata", {}) or {}
        self.template = template or ChatTemplate.from_metadata(meta, tokenizer)
        self.n_ctx = n_ctx or min(model.config.n_ctx_train, 4096)
        self.cache_type = cache_type
        self._cache = None
        self._history: list[int] = []
        self.last: Reply | None = None
        self.spec: Speculation | None = None     # the raw-completion speculative state

    @property
    def config(self):
        return self.model.config

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=True)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- raw completion ----------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256, **options: Any) -> Iterator[str]:
        """Continue `prompt` (text, or token ids), yielding UTF-8-safe text pieces. The
        cache is kept between calls and its longest common prefix with the next prompt
        is reused."""
        options = dict(options)
        spec = self._speculation(options.pop("speculative", False), options.pop("references", ()),
                                 options.pop("spec_max", 16))
        grammar = grammars.from_options(**pop_options(options))
        cfg, stops = _split_options(options)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if self._cache is None:
            self._cache = make_cache(self.model, self.n_ctx, self.cache_type)
        processor = for_reply(self.tokenizer, grammar, stop_ids=self._stop_ids(), n_vocab=self.config.n_vocab)
        return self._complete(ids, max_tokens, Sampler(cfg, processor), stops, spec)

    def _stop_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "eog_ids", ()) or ())

    def _speculation(self, on: bool, references, spec_max: int) -> Speculation | None:
        if not on:
            return None
        if self.spec is None or self.spec.decoder.max_draft != spec_max:
            self.spec = Speculation(self.config.n_vocab, max_draft=spec_max)
        self.spec.index.clear_references()
        for ref in [references] if isinstance(references, str) else references:
            self.spec.add_reference(reference_ids(self.tokenizer, ref))
        return self.spec

    def _complete(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: list[str],
                  spec: Speculation | None = None):
        logits, reused = prefill(self.model, self._cache, self._history, ids)
        reply = Reply(prompt_tokens=len(ids), reused_tokens=reused)
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
        options = dict(options)
        grammar = grammars.from_options(**pop_options(options))
        cfg, stops = _split_options(options)
        processor = for_reply(self.tokenizer, grammar, stop_ids=self.template.stop_ids(self.tokenizer),
                              n_vocab=self.config.n_vocab, template=self.template, think=think)
        return Conversation(self.model, self.tokenizer, self.template, system=system,
                            max_tokens=max_tokens, think=think, sampling=cfg, stop=stops,
                            capacity=self.n_ctx, cache_type=self.cache_type, tools=tools,
                            persist=persist, processor=processor, speculative=speculative,
                            references=references, spec_max=spec_max)

    def __repr__(self) -> str:
        path = getattr(getattr(self.model, "gguf", None), "path", "?")
        return f"LLM({os.path.basename(str(path))}, arch={self.config.arch}, template={self.template.name})"


def load(path: str | os.PathLike | None = None, *, n_ctx: int | None = None,
         cache_type: str = "f16", lora: str | os.PathLike | Sequence[str] | None = None,
         lora_scale: float | Sequence[float] | None = None) -> LLM:
    """Open a GGUF (None: the default model, fetched on first use) as an LLM; `lora`: one or
    more llama.cpp-format LoRA adapters merged in (scaled by `lora_scale`, default 1.0)."""
    from fucina.models import load_model, resolve_model
    from fucina.text.tokenizer import Tokenizer

    model = load_model(resolve_model(path))
    if lora:
        from fucina.weights.lora import load_adapters
        scales = [lora_scale] if isinstance(lora_scale, (int, float)) else lora_scale
        load_adapters(model, [lora] if isinstance(lora, (str, os.PathLike)) else list(lora), scales)
    return LLM(model, Tokenizer.from_metadata(model.gguf.metadata), n_ctx=n_ctx, cache_type=cache_type)
