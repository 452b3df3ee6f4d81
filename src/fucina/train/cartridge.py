"""Training a cartridge by self-study (Cartridges, arXiv 2506.06266, Sec. 4 with k = 1).

The model stays frozen (its quantized weights, through the trainer's frozen matmuls);
the cartridge's rows past its frozen sink are the only parameters. One self-study
conversation:
1. a span of the corpus (the chunk; `chunk_span` shows every token in about as many)
   and a seed prompt, which gives the FORM of a message (a question, a summary request,
   ...), never its content: the chunk is what the message is about, so the teacher can
   always answer from what it sees. With `spread` conversation i's chunk
   starts at the i-th point of a golden-ratio sequence over the document and the seed
   prompts take turns, so any first n conversations cover the document and the forms
   evenly (random draws leave a region of it, or a form, short in one seed's run and
   not in another's);
2. bot A, the model with the chunk in its system message, writes that message
   (temperature 0.6);
3. bot B, the model with the same system message (so its prompt reuses bot A's cache
   rows of the chunk), answers greedily; its log-probabilities at each answer position,
   top-k until 0.99 of the mass, are the targets;
4. the student, the model behind the cartridge WITHOUT the chunk, reads the message and
   the answer; the loss is the top-k distillation cross-entropy (forward KL up to the
   teacher's constant entropy; the truncated tail is dropped, not renormalised), the
   mean over answer positions.
Adam over `accum` conversations per step. Conversation i is a pure function of (seed, i)
and the frozen model, and the optimizer state is checkpointed after every step, so a
run is deterministic for a seed (same thread count) and resumes where it stopped.

Generation is batched: `batch` conversations at a time, their bots' tokens decoded in
lockstep (one weight pass per step for all of them, `text.batch.forward_step_batch`),
each conversation with its own cache, sampler and stop. Where the native kernels are
batch-invariant (the default route: a row's result never depends on the rows computed
with it) a conversation's tokens and targets are bitwise those of generating it alone,
so a run does not depend on `batch`; elsewhere (torch blocks, q8_0 caches, the legacy
routes) generation falls back to one conversation at a time to keep that promise.

The student forward is the families' own torch blocks at positions p.. over a stand-in
cache whose rows are the cartridge's followed by the tokens' (`PrefixTrainCache`): the
attention mask is the usual causal one from pos0 = p, so every token sees the whole
prefix, and the gradient reaches the rows through the attention.
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from fucina.errors import CartridgeError
from fucina.models.cartridge import Cartridge, layer_geometry
from fucina.train.forward import TrainCache, _segment, checkpoint_mode
from fucina.text.batch import forward_step_batch
from fucina.train.lora import LoRAConfig, LoRAModel, mix64

#: the forms of a self-study message (what kind of message bot A writes, never its content)
SEED_PROMPTS = {
    "question": "Ask one short, specific factual question that the excerpt above answers. "
                "Output only the question.",
    "summarization": "Ask for a short summary of one part of the excerpt above. Output only the request.",
    "structuring": "Ask for one part of the excerpt above to be restated as a short list of facts. "
                   "Output only the request.",
    "use_case": "Write a question a user of the information in the excerpt above would ask. "
                "Output only the question.",
    "verbatim": "Ask for an exact name, number or date that appears in the excerpt above. "
                "Output only the question.",
    "mechanism": "Ask why or how something described in the excerpt above happens. Output only the question.",
}
SYSTEM = "Here is an excerpt of a document:\n\n{chunk}"
#: bot B's system message under teacher="document": the whole corpus
DOCUMENT = "Here is a document:\n\n{document}"
#: bot B's user message: the question, then how to answer (the student sees the question alone)
ANSWER = "{question}\n\nAnswer from the excerpt, briefly and exactly."
ANSWER_DOCUMENT = "{question}\n\nAnswer from the document, briefly and exactly."
#: bot A's message on later turns, before the seed prompt again
AGAIN = "Now another one, about something else in the excerpt. "


@dataclass
class SelfStudyConfig:
    p: int = 128                  # cartridge rows
    conversations: int = 64       # self-study conversations (the run's length)
    accum: int = 4                # conversations per optimizer step
    lr: float = 2e-3              # Adam (no weight decay, no schedule)
    seed: int = 0
    chunk_tokens: int = 384       # corpus tokens shown to bots A and B
    max_question: int = 48
    max_answer: int = 96
    top_k: int = 20
    mass: float = 0.99            # teacher entries kept per row: top-k until this cumulative mass
    temperature: float = 0.6      # bot A
    init: str = "corpus"          # "corpus" (the first p tokens' own rows) or "random"
    frozen: int = 1               # leading rows left alone (the attention sink)
    embed_corpus: bool = True     # store the corpus ids in the file (speculation reference)
    checkpoint: str = "auto"      # gradient checkpointing (train.forward.CHECKPOINT_MODES)
    batch: int = 8                # conversations generated together (the result does not depend on it)
    epochs: int = 1               # passes over the conversations (each made once, kept for the later passes)
    scaled: bool = False          # Adam in units of each (head, channel)'s size (CartridgeParams)
    turns: int = 1                # question-answer exchanges per conversation (the paper's k)
    decay: bool = False           # the learning rate falls linearly to zero over the run
    distract: float = 0.0         # chance a visit's student reads a distractor cartridge beside its rows
    spread: bool = False          # chunks on a golden-ratio sequence, seed prompts in turn (else random)
    teacher: str = "chunk"        # what bot B answers from: "chunk" (bot A's excerpt) or "document" (all of it)


# what must match between a checkpoint and the run resuming it (conversations may grow)
_RESUME_KEYS = ("p", "accum", "lr", "seed", "chunk_tokens", "max_question", "max_answer", "top_k",
                "mass", "temperature", "init", "frozen", "epochs", "scaled", "turns", "decay", "distract",
                "spread", "teacher")
# the settings of the runs that wrote checkpoints before each key existed
_BEFORE = {"epochs": 1, "scaled": False, "turns": 1, "decay": False, "distract": 0.0, "spread": False,
           "teacher": "chunk"}


@dataclass
class Sample:
    """One conversation ready to train on: the student's ids (no document), the rows
    whose next token is supervised, and per row the teacher's kept ids and log-probs."""
    ids: list[int]
    rows: list[int]
    tokens: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    question: str = ""
    answer: str = ""
    kind: str = ""


