"""Multi-turn chat over one persistent KV cache.

Each turn renders the whole message history with the chat template. When the new
rendering extends what the cache already holds (the usual case), only the new text is
tokenized and prefilled; otherwise (a template that rewrites history, e.g. dropping
past reasoning, or a reply cut at a stop string) the cache is rewound to the longest
common token prefix with a fresh tokenization and the rest is prefilled. Either way the
cache ends up holding what a stateless prefill of the rendered history would hold.
A gpt-oss (harmony) reply goes into the history split by channel (`_assistant`), so
the next turn renders it the way harmony asks (the analysis of a finished turn dropped).

`send_messages`/`send_tokens` are the stateless-server seam: a full history (or its ids)
reconciled against whatever this conversation's cache holds, reusing the longest common
token prefix (`last.reused_tokens` is OpenAI's cached_tokens).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from fucina.errors import FucinaError
from fucina.models.cache_q8 import make_cache
from fucina.models.kv_persist import KVPersist
from fucina.text import harmony
from fucina.text.chat_template import ChatTemplate, prompt_ids
from fucina.text.generate import Reply, ReplyDecoder, drive, pieces_text, prefill, run
from fucina.text.logit_processor import LogitProcessor
from fucina.text.sampler import Sampler, SamplingConfig
from fucina.text.speculative import Speculation, reference_ids


class Conversation:
    def __init__(self, model, tokenizer, template: ChatTemplate | None = None, *,
                 system: str | None = None, max_tokens: int = 1024, think: bool = True,
                 sampling: SamplingConfig | None = None, stop: Sequence[str] = (),
                 stop_ids: Sequence[int] = (), processor: LogitProcessor | None = None,
                 capacity: int | None = None, cache_type: str = "f16", cache=None,
                 tokens: Sequence[int] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                 persist: str | os.PathLike | None = None, speculative: bool = False,
                 references: Sequence[str | Sequence[int]] = (), spec_max: int = 16, cartridge=None,
                 retrieve: Callable[[str], Any] | None = None):
        from fucina.text.cartridge import Prefix, load_cartridges

        self.model, self.tokenizer = model, tokenizer
        if template is None:
            meta = getattr(getattr(model, "gguf", None), "metadata", {}) or {}
            template = ChatTemplate.from_metadata(meta, tokenizer)
        self.template = template
        self.system, self.max_tokens, self.think, self.tools = system, max_tokens, think, tools
        self.stop = list(stop)
        self.stop_ids = set(template.stop_ids(tokenizer)) | {int(i) for i in stop_ids}
        self.sampler = Sampler(sampling, processor)
        self.cache = cache if cache is not None else make_cache(model, capacity, cache_type)
        self.tokens: list[int] = []            # the ids the cache holds, position by position
        self.messages: list[dict[str, Any]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.last: Reply | None = None
        self._committed_text: str | None = None  # the text whose tokens are self.tokens
        self.spec = Speculation(model.config.n_vocab, max_draft=spec_max) if speculative else None
        for ref in references:
            self.add_reference(ref)
        # a cartridge: its rows seated at the start of the cache, sentinel ids in self.tokens
        cart = load_cartridges(cartridge, model)
        self.prefix = Prefix(cart) if cart is not None else None
        if self.prefix is not None and self.spec is not None and cart.corpus:
            self.spec.add_reference(cart.corpus)      # the document the cartridge was made from
        if retrieve is not None and cartridge is not None:
            raise FucinaError("a conversation takes a cartridge or a retrieval, not both")
        self._retrieve = retrieve   # text -> Prefix: the first user message picks the cartridges (a fleet)
        if (self.prefix is not None or retrieve is not None) and persist is not None:
            raise FucinaError("a conversation behind a cartridge cannot persist its cache yet")
        self._persist = KVPersist(persist) if persist is not None else None
        if self._persist is not None:
            self._resume()
        elif tokens is not None:          # a warm cache: `tokens` describes its positions
            self.cache.truncate(self.cache.truncate_point(len(tokens)))
            self.tokens = [int(t) for t in tokens[:self.cache.len]]
        elif self.cache.len:
            self.cache.reset()
        if self.prefix is not None and self.tokens[:self.prefix.p] != self.prefix.ids:
            self.prefix.seat(self.cache, self.tokens)

    # -- public ------------------------------------------------------------------
    @property
    def fired_stop(self) -> int | None:
        return self.last.fired_stop if self.last else None

    def send(self, text: str, *, on_piece: Callable[[str], None] | None = None,
             max_tokens: int | None = None) -> str:
        """Add a user turn, generate the assistant's reply, return its text."""
        return run(self.stream(text, max_tokens=max_tokens), on_piece)

    def stream(self, text: str, *, max_tokens: int | None = None) -> Iterator[str]:
        """As send, yielding UTF-8-safe text pieces as they are decided."""
        self._pick(text)
        msgs = self.messages + [{"role": "user", "content": text}]
        full = self._render(msgs)
        return self._turn(msgs, full, self._ids_for(full), max_tokens)

    def send_messages(self, messages: Sequence[Mapping[str, Any]], *,
                      on_piece: Callable[[str], None] | None = None,
                      max_tokens: int | None = None) -> str:
        """Stateless form: answer a full message history, reusing the cache's longest
        common token prefix with it."""
        msgs = [dict(m) for m in messages]
        users = [m.get("content") for m in msgs if m.get("role") == "user"]
        self._pick(users[-1] if users and isinstance(users[-1], str) else "")
        full = self._render(msgs)
        return run(self._turn(msgs, full, self._with_prefix(prompt_ids(self.tokenizer, full)), max_tokens),
                   on_piece)

    def send_tokens(self, ids: Sequence[int], *, on_piece: Callable[[str], None] | None = None,
                    max_tokens: int | None = None) -> Reply:
        """Pre-encoded prompt ids with prefix reuse (the server's slot seam). The message
        list is left alone; returns the Reply."""
        self._pick(self.tokenizer.decode([int(i) for i in ids]))
        gen = self._generate(self._with_prefix(list(ids)), max_tokens)
        return run(gen, on_piece)

    def add_reference(self, ref: str | Sequence[int]) -> None:
        """A document the replies may copy from (text or ids): speculation drafts its
        spans (the RAG seam). Needs speculative=True."""
        if self.spec is None:
            raise FucinaError("add_reference needs a speculative conversation (speculative=True)")
        self.spec.add_reference(reference_ids(self.tokenizer, ref))

    @property
    def spec_stats(self):
        """The speculative decoder's lifetime Stats (None when speculation is off)."""
        return self.spec.stats if self.spec is not None else None

    def take_cache(self) -> tuple[Any, list[int]]:
        """Release the cache and the ids describing its positions (a server slot keeps
        them for the next request: `Conversation(..., cache=c, tokens=t)`)."""
        cache, tokens = self.cache, list(self.tokens[:self.cache.len])
        self.cache = make_cache(self.model, 1, "f16")
        self.tokens = []
        self._committed_text = None
        return cache, tokens

    def reset(self) -> None:
        self.cache.reset()
        self.tokens.clear()
        self.messages = [m for m in self.messages[:1] if m["role"] == "system"]
        self._committed_text = None
        self.last = None
        if self._retrieve is not None:     # the next first message retrieves again
            self.prefix = None
        if self.prefix is not None:
            self.prefix.seat(self.cache, self.tokens)
        self._sync()

    # -- turns -------------------------------------------------------------------
    def _render(self, msgs: list[dict[str, Any]]) -> str:
        extra = {}
        if harmony.is_harmony(self.template) and harmony.effort_level(self.think) is not None:
            extra["reasoning_effort"] = harmony.effort_level(self.think)   # gpt-oss: think=False is low
        return self.template.render(msgs, add_generation_prompt=True, tools=self.tools,
                                    enable_thinking=self.think, **extra)

    def _ids_for(self, full: str) -> list[int]:
        done = self._committed_text
        if self.tokens and done is not None and full.startswith(done) and len(full) > len(done):
            delta = self.tokenizer.encode(full[len(done):], add_special=False, parse_special=True)
            return self.tokens + delta
        return self._with_prefix(prompt_ids(self.tokenizer, full))

    def _pick(self, text: str) -> None:
        """With a retrieval: the first message's text picks the cartridges the whole
        conversation then runs behind (its cache keeps their rows)."""
        if self._retrieve is None or self.prefix is not None:
            return
        self.prefix = self._retrieve(text)
        if self.spec is not None and self.prefix.cart.corpus:
            self.spec.add_reference(self.prefix.cart.corpus)
        self.prefix.seat(self.cache, self.tokens)
        self._committed_text = None

    def _with_prefix(self, ids: list[int]) -> list[int]:
        return self.prefix.add(ids) if self.prefix is not None else ids

    def _turn(self, msgs: list[dict[str, Any]], full: str, ids: list[int],
              max_tokens: int | None) -> Iterator[str]:
        reply = yield from self._generate(ids, max_tokens, msgs, full)
        return reply.text

    def _generate(self, ids: list[int], max_tokens: int | None,
                  msgs: list[dict[str, Any]] | None = None, prompt_text: str | None = None):
        rd, logits = self._begin(ids, max_tokens)
        try:
            if self.spec is not None:
                yield from self.spec.drive(self.model, rd, logits)
            else:
                yield from drive(self.model, rd, logits)
        finally:
            self._end(rd, ids, msgs, prompt_text)
        return rd.reply

    def _begin(self, ids: list[int], max_tokens: int | None) -> tuple[ReplyDecoder, Any]:
        """Turn prologue: re-arm the processor, prefill (reusing the common prefix)."""
        if self.sampler.processor is not None:
            self.sampler.processor.reset()
        p = 0
        if self.prefix is not None:
            self.prefix.ensure(self.cache, self.tokens, ids)
            p = self.prefix.p
        logits, reused = prefill(self.model, self.cache, self.tokens, ids)
        self._committed_text = None
        rd = ReplyDecoder(self.cache, self.tokens, self.sampler, self.tokenizer,
                          max_tokens=self.max_tokens if max_tokens is None else max_tokens,
                          stop_ids=self.stop_ids, stop=self.stop,
                          reply=Reply(prompt_tokens=len(ids) - p, reused_tokens=max(0, reused - p)))
        return rd, logits

    def _end(self, rd: ReplyDecoder, ids: list[int], msgs, prompt_text) -> None:
        """Turn epilogue (every exit path): settle the reply, record the messages,
        remember the committed text for the next turn's delta, persist."""
        reply = rd.close()
        self.last = reply
        if msgs is not None:
            self.messages = msgs + [self._assistant(reply.text)]
            if len(self.tokens) == len(ids) + len(reply.tokens):
                self._committed_text = prompt_text + pieces_text(self.tokenizer, reply.tokens)
        self._sync()

    def _assistant(self, text: str) -> dict[str, Any]:
        """The reply as a history message. A harmony reply (gpt-oss) is split into its
        channels: the final answer as content, the analysis as `thinking` (which the
        template drops from finished turns), a call as `tool_calls`; raw channel
        markup in content would be refused by the template."""
        if not harmony.is_harmony(self.template):
            return {"role": "assistant", "content": text}
        p = harmony.split(text)
        msg: dict[str, Any] = {"role": "assistant", "content": p.content}
        if p.reasoning:
            msg["thinking"] = p.reasoning
        if p.calls:
            msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": _args(a)}}
                                 for n, a in p.calls]
        return msg

    # -- persistence ---------------------------------------------------------------
    def _meta_path(self) -> Path:
        return Path(str(self._persist.path) + ".json")

    def _resume(self) -> None:
        self.cache.reset()
        toks = self._persist.load(self.cache)
        if not toks:
            return
        self.tokens = list(toks)
        try:
            meta = json.loads(self._meta_path().read_text())
        except (OSError, ValueError):
            return
        if meta.get("n_tokens") == len(toks) and isinstance(meta.get("messages"), list):
            self.messages = meta["messages"]
            self._committed_text = meta.get("committed_text")

    def _sync(self) -> None:
        if self._persist is None:
            return
        self._persist.sync(self.cache, self.tokens)
        tmp = Path(str(self._meta_path()) + ".tmp")
        tmp.write_text(json.dumps({"n_tokens": len(self.tokens), "messages": self.messages,
                                   "committed_text": self._committed_text}, ensure_ascii=False))
        os.replace(tmp, self._meta_path())


