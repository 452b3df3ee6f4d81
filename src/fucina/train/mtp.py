"""`fucina mtp train`: a multi-token-prediction head for a model that ships none, trained by
self-distillation on a CPU (no dataset needed).

1. Data: the frozen model's own greedy continuations of varied prompts (chat-templated on an
   instruct model): the built-in set, then requests made of a form and a topic, hundreds of
   distinct openings (`--data`: one prompt a line instead), so the head learns what this
   model will say, which is what a draft must guess.
2. Targets: one trunk pass over each sequence gives every position's last hidden row and
   greedy token; the head's entry q reads the token x_q and the trunk's state at q - 1 and
   is trained to give the trunk's greedy token after q (x_{q+1} in the reply, what the
   model would have said on the prompt; cross-entropy over the draft vocabulary: the most
   frequent of those tokens) and to reproduce the trunk's own state at q (smooth L1: the
   state it hands the next draft step when drafts chain, EAGLE's feature loss). One
   sequence in HELD_OUT is held out; the head written is the one most accurate on those.
3. The head: the NextN shape (models/mtp.py), its block the family's own layer code run
   through the training stand-in cache (train/forward.py), initialised from the trunk's
   last layer with eh_proj passing the state through, so it starts as "one more layer".
4. Export: a head GGUF (arch `fucina-mtp`, the model's width, vocabulary, layer index and
   draft vocabulary as keys; matrices Q8_0, vectors F32), loaded by `--mtp HEAD.gguf`.
Families whose layer is llama-shaped (llama, qwen2, qwen3, gemma3) are supported.
"""
from __future__ import annotations

import copy
import math
import os
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from fucina.errors import FucinaError
from fucina.gguf import GGMLType
from fucina.models import llama
from fucina.models.base import Rope, rms_norm
from fucina.models.schema import mtp as keys
from fucina.models.schema.mtp import NEXTN
from fucina.weights import LinearWeight

PROMPTS = (
    "Write a short story about a baker who discovers an old family recipe.",
    "Explain how photosynthesis works, step by step.",
    "What are the main causes of inflation? Explain simply.",
    "Write a poem about the sea at night.",
    "Describe the water cycle to a ten-year-old.",
    "Give me five tips for learning a new language.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Tell me a story about a robot who wants to become a painter.",
    "Summarize the plot of a detective novel you invent.",
    "How does a car engine work?",
    "Explain what a black hole is.",
    "Write a friendly email inviting a colleague to lunch.",
    "What is the history of the printing press?",
    "Describe a day in the life of a medieval farmer.",
    "Explain recursion with an example.",
    "Why is the sky blue?",
    "Write a recipe for a simple vegetable soup.",
    "What are the benefits of regular exercise?",
    "Tell me about the planets of the solar system.",
    "Write a dialogue between a cat and a dog.",
    "Explain how the internet works.",
    "Give advice to someone starting their first job.",
    "Describe your favourite city and why people should visit it.",
    "Explain the rules of chess briefly.",
    "Write a fairy tale about a brave little mouse.",
    "What is machine learning? Explain it in plain words.",
    "How do vaccines work?",
    "Write a product description for a new smartphone.",
    "Explain why we have seasons on Earth.",
    "Write a short essay about friendship.",
    "Describe how to plant a tree.",
)
# beyond PROMPTS, requests made of a form and a topic: hundreds of distinct openings, so a head
# sees replies to prompts it was not trained on the way it will when serving
FORMS = (
    "Explain {t} in simple terms.", "Write a short story that involves {t}.", "Give me three facts about {t}.",
    "What should a beginner know about {t}?", "Write a short poem about {t}.", "Describe {t} in a few paragraphs.",
    "What are the pros and cons of {t}?", "Write a blog post introduction about {t}.",
    "How would you teach a child about {t}?", "Summarize the history of {t}.",
    "Write a list of questions people often ask about {t}, with short answers.",
    "Compare {t} with something similar and explain the differences.",
)
TOPICS = (
    "volcanoes", "the moon landing", "honey bees", "compound interest", "the Roman empire", "rainbows",
    "electric cars", "coffee", "the human heart", "glaciers", "chess openings", "public libraries", "bread baking",
    "solar panels", "the stock market", "octopuses", "sleep", "the French revolution", "climate change",
    "video games", "the immune system", "bicycles", "recycling", "jazz music", "earthquakes", "the internet of things",
    "dinosaurs", "meditation", "airplanes", "the Great Wall of China", "tea ceremonies", "gardening", "money",
    "electricity", "the Olympic games", "deserts", "sorting algorithms", "a dragon", "a time traveller",
    "a lost dog", "a small village", "a haunted house", "a pirate ship", "a space station", "a detective",
    "a music teacher", "a mountain climber", "databases", "the piano", "photography", "rivers", "birds migrating",
    "the printing of books", "friendship", "remote work", "museums", "the water in the ocean", "trains", "cheese",
    "the brain", "a football match", "a wedding", "winter holidays", "the rain forest", "Python decorators",
    "HTTP requests", "unit testing", "spreadsheets", "a bakery", "the postal service", "languages", "whales",
    "mathematics", "gravity", "magnets", "a market in the morning", "cooking pasta", "running a marathon",
)
# the layer tensors a llama-shaped layer holds, by schema key: the Layer attribute, or the
# fused weight and the part it is (qkv: q, k, v rows; gate_up: halves)
SIMPLE = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
          "post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_ffn_norm", "attn_output": "wo",
          "ffn_down": "down"}