# -- the objective ------------------------------------------------------------------------

def teacher_topk(logits: torch.Tensor, k: int = 20, mass: float = 0.99) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's sparse target: the top-k ids by log-probability, cut after the entry that
    brings the cumulative probability to `mass` (that entry included)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = lp.topk(min(k, lp.numel()))
    cum = vals.exp().cumsum(0)
    n = int((cum < mass).sum()) + 1
    return ids[:n].clone(), vals[:n].clone()


def distill_loss(logprobs: torch.Tensor, tokens: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
                 ) -> torch.Tensor:
    """mean over rows r of -sum_i exp(target_ri) * logprobs[r, token_ri]: the student's
    log-probabilities [R, V] against the teacher's sparse top-k (tail not renormalised)."""
    if logprobs.shape[0] != len(tokens) or len(tokens) != len(targets):
        raise CartridgeError(f"distill_loss: {logprobs.shape[0]} rows, {len(tokens)} targets")
    row = torch.cat([torch.full((len(t),), r, dtype=torch.long) for r, t in enumerate(tokens)])
    tok = torch.cat(list(tokens)).long()
    w = torch.cat(list(targets)).float().exp()
    return -(w * logprobs[row, tok]).sum() / max(len(tokens), 1)


# -- the trainable rows and the student forward ----------------------------------------------

class CartridgeParams:
    """A cartridge's rows as training sees them: per layer with rows, the frozen leading
    rows as constants and the rest as leaf tensors (`params()`).

    `scaled` trains each row in units of its channel's size: the leaf is
    rows / s, s the root-mean-square over the trainable rows of each (head, channel) at
    the start (rounded to a power of two), so Adam's steps (about lr per element whatever the gradient's scale) move
    every channel by about lr of its own size. Raw rows would take the same absolute step
    everywhere, and a cache's channels differ in size by orders of magnitude (Qwen2.5's
    keys, with their biases, average 13-35 per element against values of 0.03-0.35):
    the keys would never move and the small value channels would be thrown about."""

    def __init__(self, cart: Cartridge, scaled: bool = False):
        self.cart = cart
        f = cart.frozen
        self.frozen_k = [None if k is None else k[:f].detach().float() for k in cart.k]
        self.frozen_v = [None if v is None else v[:f].detach().float() for v in cart.v]
        rows_k = [None if k is None else k[f:].detach().float() for k in cart.k]
        rows_v = [None if v is None else v[f:].detach().float() for v in cart.v]
        self.scale_k = [_channel_scale(r, scaled) for r in rows_k]
        self.scale_v = [_channel_scale(r, scaled) for r in rows_v]
        self.k = [None if r is None else (r / s).requires_grad_() for r, s in zip(rows_k, self.scale_k)]
        self.v = [None if r is None else (r / s).requires_grad_() for r, s in zip(rows_v, self.scale_v)]

    def params(self) -> list[torch.Tensor]:
        return [t for pair in zip(self.k, self.v) for t in pair if t is not None]

    def scales(self) -> list[torch.Tensor]:
        """The scales of `params()`, in its order."""
        return [s for k, pair in zip(self.k, zip(self.scale_k, self.scale_v)) if k is not None for s in pair]

    def set_scales(self, scales: Sequence[torch.Tensor]) -> None:
        it = iter(scales)
        for i, k in enumerate(self.k):
            if k is not None:
                self.scale_k[i], self.scale_v[i] = next(it), next(it)

    def full(self) -> tuple[list, list]:
        ks = [None if k is None else torch.cat([fk, k * s]) for fk, k, s in zip(self.frozen_k, self.k, self.scale_k)]
        vs = [None if v is None else torch.cat([fv, v * s]) for fv, v, s in zip(self.frozen_v, self.v, self.scale_v)]
        return ks, vs

    def cartridge(self, **kw) -> Cartridge:
        with torch.no_grad():
            ks, vs = self.full()
        c = self.cart
        return Cartridge([None if k is None else k.detach().clone() for k in ks],
                         [None if v is None else v.detach().clone() for v in vs],
                         c.geometry, c.identity, frozen=c.frozen, corpus=kw.get("corpus", c.corpus),
                         meta=kw.get("meta", dict(c.meta)))


