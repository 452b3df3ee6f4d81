"""Training a cartridge by self-study (Cartridges, arXiv 2506.06266, Sec. 4 with k = 1).

The model stays frozen (its quantized weights, through the trainer's frozen matmuls);
the cartridge's rows past its frozen sink are the only parameters. One self-study
conversation:
1. a random span of the corpus (the chunk) and a seed prompt, which gives the FORM of a
   message (a question, a summary request, ...), never its content: the chunk is what
   the message is about, so the teacher can always answer from what it sees;
2. bot A, the model with the chunk in its system message, writes that message
   (temperature 0.6);
3. bot B, the model with the chunk in context, answers greedily; its log-probabilities
   at each answer position, top-k until 0.99 of the mass, are the targets;
4. the student, the model behind the cartridge WITHOUT the chunk, reads the message and
   the answer; the loss is the top-k distillation cross-entropy (forward KL up to the
   teacher's constant entropy; the truncated tail is dropped, not renormalised), the
   mean over answer positions.
Adam over `accum` conversations per step. Conversation i is a pure function of (seed, i)
and the frozen model, and the optimizer state is checkpointed after every step, so a
run is deterministic for a seed (same thread count) and resumes where it stopped.

The student forward is the families' own torch blocks at positions p.. over a stand-in
cache whose rows are the cartridge's followed by the tokens' (`PrefixTrainCache`): the
attention mask is the usual causal one from pos0 = p, so every token sees the whole
prefix, and the gradient reaches the rows through the attention.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from fucina.errors import CartridgeError
from fucina.models.cartridge import Cartridge, layer_geometry
from fucina.train.forward import TrainCache, _segment, checkpoint_mode
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
ANSWER_SYSTEM = ("Answer using the following excerpt of a document. Be brief and exact.\n\n{chunk}")


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


# what must match between a checkpoint and the run resuming it (conversations may grow)
_RESUME_KEYS = ("p", "accum", "lr", "seed", "chunk_tokens", "max_question", "max_answer", "top_k",
                "mass", "temperature", "init", "frozen")


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
    rows as constants and the rest as leaf tensors (`params()`)."""

    def __init__(self, cart: Cartridge):
        self.cart = cart
        f = cart.frozen
        self.frozen_k = [None if k is None else k[:f].detach().float() for k in cart.k]
        self.frozen_v = [None if v is None else v[:f].detach().float() for v in cart.v]
        self.k = [None if k is None else k[f:].detach().float().clone().requires_grad_() for k in cart.k]
        self.v = [None if v is None else v[f:].detach().float().clone().requires_grad_() for v in cart.v]

    def params(self) -> list[torch.Tensor]:
        return [t for pair in zip(self.k, self.v) for t in pair if t is not None]

    def full(self) -> tuple[list, list]:
        ks = [None if k is None else torch.cat([fk, k]) for fk, k in zip(self.frozen_k, self.k)]
        vs = [None if v is None else torch.cat([fv, v]) for fv, v in zip(self.frozen_v, self.v)]
        return ks, vs

    def cartridge(self, **kw) -> Cartridge:
        ks, vs = self.full()
        c = self.cart
        return Cartridge([None if k is None else k.detach().clone() for k in ks],
                         [None if v is None else v.detach().clone() for v in vs],
                         c.geometry, c.identity, frozen=c.frozen, corpus=kw.get("corpus", c.corpus),
                         meta=kw.get("meta", dict(c.meta)))


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


def sample_loss(model, params: CartridgeParams, s: Sample, checkpoint: str = "auto") -> torch.Tensor:
    ks, vs = params.full()
    return distill_loss(student_logprobs(model, ks, vs, s.ids, s.rows, checkpoint), s.tokens, s.logprobs)


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


def _decode(model, ids: list[int], max_new: int, pick: Callable, stop: set[int],
            record: Callable | None = None) -> list[int]:
    cache = model.init_cache(len(ids) + max_new + 1)
    logits = model.forward_step(cache, ids, 0)
    out: list[int] = []
    while True:
        if record is not None:
            record(logits)
        t = pick(logits, out)
        if t in stop:
            break
        out.append(t)
        if len(out) >= max_new:
            break
        logits = model.forward_step(cache, [t], cache.len)
    return out