def _args(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def send_batch(convos: Sequence[Conversation], users: Sequence[str], *,
               on_piece: Callable[[int, str], None] | None = None,
               max_tokens: int | None = None) -> list[str]:
    """One user message on each of N sibling conversations (same model), decoded in
    lockstep: each step forwards one token per live stream through one batched
    weight pass, then samples each stream with its own sampler and history. Per-stream
    results equal N plain `send` calls (under a grammar Constraint, one per stream:
    equally valid, not guaranteed token-identical, as a plain send fast-forwards the
    grammar's forced spans in one step, without drawing). `on_piece(i, text)` streams
    stream i's text. Speculative conversations decode plainly here (same tokens): the
    lockstep pass advances every stream by exactly one token."""
    from fucina.text.batch import lockstep

    if len(convos) != len(users):
        raise FucinaError(f"send_batch: {len(convos)} conversations for {len(users)} messages")
    if len({id(c) for c in convos}) != len(convos):
        raise FucinaError("send_batch: the same conversation appears twice")
    if any(c.model is not convos[0].model for c in convos):
        raise FucinaError("send_batch: the conversations must share one model")
    procs = [id(c.sampler.processor) for c in convos if c.sampler.processor is not None]
    if len(set(procs)) != len(procs):
        raise FucinaError("send_batch: a logit processor holds one stream's state; give each "
                          "conversation its own (Constraint.clone())")
    turns, logits = [], []
    try:
        for c, text in zip(convos, users):      # prologues: render + per-stream prefill
            msgs = c.messages + [{"role": "user", "content": text}]
            full = c._render(msgs)
            ids = c._ids_for(full)
            rd, lg = c._begin(ids, max_tokens)
            turns.append((c, rd, ids, msgs, full))
            logits.append(lg)
        lockstep(convos[0].model, [t[1] for t in turns], logits, on_piece)
    finally:
        for c, rd, ids, msgs, full in turns:
            c._end(rd, ids, msgs, full)
    return [rd.reply.text for _, rd, *_ in turns]