QKV = ("attn_q", "attn_k", "attn_v")
BATCH = 8     # self-distilled streams decoded in lockstep
HELD_OUT = 8  # one sequence in this many is held out: the head kept is the one best on them
EVAL_EVERY = 25


@dataclass
class TrainOptions:
    steps: int = 600                 # optimizer steps (one sequence each)
    sequences: int = 48              # self-distilled sequences
    tokens: int = 160                # generated tokens per sequence
    lr: float = 1e-3
    seed: int = 0
    draft_vocab: int = 8192          # tokens the head scores (the continuations' most frequent)
    feature_weight: float = 1.0
    prompts: Sequence[str] = PROMPTS
    log: Callable[[str], None] | None = None
    stats: dict = field(default_factory=dict)


class Param:
    """A trainable matrix standing in for a LinearWeight in the family's layer code."""

    def __init__(self, w: torch.Tensor):
        self.w = torch.nn.Parameter(w.float().clone())

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)

    __call__ = linear


def layer_values(model, layer) -> dict[str, torch.Tensor]:
    """A llama-shaped layer's tensors as f32, by schema key (fused weights split)."""
    out: dict[str, torch.Tensor] = {}
    def val(w):
        return w.w.detach() if isinstance(w, Param) else w.dequantize() if isinstance(w, LinearWeight) else w.detach()
    for key, attr in SIMPLE.items():
        w = getattr(layer, attr, None)
        if w is not None:
            out[key] = val(w)
    if layer.wqkv is not None:
        parts = val(layer.wqkv).split(layer.split_qkv, dim=0)
    else:
        parts = [val(w) for w in (layer.wq, layer.wk, layer.wv)]
    out.update(zip(QKV, parts))
    if layer.bqkv is not None:
        out.update({f"{n}_bias": b for n, b in zip(QKV, val(layer.bqkv).split(layer.split_qkv))})
    if layer.w_gate_up is not None:
        out["ffn_gate"], out["ffn_up"] = val(layer.w_gate_up).chunk(2, dim=0)
    else:
        out["ffn_gate"], out["ffn_up"] = val(layer.gate), val(layer.up)
    return out


def check_family(model) -> None:
    names = {t.name for t in model.schema.tensors}
    if type(model).block is not llama.Model.block or not isinstance(model.layers[-1], llama.Layer) \
            or "ffn_gate_inp" in names or "attn_qkv" in names or "ffn_gate" not in names:
        raise FucinaError(f"mtp train: the {model.config.arch} family's layer is not llama-shaped "
                          f"(supported: llama, qwen2, qwen3, gemma3)")


def write_head(model, values: dict[str, torch.Tensor], out: str | os.PathLike, draft_vocab: Sequence[int] | None,
               quantize: bool = True) -> None:
    """A head GGUF: the model's keys, layer `model.config.n_layer`'s tensors and the NextN ones."""
    import gguf

    from fucina.train.export import _add_encoded

    c, i = model.config, model.config.n_layer
    tmp = f"{out}.tmp"
    w = gguf.GGUFWriter(tmp, keys.HEAD_ARCH)
    w.add_string(keys.KEY_BASE_ARCH, c.arch)
    w.add_uint32(keys.KEY_N_EMBD, c.n_embd)
    w.add_uint32(keys.KEY_N_VOCAB, c.n_vocab)
    w.add_uint32(keys.KEY_BLOCK, i)
    if draft_vocab is not None:
        w.add_array(keys.KEY_DRAFT_VOCAB, [int(t) for t in draft_vocab])
    specs = [s for s in model.schema.tensors if s.key in values] + [s for s in NEXTN if s.key in values]
    for s in specs:
        v = values[s.key].detach().float().contiguous()
        qt = GGMLType.Q8_0 if quantize and v.dim() == 2 and v.shape[-1] % 32 == 0 else GGMLType.F32
        _add_encoded(w, s.gguf_name(i), v, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)