class SelfStudy:
    """Makes the conversations of a run: `sample(i)` depends only on (seed, i) and the model."""

    def __init__(self, model, tokenizer, corpus: str, cfg: SelfStudyConfig, template=None):
        from fucina.text.chat_template import ChatTemplate

        self.model, self.tok, self.cfg = model, tokenizer, cfg
        self.template = template or ChatTemplate.from_metadata(model.gguf.metadata, tokenizer)
        self.ids = tokenizer.encode(corpus, add_special=False, parse_special=False)
        if not self.ids:
            raise CartridgeError("the corpus encodes to no tokens")
        self.stop = set(self.template.stop_ids(tokenizer)) | set(getattr(tokenizer, "eog_ids", ()) or ())

    def _prompt(self, msgs: list[dict]) -> list[int]:
        from fucina.text.chat_template import prompt_ids

        text = self.template.render(msgs, add_generation_prompt=True, enable_thinking=False)
        return prompt_ids(self.tok, text)

    def chunk(self, rng: random.Random) -> str:
        n = min(self.cfg.chunk_tokens, len(self.ids))
        start = rng.randrange(0, len(self.ids) - n + 1)
        return self.tok.decode(self.ids[start:start + n])

    @torch.inference_mode()
    def sample(self, i: int) -> Sample:
        from fucina.text.sampler import Sampler, SamplingConfig

        cfg = self.cfg
        rng = random.Random(mix64(cfg.seed, 0xCA57, i))
        chunk = self.chunk(rng)
        kind = rng.choice(sorted(SEED_PROMPTS))
        sampler = Sampler(SamplingConfig(temperature=cfg.temperature, seed=rng.getrandbits(32)))
        a_ids = self._prompt([{"role": "system", "content": SYSTEM.format(chunk=chunk)},
                              {"role": "user", "content": SEED_PROMPTS[kind]}])
        q_ids = _decode(self.model, a_ids, cfg.max_question, lambda lg, out: sampler.next(lg, out), self.stop)
        question = self.tok.decode(q_ids, skip_special=True).strip() or "What does the document say?"
        b_ids = self._prompt([{"role": "system", "content": ANSWER_SYSTEM.format(chunk=chunk)},
                              {"role": "user", "content": question}])
        toks, lps = [], []

        def record(logits):
            t, lp = teacher_topk(logits, cfg.top_k, cfg.mass)
            toks.append(t)
            lps.append(lp)

        answer = _decode(self.model, b_ids, cfg.max_answer, lambda lg, out: int(lg.argmax()), self.stop, record)
        s_ids = self._prompt([{"role": "user", "content": question}])
        rows = [len(s_ids) - 1 + j for j in range(len(toks))]
        return Sample(s_ids + answer, rows, toks, lps, question=question,
                      answer=self.tok.decode(answer, skip_special=True), kind=kind)


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
    torch.save({"rows": [t.detach().clone() for t in params.params()], "optimizer": opt.state_dict(),
                "progress": asdict(prog), "config": asdict(cfg)}, tmp)
    os.replace(tmp, path)


def _load_state(path: str, params: CartridgeParams, opt, cfg: SelfStudyConfig) -> Progress:
    try:
        s = torch.load(path, map_location="cpu", weights_only=False)
        rows, saved = s["rows"], s["config"]
    except Exception as e:   # torch raises many types for a damaged file
        raise CartridgeError(f"cannot resume from {path}: {e}") from None
    diff = [f"{k} {saved.get(k)!r} vs {getattr(cfg, k)!r}" for k in _RESUME_KEYS if saved.get(k) != getattr(cfg, k)]
    if diff:
        raise CartridgeError(f"cannot resume from {path}: the setup differs ({'; '.join(diff)})")
    mine = params.params()
    if len(rows) != len(mine) or any(a.shape != b.shape for a, b in zip(rows, mine)):
        raise CartridgeError(f"cannot resume from {path}: its rows do not fit this model")
    with torch.no_grad():
        for a, b in zip(mine, rows):
            a.copy_(b)
    opt.load_state_dict(s["optimizer"])
    return Progress(**s["progress"])


