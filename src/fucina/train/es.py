"""Reward fine-tuning by evolution strategies: forward passes and a score, no gradients.

One iteration (OpenAI-ES with mirrored sampling and centred-rank shaping):

    e_j  ~ N(0, I), j = 0 .. P/2 - 1         regenerated, never stored
    R_2j = reward(theta + sigma e_j),  R_2j+1 = reward(theta - sigma e_j)
    C_m  = rank(R_m) / (P - 1) - 1/2          (tied rewards share their mean rank)
    theta += lr_t / (P sigma_t) * sum_j (C_2j - C_2j+1) e_j
    then, with anchored decay, theta is pulled toward its start theta_0:
    l2: theta_0 + (theta - theta_0)(1 - lr_t lambda);  l1: soft-threshold at lr_t lambda

The schedule (`schedule_factor`) scales the step: lr_t = lr s(t), s constant, cosine (to
`final_scale` at `horizon`) or step decay; sigma_t = sigma s(t) only with `decay_sigma`
(sigma alone sets the probe radius; lr_t / sigma_t the size of the move). Centred ranks
rescale every iteration to the same spread, so with a constant lr the step never shrinks:
on SmolLM2 the held-out score peaked at iteration 80 and fell back to zero by 200
(BENCHMARK.md). Hence also keep-best (`ESTrainer(eval_examples=, eval_every=)`): theta is
scored on held-out examples every N iterations and the best is what the run writes.

A member is a seed: e_j is `torch.randn` from a generator seeded by
mix64(seed, iteration, j, tensor index), so any member's perturbation is a pure function of
counters and any process can rebuild it (the update sums the pairs in index order: the same
bytes whoever evaluated which member). `norm="zscore"` swaps the ranks for (R - mean)/std
(the reference's choice; ranks are the default because an unbounded reward such as nll lets
one broken member dominate a z-score).

What is perturbed (`mode`):
- "lora": A [r, in] and B [out, r] of LoRA pairs over the frozen, still-quantized weights,
  installed unmerged (`fucina.weights.lora.LoRALinear`, the native step adds x A^T Bt);
  a member is written into the live tensors in place (and into the fused QKV / gate-up
  copies), so one model serves every member; the result is the adapter.gguf the gradient
  path writes;
- "full": the target projections themselves, decoded once to F32 copies (small models:
  4 bytes per weight, twice: theta and the live copy); written as a merged GGUF;
- "ternary": on a TQ2_0 model, the targets' packed bytes themselves, moved by trit flips and
  a rank-weighted vote (`fucina.train.es_ternary`); written as the trained TQ2_0 GGUF.

Rewards (`parse_reward`), scored per example and averaged over the iteration's batch:
- "nll": minus the mean token negative log-likelihood of the dataset's reply, teacher-forced
  in one batched pass over the batch (gradient-free SFT);
- "acc": 1 when the greedy reply contains the dataset's answer, else 0;
- "regex:P": 1 when `re.search(P, reply)` finds a match, else 0;
- a Python callable fn(reply: str, example: dict) -> float (the JSONL record).
The generating rewards decode the batch's prompts together (`text.batch.generate_batch`).

Member-parallel evaluation (`workers` > 1): each worker process loads the model and holds
the same theta; member m goes to worker m % workers, only rewards travel, and every process
applies the same update from all rewards (results keyed by member, summed in index order).

Checkpoints (DIR/checkpoint.pt): theta, the iteration, the history and the best held-out
theta; with the data batch, the noise and the schedule all functions of (seed, iteration)
that is the whole state, so a resumed run writes the same adapter bytes as an uninterrupted one.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import sys
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Callable

import torch

from fucina.errors import FucinaError
from fucina.train import checkpoint as ckpt
from fucina.train.data import IGNORE, DataError, Loader, encode_record, records
from fucina.train.lora import TARGETS, mix64, parse_targets

MODES = ("lora", "full", "ternary")
NORMS = ("rank", "zscore")
ANCHORS = ("none", "l1", "l2")
SCHEDULES = ("constant", "cosine", "step")
_NOISE_DOMAIN = 0xE5
# what must match between a checkpoint and the run resuming it
_RESUME_KEYS = ("population", "sigma", "lr", "seed", "mode", "rank", "alpha", "targets", "batch",
                "norm", "anchor", "anchor_lambda", "max_tokens", "schedule", "horizon", "final_scale",
                "step_every", "step_gamma", "decay_sigma", "flip_rate", "update_fraction")


class ESError(FucinaError):
    """An evolution-strategies run cannot go on (bad setup, a failing or non-finite reward)."""


@dataclass
class ESConfig:
    population: int = 8          # members per iteration (even: mirrored pairs)
    sigma: float = 0.02          # perturbation scale
    lr: float = 0.002            # step size (lr / (population sigma) scales the pairs' sum)
    seed: int = 0
    mode: str = "lora"
    rank: int = 4                # LoRA rank (mode lora)
    alpha: float = 8.0           # LoRA alpha; scale alpha / rank
    targets: list[str] = field(default_factory=lambda: ["q", "v"])
    batch: int = 8               # examples scored per member per iteration; 0 = all
    norm: str = "rank"
    anchor: str = "none"
    anchor_lambda: float = 0.0
    max_tokens: int = 32         # reply length for the generating rewards
    schedule: str = "constant"   # the step-size factor s(t) over iterations (`schedule_factor`)
    horizon: int = 0             # cosine: the iteration where s reaches final_scale (then stays)
    final_scale: float = 0.1     # cosine: s at the horizon
    step_every: int = 50         # step: s = step_gamma ** (t // step_every)
    step_gamma: float = 0.5
    decay_sigma: bool = False    # sigma follows s(t) too (finer probes; lr_t / sigma_t is then constant)
    flip_rate: float = 0.001     # ternary: share of a tensor's trits a member moves (decays with decay_sigma)
    update_fraction: float = 0.005   # ternary: share of the trits the update moves, times s(t)

    def __post_init__(self):
        self.targets = parse_targets(self.targets)
        if not isinstance(self.population, int) or self.population < 2 or self.population % 2:
            raise ESError(f"population must be an even integer >= 2 (mirrored pairs), got {self.population!r}")
        for name in ("sigma", "lr"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ESError(f"{name} must be positive and finite, got {v}")
        if self.mode not in MODES:
            raise ESError(f"unknown ES mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.norm not in NORMS:
            raise ESError(f"unknown reward normalisation {self.norm!r} (choose from {', '.join(NORMS)})")
        if self.anchor not in ANCHORS:
            raise ESError(f"unknown anchored decay {self.anchor!r} (choose from {', '.join(ANCHORS)})")
        if not (math.isfinite(self.anchor_lambda) and self.anchor_lambda >= 0):
            raise ESError(f"anchor lambda must be >= 0, got {self.anchor_lambda}")
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ESError(f"rank must be a positive integer, got {self.rank!r}")
        if self.batch < 0 or self.max_tokens < 1:
            raise ESError("batch must be >= 0 and max_tokens >= 1")
        if self.schedule not in SCHEDULES:
            raise ESError(f"unknown step-size schedule {self.schedule!r} (choose from {', '.join(SCHEDULES)})")
        if self.schedule == "cosine" and (not isinstance(self.horizon, int) or self.horizon < 1):
            raise ESError(f"the cosine schedule needs a horizon of at least 1 iteration, got {self.horizon!r}")
        if not (math.isfinite(self.final_scale) and 0 <= self.final_scale <= 1):
            raise ESError(f"final scale must be in [0, 1], got {self.final_scale}")
        for name in ("flip_rate", "update_fraction"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 < v <= 1):
                raise ESError(f"{name} must be in (0, 1], got {v}")
        if not isinstance(self.step_every, int) or self.step_every < 1:
            raise ESError(f"step_every must be a positive integer, got {self.step_every!r}")
        if not (math.isfinite(self.step_gamma) and 0 < self.step_gamma <= 1):
            raise ESError(f"step gamma must be in (0, 1], got {self.step_gamma}")


# -- the algorithm, on a list of f32 tensors ----------------------------------------------------

def schedule_factor(cfg: ESConfig, t: int) -> float:
    """s(t) for iteration t (0-based): lr_t = lr s(t), and sigma_t = sigma s(t) with decay_sigma.
    constant: 1; cosine: f + (1 - f)(1 + cos(pi min(t, H) / H)) / 2 (f = final_scale, H =
    horizon); step: gamma ** (t // step_every). A pure function of t: a resumed run steps alike."""
    if cfg.schedule == "cosine":
        f = cfg.final_scale
        return f + (1.0 - f) * 0.5 * (1.0 + math.cos(math.pi * min(t, cfg.horizon) / cfg.horizon))
    if cfg.schedule == "step":
        return cfg.step_gamma ** (t // cfg.step_every)
    return 1.0


def pair_noise(seed: int, iteration: int, pair: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """e_pair of `iteration`: one standard-normal tensor per shape, each from its own counter seed."""
    out = []
    for k, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(mix64(seed, _NOISE_DOMAIN, iteration, pair, k))
        out.append(torch.randn(shape, generator=g))
    return out


def centred_ranks(rewards: list[float]) -> list[float]:
    """rank / (n - 1) - 1/2 in [-1/2, 1/2]; equal rewards share their mean rank, so a pair
    that scored the same contributes nothing and an iteration without signal takes no step."""
    n = len(rewards)
    order = sorted(range(n), key=lambda m: rewards[m])
    out = [0.0] * n
    i = 0
    while i < n:
        j = i
        while j + 1 < n and rewards[order[j + 1]] == rewards[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 / (n - 1) - 0.5
        i = j + 1
    return out


def zscores(rewards: list[float]) -> list[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + 1e-8) for r in rewards]


def check_rewards(rewards: list[float], population: int) -> None:
    if len(rewards) != population:
        raise ESError(f"{len(rewards)} rewards for a population of {population}")
    bad = [m for m, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise ESError(f"non-finite reward {rewards[bad[0]]} for member {bad[0]} (of {len(bad)}); "
                      "return a finite score (clamp, or score a failed reply 0)")


class Strategy:
    """theta (f32 tensors, updated in place), its start theta_0 and the iteration counter."""

    def __init__(self, theta: list[torch.Tensor], cfg: ESConfig):
        self.theta = [t.detach().float().contiguous().clone() for t in theta]
        self.anchor = [t.clone() for t in self.theta] if cfg.anchor != "none" else None
        self.cfg, self.iteration = cfg, 0
        self.shapes = [t.shape for t in self.theta]

    def noise(self, pair: int, iteration: int | None = None) -> list[torch.Tensor]:
        it = self.iteration if iteration is None else iteration
        return pair_noise(self.cfg.seed, it, pair, self.shapes)

    def rates(self, iteration: int | None = None) -> tuple[float, float]:
        """(lr_t, sigma_t) of `iteration` (default the current one) under the schedule."""
        cfg = self.cfg
        f = schedule_factor(cfg, self.iteration if iteration is None else iteration)
        return cfg.lr * f, cfg.sigma * f if cfg.decay_sigma else cfg.sigma

    def member(self, m: int) -> list[torch.Tensor]:
        """theta + sigma_t e (even m) or theta - sigma_t e (odd m) for member m of this iteration."""
        sigma = self.rates()[1]
        s = sigma if m % 2 == 0 else -sigma
        return [t + s * e for t, e in zip(self.theta, self.noise(m // 2))]

    def coefficients(self, rewards: list[float]) -> list[float]:
        check_rewards(rewards, self.cfg.population)
        return centred_ranks(rewards) if self.cfg.norm == "rank" else zscores(rewards)

    @torch.no_grad()
    def update(self, rewards: list[float]) -> None:
        cfg = self.cfg
        c = self.coefficients(rewards)
        lr, sigma = self.rates()
        step = lr / (cfg.population * sigma)
        acc = [torch.zeros_like(t) for t in self.theta]
        for j in range(cfg.population // 2):
            w = c[2 * j] - c[2 * j + 1]
            if w:
                for a, e in zip(acc, self.noise(j)):
                    a.add_(e, alpha=w)
        for t, a in zip(self.theta, acc):
            t.add_(a, alpha=step)
        if self.anchor is not None and cfg.anchor_lambda > 0:
            k = lr * cfg.anchor_lambda
            for t, t0 in zip(self.theta, self.anchor):
                d = t - t0
                d = d * (1.0 - k) if cfg.anchor == "l2" else torch.sign(d) * (d.abs() - k).clamp_min(0)
                t.copy_(t0 + d)
        self.iteration += 1


# -- the data ---------------------------------------------------------------------------------

@dataclass
class ESExample:
    prompt: list[int]      # what the model is given
    reply: list[int]       # the dataset's reply tokens (end-of-turn included)
    answer: str            # what `acc` looks for in a generated reply
    record: dict           # the JSONL object (what a callable reward receives)


def es_example(rec, tokenizer, template, where: str = "example") -> ESExample:
    """A JSONL record ('messages' or 'prompt'/'completion'; optional 'answer') as a prompt and
    the reply that follows it (the first assistant turn)."""
    if isinstance(rec, dict) and "text" in rec and "messages" not in rec and "prompt" not in rec:
        raise DataError(f"{where}: ES needs a prompt to reply to ('messages' or 'prompt'/'completion')")
    ex = encode_record(rec, tokenizer, template, where)
    first = next(t for t, lab in enumerate(ex.labels) if lab != IGNORE)
    end = first
    while end < len(ex.labels) and ex.labels[end] != IGNORE:
        end += 1
    answer = rec.get("answer")
    if answer is None:
        if "messages" in rec:
            answer = next(m["content"] for m in rec["messages"] if m["role"] == "assistant")
        else:
            answer = rec["completion"]
    if not isinstance(answer, str) or not answer.strip():
        raise DataError(f"{where}: 'answer' must be a non-empty string")
    return ESExample(ex.ids[:first + 1], ex.labels[first:end], answer.strip(), rec)


def read_es_jsonl(path: str | os.PathLike, tokenizer, template) -> list[ESExample]:
    out = [es_example(rec, tokenizer, template, where) for where, rec in records(path)]
    if not out:
        raise DataError(f"{path}: no examples (the dataset is empty)")
    return out


def batch_indices(n: int, cfg: ESConfig, iteration: int) -> list[int]:
    """The examples of `iteration`: all of them, or `batch` from the seeded order (a pure
    function of the iteration, so a resumed run sees the same batches)."""
    if cfg.batch == 0 or cfg.batch >= n:
        return list(range(n))
    return Loader(n, cfg.seed, position=iteration * cfg.batch).take(cfg.batch)


# -- rewards ----------------------------------------------------------------------------------

@dataclass
class Reward:
    name: str
    generates: bool
    pattern: str = ""
    fn: Callable[[str, dict], float] | None = None

    def score(self, reply: str, ex: ESExample) -> float:
        if self.name == "acc":
            return float(ex.answer in reply)
        if self.name == "regex":
            return float(re.search(self.pattern, reply) is not None)
        try:
            v = self.fn(reply, ex.record)
        except Exception as e:
            raise ESError(f"the reward function raised {type(e).__name__}: {e}") from e
        try:
            return float(v)
        except (TypeError, ValueError):
            raise ESError(f"the reward function returned {v!r}, not a number") from None


def parse_reward(spec: str | Callable[[str, dict], float]) -> Reward:
    if callable(spec):
        return Reward(getattr(spec, "__name__", "callable"), True, fn=spec)
    if spec in ("nll", "acc"):
        return Reward(spec, spec == "acc")
    if isinstance(spec, str) and spec.startswith("regex:"):
        pattern = spec[len("regex:"):]
        try:
            re.compile(pattern)
        except re.error as e:
            raise ESError(f"bad reward regex {pattern!r}: {e}") from None
        if not pattern:
            raise ESError("the regex reward needs a pattern: regex:PATTERN")
        return Reward("regex", True, pattern=pattern)
    raise ESError(f"unknown reward {spec!r} (nll, acc, regex:PATTERN, or a callable)")


def _stop_ids(tokenizer, template) -> list[int]:
    if template is not None:
        return sorted(template.stop_ids(tokenizer))
    ids = set(getattr(tokenizer, "eog_ids", ()) or ())
    if getattr(tokenizer, "eos_id", None) is not None:
        ids.add(tokenizer.eos_id)
    return sorted(ids)


@torch.inference_mode()
def reply_nll(model, examples: list[ESExample]) -> list[float]:
    """Mean token NLL of each example's reply after its prompt, all rows in one batched pass."""
    from fucina.text.batch import ragged_step
    rows = [ex.prompt + ex.reply[:-1] for ex in examples]
    caches = [model.init_cache(len(r) + 1) for r in rows]
    logits = ragged_step(model, caches, rows, [True] * len(rows), [True] * len(rows))
    out = []
    for ex, lg in zip(examples, logits):
        if isinstance(lg, Exception):
            raise ESError(f"teacher-forced pass failed: {lg}")
        tail = lg[len(ex.prompt) - 1:].float()
        out.append(float(torch.nn.functional.cross_entropy(tail, torch.tensor(ex.reply))))
    return out


def generate_replies(model, tokenizer, examples: list[ESExample], max_tokens: int,
                     stop_ids: list[int]) -> list[str]:
    from fucina.text.batch import generate_batch
    from fucina.text.sampler import Sampler, SamplingConfig
    with torch.inference_mode():
        replies = generate_batch(model, tokenizer, [ex.prompt for ex in examples],
                                 [Sampler(SamplingConfig(temperature=0.0)) for _ in examples],
                                 max_tokens=max_tokens, stop_ids=stop_ids)
    return [r.text for r in replies]


def score_batch(model, tokenizer, stop_ids: list[int], examples: list[ESExample], reward: Reward,
                max_tokens: int) -> float:
    """The reward of the model as it stands, averaged over `examples`."""
    if not reward.generates:
        return -sum(reply_nll(model, examples)) / len(examples)
    texts = generate_replies(model, tokenizer, examples, max_tokens, stop_ids)
    return sum(reward.score(t, ex) for t, ex in zip(texts, examples)) / len(examples)


# -- where theta lives in the model -----------------------------------------------------------

def _target_names(model, targets: list[str]) -> list[str]:
    from fucina.weights.lora import model_weights
    stems = {TARGETS[t] for t in targets}
    names = [n for n in model_weights(model) if n.split(".")[2] in stems]
    if not names:
        raise ESError(f"this model has no separate {','.join(targets)} projection to train "
                      "(weights the file stores fused, and MoE experts, are not supported by ES yet)")
    return names


def _fused_slots(model) -> list[tuple[object, list]]:
    """(fused weight, its parts) for every fused weight of the layers (QKV, gate-up)."""
    from fucina.weights.lora import weight_slots
    out = []
    for L in model.layers:
        slots = weight_slots(L)
        by_name = {w.name: w for _, _, w in slots if "+" not in w.name}
        for _, _, w in slots:
            parts = w.name.split("+")
            if len(parts) > 1 and all(p in by_name for p in parts):
                out.append((w, [by_name[p] for p in parts]))
    return out


class LoRATarget:
    """Unmerged LoRA pairs over the frozen weights; theta = [A_0, B_0, A_1, B_1, ...]."""

    def __init__(self, model, cfg: ESConfig, init: str | None = None):
        from fucina.weights.lora import Adapter, LoRALinear, _apply_unmerged, model_weights, read_adapter
        if any(isinstance(w, LoRALinear) for w in model_weights(model).values()):
            raise ESError("the model already carries a LoRA adapter; ES trains a fresh one")
        self.model, self.cfg = model, cfg
        self.names = _target_names(model, cfg.targets)
        weights = model_weights(model)
        g = torch.Generator().manual_seed(mix64(cfg.seed, 0x10A))
        pairs = {}
        for n in self.names:
            w = weights[n]
            bound = 1.0 / math.sqrt(w.in_features)   # kaiming-uniform A, zero B, as PEFT
            pairs[n] = ((torch.rand(cfg.rank, w.in_features, generator=g) * 2 - 1) * bound,
                        torch.zeros(w.out_features, cfg.rank))
        if init is not None:   # start from an adapter (e.g. an nll run's, before a sparse reward)
            start = read_adapter(init)
            if set(start.pairs) != set(pairs) or start.alpha != cfg.alpha or \
                    any(start.pairs[n][0].shape != pairs[n][0].shape or start.pairs[n][1].shape != pairs[n][1].shape
                        for n in pairs):
                raise ESError(f"{init}: the starting adapter must have this run's targets, rank and alpha "
                              f"({','.join(cfg.targets)}, r {cfg.rank}, alpha {cfg.alpha})")
            pairs = {n: (start.pairs[n][0].float(), start.pairs[n][1].float()) for n in pairs}
        self.init = [t for n in self.names for t in pairs[n]]
        self.scale = cfg.alpha / cfg.rank
        _apply_unmerged(model, [(Adapter(model.config.arch, cfg.alpha, pairs), 1.0)])
        live = model_weights(model)
        self.live = [live[n].lora for n in self.names]            # (A, Bt) the kernels read
        self.fused = [(f, parts) for f, parts in _fused_slots(model)
                      if getattr(f, "lora", None) is not None and any(p.name in pairs for p in parts)]

    def install(self, theta: list[torch.Tensor]) -> None:
        from fucina.weights.lora import fused_lora
        with torch.no_grad():
            for k, (a, bt) in enumerate(self.live):
                a.copy_(theta[2 * k])
                bt.copy_(theta[2 * k + 1].T * self.scale)
            for f, parts in self.fused:
                a, bt = fused_lora(parts)
                f.lora[0].copy_(a)
                f.lora[1].copy_(bt)

    def write(self, out_dir: str, theta: list[torch.Tensor]) -> str:
        from fucina.train.adapters import write_adapter
        pairs = {n: (theta[2 * k], theta[2 * k + 1]) for k, n in enumerate(self.names)}
        name = os.path.basename(str(getattr(getattr(self.model, "gguf", None), "path", ""))) + " ES LoRA"
        return write_adapter(os.path.join(out_dir, "adapter.gguf"), self.model.config.arch,
                             self.cfg.alpha, pairs, name)


class _FullDelta:
    """The trained weights as export_merged's adapter: delta = W_now - W_file."""

    def __init__(self, arch: str, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.arch, self.path, self.w = arch, "ES full-mode weights", weights
        self.pairs = {n: (torch.zeros(1, w.shape[1]), torch.zeros(w.shape[0], 1)) for n, (w, _) in weights.items()}

    def delta(self, name: str, scale: float = 1.0) -> torch.Tensor:
        now, base = self.w[name]
        return (now - base) * scale


class FullTarget:
    """The target projections as F32 copies, perturbed in place; theta = [W_0, W_1, ...]."""

    def __init__(self, model, cfg: ESConfig):
        from fucina.gguf import GGMLType
        from fucina.kernels import attach
        from fucina.weights import LinearWeight
        from fucina.weights.lora import _rewrite, model_weights
        self.model, self.cfg = model, cfg
        self.names = _target_names(model, cfg.targets)
        weights = model_weights(model)
        self.init = [weights[n].dequantize().float().contiguous() for n in self.names]

        def to_f32(w):
            f = LinearWeight(self.init[self.names.index(w.name)].clone().view(torch.uint8).reshape(-1),
                             GGMLType.F32, w.out_features, w.in_features, w.name)
            attach(f)
            return f

        def fuse(group, fused):
            return LinearWeight.fuse(group) if len({g.qtype for g in group}) == 1 else None
        _rewrite(model, set(self.names), to_f32, fuse)
        live = model_weights(model)
        self.live = [live[n].raw.view(torch.float32).reshape(live[n].shape) for n in self.names]
        self.fused = [(f, parts) for f, parts in _fused_slots(model) if any(p.name in self.names for p in parts)]

    def install(self, theta: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for dst, src in zip(self.live, theta):
                dst.copy_(src)
            for f, parts in self.fused:
                f.raw.copy_(torch.cat([p.raw for p in parts], dim=0))

    def source(self, what: str) -> str:
        src = getattr(getattr(self.model, "gguf", None), "path", None)
        if src is None:
            raise ESError(f"{what} needs the model's file")
        return src

    def write(self, out_dir: str, theta: list[torch.Tensor]) -> str:
        from fucina.train.export import export_merged
        src = self.source("full mode writes a merged GGUF and")
        delta = _FullDelta(self.model.config.arch, {n: (t, w0) for n, t, w0 in zip(self.names, theta, self.init)})
        out = os.path.join(out_dir, "model.gguf")
        export_merged(src, self.model, [(delta, 1.0)], out)
        return out


def make_target(model, cfg: ESConfig, init: str | None = None):
    if cfg.mode == "lora":
        return LoRATarget(model, cfg, init)
    if init is not None:
        raise ESError("a starting adapter is for mode lora")
    if cfg.mode == "ternary":
        from fucina.train.es_ternary import TernaryTarget
        return TernaryTarget(model, cfg)
    return FullTarget(model, cfg)


def make_strategy(target, cfg: ESConfig):
    """Gaussian ES over f32 theta (lora, full) or trit flips over TQ2_0 bytes (ternary)."""
    if cfg.mode == "ternary":
        from fucina.train.es_ternary import TernaryStrategy
        return TernaryStrategy(target.init, target.shapes, cfg)
    return Strategy(target.init, cfg)


# -- one process's share of an iteration ------------------------------------------------------

class Evaluator:
    """A model with theta installed, scoring members on the iteration's batch."""

    def __init__(self, model, tokenizer, template, cfg: ESConfig, examples: list[ESExample],
                 reward: Reward, init: str | None = None):
        if not examples:
            raise ESError("the dataset is empty")
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.examples, self.reward = examples, reward
        self.stop_ids = _stop_ids(tokenizer, template)
        self.target = make_target(model, cfg, init)
        self.es = make_strategy(self.target, cfg)

    def score(self, theta: list[torch.Tensor], iteration: int) -> float:
        self.target.install(theta)
        batch = [self.examples[i] for i in batch_indices(len(self.examples), self.cfg, iteration)]
        try:
            return score_batch(self.model, self.tokenizer, self.stop_ids, batch, self.reward, self.cfg.max_tokens)
        finally:
            self.target.install(self.es.theta)

    def members(self, ms: list[int]) -> dict[int, float]:
        return {m: self.score(self.es.member(m), self.es.iteration) for m in ms}

    def center(self, examples: list[ESExample] | None = None, reward: Reward | None = None) -> float:
        """The reward of theta itself (on `examples`, default the whole dataset; with `reward`,
        default the training one)."""
        self.target.install(self.es.theta)
        exs = examples or self.examples
        return score_batch(self.model, self.tokenizer, self.stop_ids, exs, reward or self.reward,
                           self.cfg.max_tokens)


def _mkdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


# -- member-parallel workers ------------------------------------------------------------------

@dataclass
class WorkerSpec:
    model_path: str
    threads: int
    cfg: dict
    examples: list[ESExample]
    reward: str | Callable[[str, dict], float]
    init: str | None = None


def _worker(spec: WorkerSpec, conn) -> None:
    try:
        import fucina.kernels as kernels
        from fucina.models import load_model
        from fucina.text.chat_template import ChatTemplate
        from fucina.text.tokenizer import Tokenizer
        kernels.set_threads(spec.threads)
        torch.set_num_threads(spec.threads)
        model = load_model(spec.model_path)
        tok = Tokenizer.from_metadata(model.gguf.metadata)
        tpl = ChatTemplate.from_metadata(model.gguf.metadata, tok)
        ev = Evaluator(model, tok, tpl, ESConfig(**spec.cfg), spec.examples, parse_reward(spec.reward),
                       spec.init)
        conn.send(("ready", None))
    except BaseException as e:   # reported to the parent, which raises it as an ESError
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "stop":
                return
            if msg[0] == "theta":
                ev.es.theta, ev.es.iteration = [t.clone() for t in msg[1]], msg[2]
                ev.target.install(ev.es.theta)
                conn.send(("ok", None))
            elif msg[0] == "eval":
                conn.send(("ok", ev.members(msg[1])))
            elif msg[0] == "update":
                ev.es.update(msg[1])
                ev.target.install(ev.es.theta)
                conn.send(("ok", None))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Pool:
    def __init__(self, specs: list[WorkerSpec]):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for spec in specs:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(spec, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            self._get(c)

    def _get(self, conn):
        try:
            kind, value = conn.recv()
        except EOFError:
            raise ESError("an ES worker process died") from None
        if kind == "error":
            raise ESError(f"ES worker: {value}")
        return value

    def send_all(self, msg) -> None:
        for c in self.conns:
            c.send(msg)

    def gather(self) -> list:
        return [self._get(c) for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# -- the run ----------------------------------------------------------------------------------

KEEP = ("best", "last")


class ESTrainer:
    """Evolution strategies over `model` with `reward` on `examples`. `workers` > 1 evaluates
    members in that many processes in all (this one included; they load `model_path`).
    `init`: an adapter.gguf to start from (mode lora; same targets, rank and alpha).

    Keep-best: with `eval_examples` and `eval_every` N, theta itself is scored on the held-out
    examples (with `eval_reward`, default the training reward) before the first iteration and
    after every N-th; the best so far (ties keep the earlier) is written to DIR/best/ and, with
    keep="best", is the run's final DIR/adapter.gguf (the last theta goes to DIR/last/)."""

    def __init__(self, model, tokenizer, template, cfg: ESConfig, examples: list[ESExample],
                 reward: str | Callable[[str, dict], float], out_dir: str | None = None, *,
                 workers: int = 1, model_path: str | None = None, threads: int | None = None,
                 log=None, progress: bool = True, init: str | None = None,
                 eval_examples: list[ESExample] | None = None, eval_every: int = 0,
                 eval_reward: str | Callable[[str, dict], float] | None = None, keep: str = "best"):
        if workers < 1:
            raise ESError(f"workers must be at least 1, got {workers}")
        if not isinstance(eval_every, int) or eval_every < 0:
            raise ESError(f"eval_every must be a non-negative integer, got {eval_every!r}")
        if eval_every and not eval_examples:
            raise ESError("keep-best evaluates on held-out examples: give eval_examples (--eval-data)")
        if keep not in KEEP:
            raise ESError(f"keep must be one of {', '.join(KEEP)}, got {keep!r}")
        self.eval_examples, self.eval_every, self.keep = eval_examples or [], eval_every, keep
        self.eval_reward = parse_reward(eval_reward if eval_reward is not None else reward)
        self.best: dict | None = None   # reward, iteration, theta of the best held-out score
        if workers > 1 and model_path is None:
            raise ESError("member-parallel workers load the model from its file: give model_path")
        self.cfg, self.out_dir, self.workers = cfg, out_dir, workers
        self.reward = parse_reward(reward)
        self.ev = Evaluator(model, tokenizer, template, cfg, examples, self.reward, init)
        self.history: list[dict] = []
        self.elapsed = 0.0
        self.log = log or (lambda s: None)
        self.progress = progress
        self.pool = None
        if workers > 1:
            t = threads or max(1, (os.cpu_count() or 1) // workers)
            spec = WorkerSpec(str(model_path), t, asdict(cfg), examples, reward, init)
            self.pool = _Pool([spec] * (workers - 1))

    @property
    def iteration(self) -> int:
        return self.ev.es.iteration

    @property
    def theta(self) -> list[torch.Tensor]:
        return self.ev.es.theta

    def step(self) -> dict:
        es, P, W = self.ev.es, self.cfg.population, self.workers
        t0 = time.perf_counter()
        if self.pool is not None:   # the workers start while this process scores its own share
            for w, c in enumerate(self.pool.conns, 1):
                c.send(("eval", [m for m in range(P) if m % W == w]))
        rewards = self.ev.members([m for m in range(P) if m % W == 0])
        if self.pool is not None:
            for got in self.pool.gather():
                rewards.update(got)
        r = [rewards[m] for m in range(P)]
        es.update(r)                                 # raises on a non-finite reward: theta kept
        self.ev.target.install(es.theta)
        if self.pool is not None:
            self.pool.send_all(("update", r))
            self.pool.gather()
        dt = time.perf_counter() - t0
        self.elapsed += dt
        rec = dict(iteration=es.iteration, mean=sum(r) / P, best=max(r), worst=min(r), seconds=dt)
        self.history.append(rec)
        return rec

    # -- checkpoints ----------------------------------------------------------------------
    def evaluate(self) -> float:
        """Score theta on the held-out examples; keep it (and write DIR/best/) when it beats the best."""
        r = self.ev.center(self.eval_examples, self.eval_reward)
        if not math.isfinite(r):
            raise ESError(f"the held-out reward at iteration {self.iteration} is {r}, not finite")
        if self.best is None or r > self.best["reward"]:
            self.best = dict(reward=r, iteration=self.iteration, theta=[t.clone() for t in self.theta])
            if self.out_dir:
                self.ev.target.write(_mkdir(os.path.join(self.out_dir, "best")), self.best["theta"])
        return r

    def state(self) -> dict:
        return dict(method="es", config=asdict(self.cfg), iteration=self.iteration,
                    theta=[t.clone() for t in self.theta], history=self.history, elapsed=self.elapsed,
                    best=self.best)

    def save_checkpoint(self) -> str | None:
        if not self.out_dir:
            return None
        path = ckpt.save(self.out_dir, self.state())
        self.write()
        return path

    def resume(self, path: str) -> None:
        s = ckpt.load(path)
        if s.get("method") != "es":
            raise ckpt.CheckpointError(f"{path}: not an ES checkpoint (a gradient run's? resume it without "
                                       "--method es)")
        # a checkpoint from before a config field existed ran with that field's default
        saved = {f.name: f.default for f in fields(ESConfig) if f.default is not MISSING} | s["config"]
        ckpt.check_compatible(saved, asdict(self.cfg), _RESUME_KEYS)
        theta = s["theta"]
        if [t.shape for t in theta] != [t.shape for t in self.theta]:
            raise ckpt.CheckpointError(f"{path}: the checkpoint's parameters do not fit this model")
        es = self.ev.es
        es.theta, es.iteration = [t.clone() for t in theta], s["iteration"]
        self.ev.target.install(es.theta)
        self.history, self.elapsed = s["history"], s["elapsed"]
        self.best = s.get("best")
        if self.pool is not None:
            self.pool.send_all(("theta", es.theta, es.iteration))
            self.pool.gather()

    def write(self, final: bool = False) -> str | None:
        """DIR/adapter.gguf (model.gguf in full mode): theta as it stands, or at the end of a
        keep-best run the best held-out theta (then the last one goes to DIR/last/)."""
        if not self.out_dir:
            return None
        _mkdir(self.out_dir)
        if final and self.keep == "best" and self.best is not None:
            self.ev.target.write(_mkdir(os.path.join(self.out_dir, "last")), self.theta)
            return self.ev.target.write(self.out_dir, self.best["theta"])
        return self.ev.target.write(self.out_dir, self.theta)

    # -- the loop -------------------------------------------------------------------------
    def fit(self, iterations: int, checkpoint_every: int = 0, on_iteration=None) -> dict:
        try:
            if self.eval_every and self.best is None:
                r = self.evaluate()
                if self.progress:
                    print(f"es 0/{iterations}: held-out reward {r:.4f}", file=sys.stderr, flush=True)
            while self.iteration < iterations:
                rec = self.step()
                if self.eval_every and self.iteration % self.eval_every == 0:
                    rec["eval"] = self.evaluate()
                if self.progress:
                    held = f"  held-out {rec['eval']:.4f} (best {self.best['reward']:.4f} at " \
                           f"{self.best['iteration']})" if "eval" in rec else ""
                    print(f"es {rec['iteration']}/{iterations}: reward mean {rec['mean']:.4f} "
                          f"best {rec['best']:.4f} worst {rec['worst']:.4f}  {rec['seconds']:.2f} s{held}",
                          file=sys.stderr, flush=True)
                if on_iteration is not None:
                    on_iteration(rec)
                if checkpoint_every and self.iteration % checkpoint_every == 0:
                    self.save_checkpoint()
        except (KeyboardInterrupt, ESError):
            path = self.save_checkpoint()     # theta of the last completed iteration
            if path:
                self.log(f"stopped at iteration {self.iteration}: checkpoint written to {self.out_dir} "
                         f"(continue with --resume {self.out_dir})")
            raise
        self.save_checkpoint()
        self.write(final=True)
        return self.summary()

    def summary(self) -> dict:
        h = self.history
        best = self.best or {}
        return dict(iterations=self.iteration, first_mean=h[0]["mean"] if h else None,
                    final_mean=h[-1]["mean"] if h else None, seconds=self.elapsed,
                    best_iteration=best.get("iteration"), best_eval=best.get("reward"),
                    kept="best" if self.keep == "best" and self.best is not None else "last",
                    s_per_iteration=self.elapsed / len(h) if h else None,
                    parameters=sum(n * k for n, k in self.ev.es.shapes) if self.cfg.mode == "ternary"
                    else sum(t.numel() for t in self.theta), workers=self.workers,
                    out=os.path.join(self.out_dir, "adapter.gguf" if self.cfg.mode == "lora" else "model.gguf")
                    if self.out_dir else None)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