def _channel_scale(rows: torch.Tensor | None, scaled: bool) -> torch.Tensor | None:
    """Per (head, channel) of rows [n, kv_head, d] -> [1, kv_head, d]: the power of two
    nearest the root-mean-square over the rows (a power of two, so rows / s * s gives the
    rows back bit for bit); ones when not scaled or where a channel is zero."""
    if rows is None:
        return None
    if not scaled or rows.shape[0] == 0:
        return torch.ones((1,) + tuple(rows.shape[1:]))
    rms = rows.pow(2).mean(0, keepdim=True).sqrt()
    return torch.where(rms > 0, torch.exp2(torch.round(torch.log2(rms.clamp_min(1e-30)))), torch.ones_like(rms))


class PrefixTrainCache(TrainCache):
    """The training stand-in cache with a prefix: a layer's rows are the cartridge's
    (positions 0..p-1) followed by the tokens' (p..)."""

    def __init__(self, model, capacity: int, ks: list, vs: list):
        super().__init__(model, capacity)
        self.prefix_k, self.prefix_v = ks, vs

    def span(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = self.source[layer]
        k, v = self.rows[src]
        k = torch.cat([self.prefix_k[src].to(k.dtype), k])
        v = torch.cat([self.prefix_v[src].to(v.dtype), v])
        return k[start:end], v[start:end]


def student_logprobs(model, ks: list, vs: list, ids: Sequence[int], rows: Sequence[int],
                     checkpoint: str = "auto") -> torch.Tensor:
    """log-softmax [len(rows), n_vocab] of the model reading `ids` at positions p.. behind
    the prefix rows (ks, vs per layer, p rows each; None for layers that alias another)."""
    p = next(k for k in ks if k is not None).shape[0]
    ids_t = torch.as_tensor(list(ids), dtype=torch.long)
    mode = checkpoint_mode(checkpoint, model, ids_t.numel())
    x = model.embed(ids_t).float()
    cache = PrefixTrainCache(model, p + ids_t.numel(), ks, vs)
    grad = torch.is_grad_enabled()
    for i in range(model.config.n_layer):
        if mode != "off" and grad:
            x = _segment(mode, model.block, i, x, cache, p)
        else:
            x = model.block(i, x, cache, p)
    h = x[torch.as_tensor(list(rows), dtype=torch.long)]
    return torch.log_softmax(model.head(h).float(), dim=-1)


def sample_loss(model, params: CartridgeParams, s: Sample, checkpoint: str = "auto",
                beside: tuple[Cartridge, bool] | None = None) -> torch.Tensor:
    """The sample's distillation loss behind the rows; `beside` (a cartridge, before?):
    the student reads that cartridge too, composed before or after the rows (its own
    rotations kept, the tokens after both), as serving a composition would."""
    ks, vs = params.full()
    if beside is not None:
        other, before = beside
        ks = [None if k is None else torch.cat([o, k] if before else [k, o]) for k, o in zip(ks, other.k)]
        vs = [None if v is None else torch.cat([o, v] if before else [v, o]) for v, o in zip(vs, other.v)]
    return distill_loss(student_logprobs(model, ks, vs, s.ids, s.rows, checkpoint), s.tokens, s.logprobs)


def distractor(cfg: SelfStudyConfig, v: int, n: int) -> tuple[int, bool] | None:
    """Visit v's distractor (which of n, and whether it goes before the rows), or None:
    a function of (seed, v) alone, so a run does not depend on how it is split."""
    if n == 0 or cfg.distract <= 0:
        return None
    rng = random.Random(mix64(cfg.seed, 0xD157, v))
    if rng.random() >= cfg.distract:
        return None
    return rng.randrange(n), rng.random() < 0.5


# -- self-study ----------------------------------------------------------------------------

class Trainable:
    """The model with every weight frozen for training (the trainer's frozen matmuls give
    the input gradients); generation keeps the native step. `close()` restores it."""

    def __init__(self, model):
        self.model = model
        layer_geometry(model)   # a model whose layers cannot hold rows fails here
        native = getattr(model, "use_native_step", True)
        self.lm = LoRAModel(model, LoRAConfig(), frozen_only=True)
        model.use_native_step = native   # generation: the plan (the wrappers are the same weights)

    def close(self) -> None:
        self.lm.detach()


def _lockstep(model, caches: list, logits: list, picks: list[Callable], stop: set[int], max_new: int,
              records: list[Callable] | None = None) -> list[list[int]]:
    """Decode every stream s from its `logits[s]` (its cache holding its prompt) until a
    stop id or `max_new` tokens, all live streams' next tokens forwarded as one batched
    step. `picks[s](logits, out)` chooses stream s's token; `records[s](logits)` sees
    every row stream s picks from. Returns each stream's tokens (no stop id)."""
    outs: list[list[int]] = [[] for _ in caches]
    live = list(range(len(caches)))
    while live:
        forward = []
        for s in live:
            if records is not None:
                records[s](logits[s])
            t = picks[s](logits[s], outs[s])
            if t in stop:
                continue
            outs[s].append(t)
            if len(outs[s]) < max_new:
                forward.append((s, t))
        if not forward:
            break
        if len(forward) == 1:
            s, t = forward[0]
            step = [model.forward_step(caches[s], [t], caches[s].len)]
        else:
            step = forward_step_batch(model, [caches[s] for s, _ in forward], [t for _, t in forward])
        for r, (s, _) in enumerate(forward):
            logits[s] = step[r]
        live = [s for s, _ in forward]
    return outs


def chunk_span(rng: random.Random, n_ids: int, n: int) -> tuple[int, int]:
    """A chunk of up to n of the corpus's n_ids tokens, [start, end). A window of n placed
    uniformly inside the corpus would show its first and last tokens in 1 chunk of
    n_ids - n + 1 against n for the middle (a 955-token document in 384-token chunks: its
    closing facts in 1% of the conversations); the window may instead hang up to half
    its length past either end (cut there), which gives every token at least half the
    middle's share."""
    if n >= n_ids:
        return 0, n_ids
    h = n // 2
    start = rng.randrange(-h, n_ids - n + h + 1)
    return max(0, start), min(n_ids, start + n)


#: frac(u0 + i * GOLDEN) for i = 0..n-1 splits [0, 1) into gaps of at most three sizes for
#: every n (the three-gap theorem): the first n conversations cover the range evenly
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def spread_draw(seed: int, i: int, n_kinds: int) -> tuple[float, int]:
    """Conversation i's chunk position u in [0, 1) and seed-prompt kind under `spread`: the
    i-th point of the golden-ratio sequence and the i-th kind in turn, from a start the
    seed picks (a function of (seed, i): a run that grows keeps its first conversations)."""
    run = random.Random(mix64(seed, 0x5B12))
    u0, k0 = run.random(), run.randrange(n_kinds)
    return (u0 + i * GOLDEN) % 1.0, (k0 + i) % n_kinds


def spread_span(u: float, n_ids: int, n: int) -> tuple[int, int]:
    """`chunk_span`'s window with its start at fraction u in [0, 1) of its range."""
    if n >= n_ids:
        return 0, n_ids
    h = n // 2
    lo, count = -h, n_ids - n + 2 * h + 1          # starts -h .. n_ids - n + h
    start = lo + min(count - 1, int(u * count))
    return max(0, start), min(n_ids, start + n)


class SelfStudy:
    """Makes the conversations of a run: conversation i depends only on (seed, i) and the
    model; `samples(indices)` generates several together (bitwise the same where the
    kernels are batch-invariant, see the module's note), `sample(i)` one."""

    def __init__(self, model, tokenizer, corpus: str, cfg: SelfStudyConfig, template=None):
        from fucina.text.chat_template import ChatTemplate

        self.model, self.tok, self.cfg = model, tokenizer, cfg
        self.template = template or ChatTemplate.from_metadata(model.gguf.metadata, tokenizer)
        self.ids = tokenizer.encode(corpus, add_special=False, parse_special=False)
        if not self.ids:
            raise CartridgeError("the corpus encodes to no tokens")
        self.stop = set(self.template.stop_ids(tokenizer)) | set(getattr(tokenizer, "eog_ids", ()) or ())
        self._invariant: bool | None = None
        if cfg.teacher not in ("chunk", "document"):
            raise CartridgeError(f"teacher must be 'chunk' or 'document', got {cfg.teacher!r}")
        self.document = {"role": "system", "content": DOCUMENT.format(document=corpus)}
        self._teacher_rows = None   # teacher="document": the cache rows every bot B prompt starts with

    def _prompt(self, msgs: list[dict]) -> list[int]:
        from fucina.text.chat_template import prompt_ids

        text = self.template.render(msgs, add_generation_prompt=True, enable_thinking=False)
        return prompt_ids(self.tok, text)

    def chunk(self, rng: random.Random) -> str:
        start, end = chunk_span(rng, len(self.ids), self.cfg.chunk_tokens)
        return self.tok.decode(self.ids[start:end])

    def chunk_and_kind(self, i: int, rng: random.Random) -> tuple[str, str]:
        """Conversation i's chunk and seed-prompt kind: drawn from its own rng, or with
        `spread` the i-th points of the run's golden-ratio sequence and the kinds in turn
        (from a start the seed picks)."""
        kinds = sorted(SEED_PROMPTS)
        if not self.cfg.spread:
            return self.chunk(rng), rng.choice(kinds)
        u, k = spread_draw(self.cfg.seed, i, len(kinds))
        start, end = spread_span(u, len(self.ids), self.cfg.chunk_tokens)
        return self.tok.decode(self.ids[start:end]), kinds[k]

    def teacher_cache(self, extra: int):
        """Under teacher="document", a cache holding the rows every bot B prompt starts
        with (the whole document, prefilled once per run) and room for `extra` more, and
        those rows' ids."""
        from fucina.text.generate import common_prefix, prefill

        if self._teacher_rows is None:
            one, two = (self._prompt([self.document, {"role": "user", "content": t}]) for t in ("a", "b"))
            ids = one[:common_prefix(one, two)]
            n_ctx = self.model.config.n_ctx_train
            if len(ids) + 1 > n_ctx:
                raise CartridgeError(f"teacher 'document': the document's prompt of {len(ids)} tokens does not "
                                     f"fit the model's context of {n_ctx} (teacher 'chunk' shows excerpts)")
            source, history = self.model.init_cache(len(ids) + 1), []
            prefill(self.model, source, history, ids)
            self._teacher_rows = (source, list(ids))
        source, ids = self._teacher_rows
        cache = self.model.init_cache(min(self.model.config.n_ctx_train, len(ids) + extra))
        cache.copy_rows(source, 0, len(ids))
        return cache, list(ids)

    def batch_invariant(self) -> bool:
        """Whether a batched step gives every row the bits of a single step here."""
        if self._invariant is None:
            from fucina.text.speculative.decoder import rows_invariant
            self._invariant = bool(getattr(self.model, "supports_batch", False)) and \
                rows_invariant(self.model, self.model.init_cache(4))
        return self._invariant

    def sample(self, i: int) -> Sample:
        return self.samples([i])[0]

    def samples(self, indices: Sequence[int]) -> list[Sample]:
        """Conversations `indices`, `cfg.batch` at a time (one at a time where a batched
        step is not bitwise a single one)."""
        n = max(1, self.cfg.batch) if self.batch_invariant() else 1
        out: list[Sample] = []
        idx = [int(i) for i in indices]
        for at in range(0, len(idx), n):
            out += self._generate(idx[at:at + n])
        return out

    def _follow(self, msgs: list[dict], ids: list[int], said: list[int], nxt: dict) -> tuple[list, list] | None:
        """The conversation `msgs` (prompted as `ids`) after the reply `said` and the next
        message `nxt`, as ids that keep `ids + said` as they are: the template's text after
        the reply is tokenized alone. None where the template does not render the reply
        verbatim after the prompt (the conversation then ends)."""
        text = self.tok.decode(said, skip_special=True)
        head = self.template.render(msgs, add_generation_prompt=True, enable_thinking=False) + text
        longer = msgs + [{"role": "assistant", "content": text}, nxt]
        full = self.template.render(longer, add_generation_prompt=True, enable_thinking=False)
        if not full.startswith(head):
            return None
        tail = self.tok.encode(full[len(head):], add_special=False, parse_special=True)
        return longer, ids + list(said) + tail

    @torch.inference_mode()
    def _generate(self, indices: list[int]) -> list[Sample]:
        """Conversations `indices` in lockstep: per turn, bot A's message (sampled, the
        chunk in context) then bot B's answer (greedy, the chunk in context; its rows are
        the teacher's targets); the student reads the turns without the chunk."""
        from fucina.text.generate import prefill
        from fucina.text.sampler import Sampler, SamplingConfig

        cfg, model = self.cfg, self.model
        n_ctx = model.config.n_ctx_train
        turns = max(1, cfg.turns)
        convs = []
        for i in indices:
            rng = random.Random(mix64(cfg.seed, 0xCA57, i))
            chunk, kind = self.chunk_and_kind(i, rng)
            sampler = Sampler(SamplingConfig(temperature=cfg.temperature, seed=rng.getrandbits(32)))
            system = {"role": "system", "content": SYSTEM.format(chunk=chunk)}
            a_msgs = [system, {"role": "user", "content": SEED_PROMPTS[kind]}]
            convs.append(_Conversation(kind, sampler, system, a_msgs, self._prompt(a_msgs)))
        # one cache per conversation, sized for its turns; bot A and bot B share the system rows
        # (teacher="chunk"), or bot B has its own cache that starts with the document's rows
        per_turn = cfg.max_question + cfg.max_answer + 64
        caches, histories = [], []
        for c in convs:
            cap = min(n_ctx, len(c.a_ids) + turns * per_turn)
            if len(c.a_ids) + cfg.max_question + 1 > cap:
                raise CartridgeError(f"a self-study prompt of {len(c.a_ids)} tokens does not fit the model's "
                                     f"context of {n_ctx} (a smaller --chunk)")
            caches.append(model.init_cache(cap))
            histories.append([])
        b_caches, b_histories = caches, histories
        if cfg.teacher == "document":
            b_caches, b_histories = [], []
            for _ in convs:
                cache, ids = self.teacher_cache(16 + turns * per_turn)
                b_caches.append(cache)
                b_histories.append(ids)
        live = list(range(len(convs)))
        for turn in range(turns):
            # bot A: the message
            later = (turns - 1 - turn) * per_turn   # what later turns add

            def fits(s: int, n: int, cs=caches, hs=histories) -> bool:
                """Make conversation s's cache hold n tokens (a bigger one if need be)."""
                if n > cs[s].capacity:
                    cs[s] = model.init_cache(min(n_ctx, n + later))
                    hs[s] = []
                return n <= cs[s].capacity
            live = [s for s in live if fits(s, len(convs[s].a_ids) + cfg.max_question + 1)]
            logits = [prefill(model, caches[s], histories[s], convs[s].a_ids)[0] for s in live]
            picks = [(lambda sm: (lambda lg, out: sm.next(lg, out)))(convs[s].sampler) for s in live]
            q_out = _lockstep(model, [caches[s] for s in live], logits, picks, self.stop, cfg.max_question)
            # bot B: the answer, greedy; the student's turn without the chunk
            answering = []
            for s, q_ids in zip(live, q_out):
                c = convs[s]
                question = self.tok.decode(q_ids, skip_special=True).strip() or "What does the document say?"
                answer = ANSWER_DOCUMENT if cfg.teacher == "document" else ANSWER
                ask_b = {"role": "user", "content": answer.format(question=question)}
                ask = {"role": "user", "content": question}
                if turn == 0:
                    teacher_system = self.document if cfg.teacher == "document" else c.system
                    c.b_msgs, c.s_msgs = [teacher_system, ask_b], [ask]
                    c.b_ids, c.s_ids = self._prompt(c.b_msgs), self._prompt(c.s_msgs)
                    c.question = question
                else:
                    b, st = self._follow(c.b_msgs, c.b_ids, c.said, ask_b), self._follow(c.s_msgs, c.s_ids, c.said, ask)
                    if b is None or st is None:
                        continue
                    (c.b_msgs, c.b_ids), (c.s_msgs, c.s_ids) = b, st
                if not fits(s, len(c.b_ids) + cfg.max_answer + 1, b_caches, b_histories):
                    if turn:
                        continue    # a later turn that does not fit ends the conversation
                    if len(c.b_ids) + 1 > b_caches[s].capacity:
                        raise CartridgeError(f"bot B's prompt of {len(c.b_ids)} tokens does not fit the "
                                             f"model's context of {n_ctx} (a smaller --chunk or --max-question)")
                c.q_ids = q_ids
                answering.append(s)
            logits = [prefill(model, b_caches[s], b_histories[s], convs[s].b_ids)[0] for s in answering]
            toks: list[list] = [[] for _ in answering]
            lps: list[list] = [[] for _ in answering]

            def recorder(r):
                def record(lg):
                    t, lp = teacher_topk(lg, cfg.top_k, cfg.mass)
                    toks[r].append(t)
                    lps[r].append(lp)
                return record
            greedy = [(lambda lg, out: int(lg.argmax())) for _ in answering]
            answers = _lockstep(model, [b_caches[s] for s in answering], logits, greedy, self.stop, cfg.max_answer,
                                [recorder(r) for r in range(len(answering))])
            live = []
            for r, (s, answer) in enumerate(zip(answering, answers)):
                c = convs[s]
                c.rows += [len(c.s_ids) - 1 + j for j in range(len(toks[r]))]
                c.tokens += toks[r]
                c.logprobs += lps[r]
                c.answers.append(self.tok.decode(answer, skip_special=True))
                c.turns += 1
                c.said = answer   # bot B's and the student's next turn follow it
                if turn + 1 < turns and len(toks[r]) > len(answer):   # answered within max_answer: ask again
                    nxt = self._follow(c.a_msgs, c.a_ids, c.q_ids, {"role": "user", "content": AGAIN + SEED_PROMPTS[c.kind]})
                    # bot A's next message: its own questions so far, never bot B's answers
                    if nxt is not None:
                        c.a_msgs, c.a_ids = nxt
                        live.append(s)
        return [Sample(c.s_ids + c.said, c.rows, c.tokens, c.logprobs, question=c.question, answer=c.answers[0],
                       kind=c.kind if c.turns == 1 else f"{c.kind} x{c.turns}") for c in convs]


@dataclass
class _Conversation:
    """One self-study conversation while it is made."""
    kind: str
    sampler: object
    system: dict
    a_msgs: list
    a_ids: list
    b_msgs: list = field(default_factory=list)
    b_ids: list = field(default_factory=list)
    s_msgs: list = field(default_factory=list)
    s_ids: list = field(default_factory=list)
    q_ids: list = field(default_factory=list)
    said: list = field(default_factory=list)     # bot B's last answer
    question: str = ""
    answers: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    turns: int = 0


def init_cartridge(model, tokenizer, corpus: str, cfg: SelfStudyConfig) -> Cartridge:
    """The starting rows: the model's own rows for the first p corpus tokens (as the
    serving side tokenizes a document: the model's BOS policy), or the random ablation."""
    ids = tokenizer.encode(corpus, add_special=True, parse_special=False)
    if cfg.p < 1:
        raise CartridgeError("p must be at least 1")
    if cfg.p >= model.config.n_ctx_train:
        raise CartridgeError(f"p = {cfg.p} does not fit the model's context of {model.config.n_ctx_train}")
    if len(ids) < cfg.p and cfg.init == "corpus":
        raise CartridgeError(f"the corpus has {len(ids)} tokens, fewer than p = {cfg.p} "
                             f"(a smaller --p, or --init random)")
    body = tokenizer.encode(corpus, add_special=False, parse_special=False) if cfg.embed_corpus else None
    cart = Cartridge.capture(model, ids[:cfg.p], frozen=cfg.frozen, corpus=body) if cfg.init == "corpus" or \
        len(ids) >= cfg.p else None
    if cfg.init == "random":
        cart = Cartridge.random(model, cfg.p, seed=cfg.seed, frozen=cfg.frozen, like=cart)
        cart.corpus = body
    elif cfg.init != "corpus":
        raise CartridgeError(f"unknown init {cfg.init!r} (corpus or random)")
    return cart


@dataclass
class Progress:
    done: int = 0                           # conversations consumed
    steps: int = 0
    losses: list = field(default_factory=list)   # per optimizer step: mean loss over its conversations
    seconds: float = 0.0


def _save_state(path: str, params: CartridgeParams, opt, prog: Progress, cfg: SelfStudyConfig) -> None:
    tmp = path + ".tmp"
    torch.save({"rows": [t.detach().clone() for t in params.params()], "scales": params.scales(),
                "optimizer": opt.state_dict(),
                "progress": asdict(prog), "config": asdict(cfg)}, tmp)
    os.replace(tmp, path)


def _load_state(path: str, params: CartridgeParams, opt, cfg: SelfStudyConfig) -> Progress:
    try:
        s = torch.load(path, map_location="cpu", weights_only=False)
        rows, saved = s["rows"], s["config"]
    except Exception as e:   # torch raises many types for a damaged file
        raise CartridgeError(f"cannot resume from {path}: {e}") from None
    saved = {**_BEFORE, **saved}   # a key an older checkpoint lacks had the value it had then
    diff = [f"{k} {saved.get(k)!r} vs {getattr(cfg, k)!r}" for k in _RESUME_KEYS if saved.get(k) != getattr(cfg, k)]
    if cfg.epochs > 1 and saved.get("conversations") != cfg.conversations:
        # later passes permute the conversations: a run of several passes cannot grow
        diff.append(f"conversations {saved.get('conversations')!r} vs {cfg.conversations!r} over {cfg.epochs} passes")
    if diff:
        raise CartridgeError(f"cannot resume from {path}: the setup differs ({'; '.join(diff)})")
    mine = params.params()
    if len(rows) != len(mine) or any(a.shape != b.shape for a, b in zip(rows, mine)):
        raise CartridgeError(f"cannot resume from {path}: its rows do not fit this model")
    scales = s.get("scales")
    if scales is not None and [t.shape for t in scales] != [t.shape for t in params.scales()]:
        raise CartridgeError(f"cannot resume from {path}: its scales do not fit this model")
    with torch.no_grad():
        for a, b in zip(mine, rows):
            a.copy_(b)
    if scales is not None:
        params.set_scales(scales)
    opt.load_state_dict(s["optimizer"])
    return Progress(**s["progress"])


def visit(cfg: SelfStudyConfig, v: int) -> int:
    """The conversation that visit v of a run trains on: pass 0 in order, every later pass
    a permutation of the conversations fixed by (seed, pass)."""
    n = cfg.conversations
    e, j = divmod(v, n)
    if e == 0:
        return j
    order = list(range(n))
    random.Random(mix64(cfg.seed, 0xE90C, e)).shuffle(order)
    return order[j]


def optimize(model, params: CartridgeParams, samples: Callable[[int], Sample], cfg: SelfStudyConfig, *,
             opt=None, prog: Progress | None = None, state_path: str | None = None,
             log: Callable[[str], None] = lambda s: None, on_step: Callable[[Progress], None] | None = None,
             many: Callable[[list[int]], list[Sample]] | None = None, ahead: int = 1,
             until: int | None = None, pool: dict[int, Sample] | None = None,
             distractors: Sequence[Cartridge] = ()) -> Progress:
    """Adam steps over visits prog.done.. `until` (default all: cfg.conversations x
    cfg.epochs; visit v trains on conversation `visit(cfg, v)`), `accum` per step (the
    last step may take fewer); the state is written to `state_path` after each.
    `many(indices)`, when given, makes conversations `ahead` at a time (batched
    generation; a conversation is the same whichever batch makes it). `pool` keeps the
    conversations made for later passes (a conversation is made once per run).
    `distractors`: cartridges a visit's student may read beside the rows (`distractor`)."""
    opt = opt or _adam(params, cfg)
    prog = prog or Progress()
    total = cfg.conversations * max(1, cfg.epochs)
    until = total if until is None else min(until, total)
    pool = {} if pool is None else pool
    last = (max(1, cfg.epochs) - 1) * cfg.conversations   # visits from here on are each conversation's last
    while prog.done < until:
        t0 = time.perf_counter()
        visits = range(prog.done, min(prog.done + cfg.accum, until))
        group = [visit(cfg, v) for v in visits]
        if any(i not in pool for i in group):
            if many is not None:
                todo = [visit(cfg, v) for v in range(visits[0], min(visits[0] + max(ahead, len(group)), until))]
                todo = sorted({i for i in todo if i not in pool})
                pool.update(zip(todo, many(todo)))
            for i in group:
                if i not in pool:
                    pool[i] = samples(i)
        got = [pool.pop(i) if v >= last else pool[i] for v, i in zip(visits, group)]
        t_gen = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        total_loss = 0.0
        for v, s in zip(visits, got):
            d = distractor(cfg, v, len(distractors))
            beside = None if d is None else (distractors[d[0]], d[1])
            loss = sample_loss(model, params, s, cfg.checkpoint, beside)
            (loss / len(got)).backward()
            total_loss += float(loss.detach())
        if cfg.decay:   # linear to zero over the run's steps: the last steps move the rows least
            for g in opt.param_groups:
                g["lr"] = cfg.lr * (1 - prog.steps / -(-total // cfg.accum))
        opt.step()
        prog.done += len(got)
        prog.steps += 1
        prog.losses.append(total_loss / len(got))
        dt = time.perf_counter() - t0
        prog.seconds += dt
        if state_path:
            _save_state(state_path, params, opt, prog, cfg)
        if on_step is not None:
            on_step(prog)
        log(f"step {prog.steps}: {prog.done}/{total} conversations (pass {(prog.done - 1) // cfg.conversations + 1}"
            f"/{max(1, cfg.epochs)}), loss {prog.losses[-1]:.4f}, "
            f"{dt:.1f} s ({t_gen:.1f} s self-study), total {prog.seconds / 60:.1f} min; "
            f"[{got[0].kind}] {got[0].question[:70]!r} -> {got[0].answer[:70]!r}")
    return prog


def _adam(params: CartridgeParams, cfg: SelfStudyConfig):
    return torch.optim.Adam(params.params(), lr=cfg.lr)


class CartridgeRun:
    """One cartridge's training: its rows, Adam and progress, written to OUT (the
    cartridge) and OUT.ckpt (what a resume needs) after every step. `start`: begin from
    these rows (a cartridge file reloaded) instead of initialising from the corpus.
    `advance(n)` trains up to n visits (conversations, counted once per pass; the model
    must be wrapped in a Trainable)."""

    def __init__(self, model, tokenizer, corpus: str, cfg: SelfStudyConfig, *, out: str | None = None,
                 resume: bool = False, start: Cartridge | None = None, log: Callable[[str], None] = lambda s: None,
                 save_passes: bool = False, distractors: Sequence[Cartridge] = ()):
        if cfg.accum < 1 or cfg.conversations < 1 or cfg.lr <= 0:
            raise CartridgeError("--accum and --conversations must be >= 1 and --lr positive")
        self.model, self.cfg, self.out, self.log = model, cfg, out, log
        self.save_passes = save_passes and out is not None   # OUT.passK.safetensors after each pass too
        self.cart = start if start is not None else init_cartridge(model, tokenizer, corpus, cfg)
        for d in distractors:
            if d.identity != self.cart.identity or [tuple(g) for g in d.geometry] != \
                    [tuple(g) for g in self.cart.geometry]:
                raise CartridgeError("a distractor cartridge was made for another model or geometry")
        if cfg.distract > 0 and not distractors:
            raise CartridgeError("--distract needs distractor cartridges (or documents) to mix in")
        self.distractors = [Cartridge([None if k is None else k.detach().float() for k in d.k],
                                      [None if v is None else v.detach().float() for v in d.v],
                                      d.geometry, d.identity, frozen=d.frozen) for d in distractors]
        self.study = SelfStudy(model, tokenizer, corpus, cfg)
        self.params = CartridgeParams(self.cart, cfg.scaled)
        self.opt = _adam(self.params, cfg)
        self.pool: dict[int, Sample] = {}   # conversations kept for the run's later passes
        self.state_path = out + ".ckpt" if out else None
        self.prog = Progress()
        if resume:
            if not self.state_path or not os.path.exists(self.state_path):
                raise CartridgeError(f"nothing to resume: {self.state_path} does not exist")
            self.prog = _load_state(self.state_path, self.params, self.opt, cfg)

    def nbytes(self) -> int:
        """RAM the run holds: the rows, their gradients and Adam's two moments (f32)."""
        train = sum(t.numel() for t in self.params.params())
        frozen = sum(t.numel() for t in self.params.frozen_k + self.params.frozen_v if t is not None)
        return 4 * (4 * train + frozen)

    def result(self) -> Cartridge:
        cfg, prog = self.cfg, self.prog
        meta = dict(self.cart.meta, conversations=prog.done, steps=prog.steps, seed=cfg.seed, lr=cfg.lr,
                    init=cfg.init, losses=[round(x, 5) for x in prog.losses], train_s=round(prog.seconds, 1))
        return self.params.cartridge(meta=meta)

    def total(self) -> int:
        """The run's visits: every conversation once per pass."""
        return self.cfg.conversations * max(1, self.cfg.epochs)

    def pass_path(self, k: int) -> str:
        """Where `save_passes` writes the cartridge after pass k: OUT.passK.safetensors."""
        stem = self.out[:-len(".safetensors")] if self.out.endswith(".safetensors") else self.out
        return f"{stem}.pass{k}.safetensors"

    def _saved(self, prog: Progress) -> None:
        cart = self.result()
        cart.save(self.out)
        if self.save_passes and prog.done % self.cfg.conversations == 0:
            cart.save(self.pass_path(prog.done // self.cfg.conversations))

    def advance(self, until: int) -> Progress:
        until = min(until, self.total())
        if self.prog.done < until:
            # OUT after every step too: an interrupted run leaves a usable cartridge
            self.prog = optimize(self.model, self.params, self.study.sample, self.cfg,
                                 opt=self.opt, prog=self.prog, state_path=self.state_path, log=self.log,
                                 on_step=self._saved if self.out else None,
                                 many=self.study.samples, ahead=max(self.cfg.batch, self.cfg.accum),
                                 until=until, pool=self.pool, distractors=self.distractors)
        return self.prog


def train_cartridge(model, tokenizer, corpus: str, cfg: SelfStudyConfig, *, out: str | None = None,
                    resume: bool = False, log: Callable[[str], None] = lambda s: None,
                    save_passes: bool = False, distractors: Sequence[Cartridge] = ()) -> Cartridge:
    """Initialise, self-study, save (OUT, with OUT.ckpt holding what a resume needs;
    `save_passes`: also OUT.passK.safetensors after every pass K; `distractors`: what
    `cfg.distract` mixes in)."""
    run = CartridgeRun(model, tokenizer, corpus, cfg, out=out, resume=resume, log=log, save_passes=save_passes,
                       distractors=distractors)
    if resume:
        log(f"resuming after {run.prog.done} conversations ({run.prog.steps} steps)")
    trainable = Trainable(model)
    try:
        log(f"cartridge: p {cfg.p} ({run.cart.nbytes() / 1e6:.2f} MB f16 KV), {cfg.conversations} conversations "
            f"of {cfg.turns} turn(s), {cfg.epochs} pass(es), {cfg.accum} per step, lr {cfg.lr}"
            f"{' in channel units' if cfg.scaled else ''}{', decaying' if cfg.decay else ''}"
            f"{f', a distractor beside {cfg.distract:.0%} of visits' if run.distractors and cfg.distract else ''}, corpus {len(run.study.ids)} tokens, generated "
            f"{cfg.batch if run.study.batch_invariant() else 1} at a time")
        run.advance(run.total())
    finally:
        trainable.close()
    final = run.result()
    if out:
        final.save(out)
    return final