def initial_values(model) -> dict[str, torch.Tensor]:
    """The trunk's last layer, eh_proj = [0 | I] (the state passes through), unit norms."""
    c = model.config
    v = layer_values(model, model.layers[-1])
    v["nextn.eh_proj"] = torch.cat([torch.zeros(c.n_embd, c.n_embd), torch.eye(c.n_embd)], dim=1)
    v["nextn.enorm"] = torch.ones(c.n_embd)
    v["nextn.hnorm"] = torch.ones(c.n_embd)
    return v


def self_distill(llm, opts: TrainOptions) -> list[list[int]]:
    """Token sequences: each prompt (templated when the model has a chat template; after the
    first round, opened with one sampled token for variety) and the model's greedy
    continuation of it, BATCH streams decoded in lockstep (one weight pass for all)."""
    from fucina.text.batch import generate_batch
    from fucina.text.sampler import Sampler, SamplingConfig

    rng = random.Random(opts.seed)
    prompts = list(opts.prompts)
    rng.shuffle(prompts)
    if opts.prompts is PROMPTS:
        made = [f.format(t=t) for f in FORMS for t in TOPICS]
        rng.shuffle(made)
        prompts += made
    starts = []
    for n in range(opts.sequences):
        p = prompts[n % len(prompts)]
        if llm.has_chat_template:
            ids = llm.tokenizer.encode(llm.template.render([{"role": "user", "content": p}], add_generation_prompt=True),
                                       add_special=False, parse_special=True)
        else:
            ids = llm.tokenize(p)
        if n >= len(prompts):
            llm.generate(ids, max_tokens=1, temperature=1.0, seed=opts.seed + n)
            ids = ids + list(llm.last.tokens)
        starts.append(ids)
    seqs: list[list[int]] = []
    stop = list(getattr(llm.tokenizer, "eog_ids", ()) or ())
    for at in range(0, len(starts), BATCH):
        group = starts[at:at + BATCH]
        replies = generate_batch(llm.model, llm.tokenizer, group, [Sampler(SamplingConfig()) for _ in group],
                                 max_tokens=opts.tokens, stop_ids=stop)
        seqs += [ids + list(r.tokens) for ids, r in zip(group, replies)]
        if opts.log:
            opts.log(f"sequences {len(seqs)}/{len(starts)}: {sum(len(q) for q in seqs)} tokens")
    return seqs