def optimize(model, params: CartridgeParams, samples: Callable[[int], Sample], cfg: SelfStudyConfig, *,
             opt=None, prog: Progress | None = None, state_path: str | None = None,
             log: Callable[[str], None] = lambda s: None, on_step: Callable[[Progress], None] | None = None
             ) -> Progress:
    """Adam steps over conversations prog.done.. cfg.conversations, `accum` per step
    (the last step may take fewer); the state is written to `state_path` after each."""
    opt = opt or torch.optim.Adam(params.params(), lr=cfg.lr)
    prog = prog or Progress()
    while prog.done < cfg.conversations:
        t0 = time.perf_counter()
        group = list(range(prog.done, min(prog.done + cfg.accum, cfg.conversations)))
        got = [samples(i) for i in group]
        t_gen = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for s in got:
            loss = sample_loss(model, params, s, cfg.checkpoint)
            (loss / len(got)).backward()
            total += float(loss.detach())
        opt.step()
        prog.done += len(got)
        prog.steps += 1
        prog.losses.append(total / len(got))
        dt = time.perf_counter() - t0
        prog.seconds += dt
        if state_path:
            _save_state(state_path, params, opt, prog, cfg)
        if on_step is not None:
            on_step(prog)
        log(f"step {prog.steps}: conversations {prog.done}/{cfg.conversations}, loss {prog.losses[-1]:.4f}, "
            f"{dt:.1f} s ({t_gen:.1f} s self-study), total {prog.seconds / 60:.1f} min; "
            f"[{got[0].kind}] {got[0].question[:70]!r} -> {got[0].answer[:70]!r}")
    return prog


def train_cartridge(model, tokenizer, corpus: str, cfg: SelfStudyConfig, *, out: str | None = None,
                    resume: bool = False, log: Callable[[str], None] = lambda s: None) -> Cartridge:
    """Initialise, self-study, save (OUT, with OUT.ckpt holding what a resume needs)."""
    if cfg.accum < 1 or cfg.conversations < 1 or cfg.lr <= 0:
        raise CartridgeError("--accum and --conversations must be >= 1 and --lr positive")
    cart = init_cartridge(model, tokenizer, corpus, cfg)
    study = SelfStudy(model, tokenizer, corpus, cfg)
    trainable = Trainable(model)
    try:
        params = CartridgeParams(cart)
        opt = torch.optim.Adam(params.params(), lr=cfg.lr)
        state_path = out + ".ckpt" if out else None
        prog = None
        if resume:
            if not state_path or not os.path.exists(state_path):
                raise CartridgeError(f"nothing to resume: {state_path} does not exist")
            prog = _load_state(state_path, params, opt, cfg)
            log(f"resuming after {prog.done} conversations ({prog.steps} steps)")
        log(f"cartridge: p {cfg.p} ({cart.nbytes() / 1e6:.2f} MB f16 KV), {cfg.conversations} conversations, "
            f"{cfg.accum} per step, lr {cfg.lr}, corpus {len(study.ids)} tokens")

        def result(prog: Progress) -> Cartridge:
            meta = dict(cart.meta, conversations=prog.done, steps=prog.steps, seed=cfg.seed, lr=cfg.lr,
                        init=cfg.init, losses=[round(x, 5) for x in prog.losses], train_s=round(prog.seconds, 1))
            return params.cartridge(meta=meta)

        # OUT after every step too: an interrupted run leaves a usable cartridge
        prog = optimize(model, params, study.sample, cfg, opt=opt, prog=prog, state_path=state_path, log=log,
                        on_step=(lambda pr: result(pr).save(out)) if out else None)
    finally:
        trainable.close()
    final = result(prog)
    if out:
        final.save(out)
    return final