class HeadTrainer:
    def __init__(self, model, opts: TrainOptions, seqs: list[list[int]]):
        from fucina.models.mtp import load_head

        check_family(model)
        self.model, self.opts = model, opts
        c = model.config
        traced = [self._trace(s) for s in seqs if len(s) >= 3]
        counts = Counter(int(t) for _, _, greedy in traced for t in greedy)
        vocab = [t for t, _ in counts.most_common(opts.draft_vocab)]
        self.vocab = torch.tensor(sorted(vocab), dtype=torch.long)
        self.remap = torch.full((c.n_vocab,), -100, dtype=torch.long)
        self.remap[self.vocab] = torch.arange(len(self.vocab))
        d = tempfile.mkdtemp(prefix="fucina-mtp-")
        init = os.path.join(d, "init.gguf")
        write_head(model, initial_values(model), init, self.vocab.tolist(), quantize=False)
        self.head = load_head(model, init)
        self.head.block.native_plan = None
        for name, value in list(vars(self.head.block).items()):   # tables of its own, made outside inference mode
            if isinstance(value, Rope):
                own = copy.copy(value)
                own.cis = own.cis[:0].clone()
                setattr(self.head.block, name, own)
        layer = self.head.block.layers[0]
        self.params: list[torch.nn.Parameter] = []
        for name, value in list(vars(layer).items()):
            if isinstance(value, LinearWeight):
                p = Param(value.dequantize())
                setattr(layer, name, p)
                self.params.append(p.w)
            elif isinstance(value, torch.Tensor) and value.is_floating_point():
                p = torch.nn.Parameter(value.clone())
                setattr(layer, name, p)
                self.params.append(p)
        self.eh = Param(self.head.eh_proj.dequantize())
        self.enorm, self.hnorm = torch.nn.Parameter(self.head.enorm.clone()), torch.nn.Parameter(self.head.hnorm.clone())
        self.params += [self.eh.w, self.enorm, self.hnorm]
        self.draft_w = self.head.draft_w          # frozen [n_draft, n_embd]
        data = [self._prepare(*t) for t in traced]
        n_val = len(data) // HELD_OUT if len(data) >= 2 * HELD_OUT else 0
        self.data, self.val = data[:len(data) - n_val], data[len(data) - n_val:]

    @torch.no_grad()
    def _trace(self, ids: list[int]):
        """One trunk pass: the token ids, the normed states and the trunk's greedy token after
        every position (its own prediction: the reply's next token, and on the prompt what the
        model would have said, a cleaner target than the user's text)."""
        m = self.model
        cache = m.init_cache(len(ids))
        hidden = m._hidden(cache, ids, 0)
        states = rms_norm(hidden.float(), m.output_norm, m.config.rms_eps)
        return torch.tensor(ids), states, m.head(hidden).argmax(-1)

    def _prepare(self, ids: torch.Tensor, states: torch.Tensor, greedy: torch.Tensor):
        """Inputs x_1..x_{T-2} with the trunk's states at 0..T-3; targets the trunk's greedy
        tokens after 1..T-2 and its states at 1..T-2."""
        return ids[1:-1], states[:-2].clone(), self.remap[greedy[1:-1]], states[1:-1].clone()

    def forward(self, tokens: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        from fucina.train.forward import TrainCache

        m, eps = self.model, self.model.config.rms_eps
        e = m.embed(tokens).float()
        x = self.eh(torch.cat([rms_norm(e, self.enorm, eps), rms_norm(states, self.hnorm, eps)], dim=-1))
        blk = self.head.block
        x = blk.block(0, x, TrainCache(blk, x.shape[0]), 0)
        return rms_norm(x, self.head.head_norm, eps)

    def loss(self, item) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, states, targets, next_states = item
        hn = self.forward(tokens, states)
        ce = F.cross_entropy(hn @ self.draft_w.T, targets, ignore_index=-100)
        feat = F.smooth_l1_loss(hn, next_states)
        acc = ((hn @ self.draft_w.T).argmax(-1) == targets).float().mean()
        return ce + self.opts.feature_weight * feat, ce.detach(), acc.detach()

    def train(self) -> dict:
        o = self.opts
        torch.manual_seed(o.seed)
        rng = random.Random(o.seed)
        opt = torch.optim.AdamW(self.params, lr=o.lr, weight_decay=0.0)
        warm = max(1, o.steps // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, o.steps) / o.steps)))
        t0, ce_avg, acc_avg = time.perf_counter(), None, None
        best, best_values, best_step = -1.0, None, 0
        for step in range(o.steps):
            item = self.data[rng.randrange(len(self.data))]
            loss, ce, acc = self.loss(item)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            opt.step()
            sched.step()
            ce_avg = float(ce) if ce_avg is None else 0.95 * ce_avg + 0.05 * float(ce)
            acc_avg = float(acc) if acc_avg is None else 0.95 * acc_avg + 0.05 * float(acc)
            last = step == o.steps - 1
            if self.val and ((step + 1) % EVAL_EVERY == 0 or last):
                val = self.evaluate()
                if val > best:
                    best, best_values, best_step = val, self.values(), step + 1
            if o.log and (step % 50 == 0 or last):
                held = f", held-out {best:.1%} (best, step {best_step})" if self.val else ""
                o.log(f"step {step + 1}/{o.steps}: cross-entropy {ce_avg:.3f}, next-token accuracy {acc_avg:.1%}{held}")
        self.best_values = best_values
        return dict(steps=o.steps, seconds=time.perf_counter() - t0, cross_entropy=ce_avg, accuracy=acc_avg,
                    held_out_accuracy=best if self.val else None, kept_step=best_step if self.val else o.steps)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Next-token accuracy on the held-out sequences (what a first draft token scores)."""
        hits = total = 0
        for tokens, states, targets, _ in self.val:
            pred = (self.forward(tokens, states) @ self.draft_w.T).argmax(-1)
            hits += int((pred == targets).sum())
            total += targets.numel()
        return hits / total if total else 0.0

    def values(self) -> dict[str, torch.Tensor]:
        v = layer_values(self.model, self.head.block.layers[0])
        v["nextn.eh_proj"] = self.eh.w.detach()
        v["nextn.enorm"], v["nextn.hnorm"] = self.enorm.detach(), self.hnorm.detach()
        return v


def train_head(llm, out: str | os.PathLike, opts: TrainOptions | None = None) -> dict:
    """Self-distil `llm`'s model into an MTP head written to `out`; returns the run's figures."""
    opts = opts or TrainOptions()
    if opts.steps < 1 or opts.sequences < 1 or opts.tokens < 2:
        raise FucinaError("mtp train: --steps, --sequences >= 1 and --tokens >= 2 are required")
    t0 = time.perf_counter()
    model = llm.model
    check_family(model)
    seqs = self_distill(llm, opts)
    t1 = time.perf_counter()
    trainer = HeadTrainer(model, opts, seqs)
    stats = trainer.train()
    write_head(model, trainer.best_values or trainer.values(), out, trainer.vocab.tolist())
    stats.update(sequences=len(seqs), tokens=sum(len(s) for s in seqs), distill_seconds=t1 - t0,
                 total_seconds=time.perf_counter() - t0, draft_vocab=len(trainer.vocab))
    return stats
