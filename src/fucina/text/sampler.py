"""Sampling: from one logits row to one token, llama.cpp's way.

The pipeline runs in llama.cpp's order (common/sampling.cpp's default chain, with the
stages we support): logit processor → repeat/frequency/presence penalties over the
last `repeat_last_n` tokens → greedy shortcut → top-k → top-p → min-p → temperature →
one seeded draw. As in llama.cpp, top-p and min-p measure the distribution at
temperature 1 (temperature scales the survivors just before the draw); a temperature
of exactly 1 makes the order question moot.

- temperature <= 0 is argmax (first maximum, as llama.cpp's greedy sampler) and never
  touches the RNG;
- otherwise there is exactly one draw per call, from a Mersenne Twister seeded once
  with `seed` (32 bits, as llama.cpp's `std::mt19937`), turned into a double the way
  libstdc++'s `uniform_real_distribution<double>` does; the candidate bookkeeping
  (which stages sort, the cumulative walk of llama_sampler_dist) follows
  src/llama-sampler.cpp, so the draw sequence is a pure function of the seed and
  the logits;
- penalties are llama_sampler_penalties: for each distinct token in the window,
  logit <= 0 ? logit * repeat : logit / repeat, then minus count * frequency and
  presence (once).
"""
from __future__ import annotations

import math
import numbers
from collections import Counter
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

import numpy as np
import torch

from fucina.errors import SamplingError
from fucina.kernels import first_max
from fucina.text.logit_processor import LogitProcessor


def check_numbers(obj, error: type[Exception], prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """Every dataclass field of `obj` an integer (declared int) or a finite number, else `error`."""
    for f in fields(obj):
        if f.name in skip:
            continue
        v = getattr(obj, f.name)
        whole = f.type in ("int", int)
        kind = numbers.Integral if whole else numbers.Real
        if isinstance(v, bool) or not isinstance(v, kind) or (not whole and not math.isfinite(v)):
            raise error(f"{prefix}{f.name} must be {'an integer' if whole else 'a finite number'}, got {v!r}")


def with_keywords(cls, base, kw: dict, error: type[Exception], what: str):
    """`base` (or cls()) with the keywords set: None skipped, `temp` for temperature,
    an unknown name raises `error`."""
    if "temp" in kw:
        kw.setdefault("temperature", kw.pop("temp"))
    bad = sorted(set(kw) - {f.name for f in fields(cls)})
    if bad:
        raise error(f"unknown {what} option(s): {', '.join(bad)}")
    return replace(base or cls(), **{k: v for k, v in kw.items() if v is not None})


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0       # <= 0: greedy (argmax)
    top_k: int = 0                 # 0: off
    top_p: float = 1.0             # >= 1: off
    min_p: float = 0.0             # <= 0: off
    repeat_penalty: float = 1.0    # llama.cpp penalty_repeat; 1 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_last_n: int = 64        # penalty window; 0 = off, -1 = whole history
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalties_on(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

    def __post_init__(self):
        check_numbers(self, SamplingError)
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repeat_penalty <= 0:
            raise SamplingError(f"repeat_penalty must be positive, got {self.repeat_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 <= self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.repeat_last_n < -1:
            raise SamplingError(f"repeat_last_n must be >= -1, got {self.repeat_last_n}")

    @classmethod
    def from_kwargs(cls, base: "SamplingConfig | None" = None, **kw: Any) -> "SamplingConfig":
        """Build from keyword names (llama.cpp/OpenAI spelling); None values are skipped,
        unknown names are an error. `temp` is accepted for `temperature`."""
        return with_keywords(cls, base, kw, TypeError, "sampling")


SAMPLING_KEYS = frozenset(f.name for f in fields(SamplingConfig)) | {"temp"}


class MT19937:
    """std::mt19937 seeded with one 32-bit value, and libstdc++'s
    generate_canonical<double, 53>: two 32-bit outputs a, b -> (a + b * 2^32) / 2^64."""

    def __init__(self, seed: int):
        self._rs = np.random.RandomState(seed & 0xFFFFFFFF)  # init_genrand, as std::mt19937(seed)

    def uniform(self) -> float:
        a, b = self._rs.randint(0, 2**32, size=2, dtype=np.uint64)
        u = (float(a) + float(b) * 4294967296.0) / 18446744073709551616.0
        return u if u < 1.0 else math.nextafter(1.0, 0.0)


def as_row(logits: torch.Tensor) -> torch.Tensor:
    """`logits` as a 1-D float32 row: the caller's tensor itself when it already is one (no
    torch call: right after a step each costs several us), else a flat float32 view/copy."""
    if logits.dim() == 1 and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits
    return logits.detach().reshape(-1).to(torch.float32)


def first_argmax(row: torch.Tensor) -> int:
    """The first maximum of a 1-D float32 CPU row (torch.argmax's and llama.cpp's greedy
    choice), `kernels.first_max`: one vectorised scan where torch.argmax took ~34 us on a
    49k vocabulary and torch.isnan(row).any() ~47 more (262k: 170 + 245). A NaN ranks
    highest, so the row holds a NaN iff its value at first_argmax(row) is one: one pass
    checks both."""
    return first_max(row)[0]


def apply_penalties(logits: torch.Tensor, history: Sequence[int], cfg: SamplingConfig) -> None:
    """llama_sampler_penalties on a float32 [n_vocab] row, in place."""
    if not cfg.penalties_on or not history:
        return
    window = history if cfg.repeat_last_n < 0 else history[-cfg.repeat_last_n:]
    counts = Counter(int(t) for t in window)
    n = logits.shape[0]
    ids = torch.tensor([t for t in counts if 0 <= t < n], dtype=torch.long)
    if ids.numel() == 0:
        return
    cnt = torch.tensor([counts[int(t)] for t in ids], dtype=torch.float32)
    x = logits[ids]
    x = torch.where(x <= 0, x * cfg.repeat_penalty, x / cfg.repeat_penalty)
    x = x - (cnt * cfg.frequency_penalty + cfg.presence_penalty)
    logits[ids] = x


def _sorted_desc(ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-vals, kind="stable")
    return ids[order], vals[order]


def _nucleus(ids: np.ndarray, vals: np.ndarray, top_p: float, is_sorted: bool):
    """Smallest descending prefix whose probability mass (softmax over every current
    candidate, float32 as llama.cpp) reaches top_p. A large unsorted set is first
    tried with its best 256, widening to all of it only when those fall short."""
    m = np.float32(vals[0] if is_sorted else vals.max())
    p = np.exp(vals - m, dtype=np.float32)
    total = np.cumsum(p, dtype=np.float32)[-1]
    p = p / total
    windows = [vals.shape[0]] if is_sorted or vals.shape[0] <= 1024 else [256, vals.shape[0]]
    for k in windows:
        if is_sorted:
            order = np.arange(k)
        elif k < vals.shape[0]:
            part = np.argpartition(-vals, k - 1)[:k]
            order = part[np.argsort(-vals[part], kind="stable")]
        else:
            order = np.argsort(-vals, kind="stable")
        cum = np.cumsum(p[order], dtype=np.float32)
        hit = np.nonzero(cum >= np.float32(top_p))[0]
        if hit.size or k == vals.shape[0]:
            keep = int(hit[0]) + 1 if hit.size else k
            return ids[order[:keep]], vals[order[:keep]]
    raise AssertionError("unreachable")


def sample_candidates(logits: np.ndarray, cfg: SamplingConfig, u: float) -> int:
    """The sampled half of the chain (top-k → top-p → min-p → temperature → dist) over a
    float32 [n_vocab] row, given the draw u in [0, 1). Returns the token id."""
    ids = np.arange(logits.shape[0])
    vals = logits.astype(np.float32, copy=False)
    finite = np.isfinite(vals) | (vals > 0)  # -inf (masked) candidates never win a draw
    if not finite.all():
        ids, vals = ids[finite], vals[finite]
    is_sorted = False
    if cfg.top_k > 0:                                          # llama_sampler_top_k
        k = min(cfg.top_k, vals.shape[0])
        if k < vals.shape[0]:
            part = np.argpartition(-vals, k - 1)[:k]
            ids, vals = ids[part], vals[part]
        ids, vals = _sorted_desc(ids, vals)
        is_sorted = True
    if cfg.top_p < 1.0 and vals.shape[0] > 1:                  # llama_sampler_top_p
        ids, vals = _nucleus(ids, vals, cfg.top_p, is_sorted)
        is_sorted = True
    if cfg.min_p > 0.0 and vals.shape[0] > 1:                  # llama_sampler_min_p
        lo = np.float32(vals.max()) + np.log(np.float32(cfg.min_p))
        keep = vals >= lo
        ids, vals = ids[keep], vals[keep]
    vals = vals / np.float32(cfg.temperature)                  # llama_sampler_temp
    if vals.shape[0] == 1:                                      # llama_sampler_dist
        return int(ids[0])
    p = np.exp(vals - (vals[0] if is_sorted else vals.max()), dtype=np.float32).astype(np.float64)
    cum = np.cumsum(p)
    target = cum[-1] * u
    i = int(np.searchsorted(cum, target, side="left"))
    return int(ids[min(i, ids.shape[0] - 1)])


class Sampler:
    """One decode stream's sampling state: config, RNG, optional logit processor.
    Not thread-safe; one per stream."""

    def __init__(self, config: SamplingConfig | None = None, processor: LogitProcessor | None = None):
        self.config = config or SamplingConfig()
        self.processor = processor
        self.rng = MT19937(self.config.seed)
        self.draws = 0

    def reseed(self, seed: int | None = None) -> None:
        if seed is not None:
            self.config = replace(self.config, seed=seed)
        self.rng = MT19937(self.config.seed)
        self.draws = 0

    def next(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """Pick the next token from one logits row [n_vocab] (or [1, n_vocab]).
        The caller's tensor is not modified."""
        cfg = self.config
        row = as_row(logits)
        proc = self.processor
        masked = proc if proc is not None and type(proc).allows is not LogitProcessor.allows else None
        edits = proc is not None and masked is None
        if edits or (cfg.penalties_on and history):
            row = row.clone()          # processed in place: the caller's row stays as it was
            if edits:
                proc.process(row, history)
            apply_penalties(row, history, cfg)
        best, top = first_max(row)
        if top != top:
            raise SamplingError("logits contain NaN")
        if not top > float("-inf"):
            raise SamplingError("every token is masked: nothing can be sampled")
        if masked is not None:
            token = self._pick_constrained(row, best, masked)
        elif cfg.greedy:
            token = best
        else:
            u = self.rng.uniform()
            self.draws += 1
            token = sample_candidates(row.numpy(), cfg, u)
        if proc is not None:
            proc.commit(token)
        return token

    def _pick_constrained(self, row: torch.Tensor, best: int, constraint) -> int:
        """Choose under a grammar mask without paying for the mask when the first choice
        is legal: greedy tests the argmax; sampling without truncation draws first and
        keeps an allowed token, else draws again from the masked row. Both pick from
        exactly the masked distribution (a token t with unmasked probability p_t, where
        the allowed mass is A: p_t + (1 - A) * p_t / A = p_t / A). With top-k, top-p or
        min-p the truncation must see the masked row, so the mask is applied first."""
        cfg = self.config
        if cfg.greedy and constraint.allows(best):
            return best
        fast = not cfg.greedy and cfg.top_k <= 0 and cfg.top_p >= 1.0 and cfg.min_p <= 0.0
        if fast:
            self.draws += 1
            token = sample_candidates(row.numpy(), cfg, self.rng.uniform())
            if constraint.allows(token):
                return token
        row = row.clone()              # may be the caller's row: masked in a copy
        constraint.process(row, ())
        best, top = first_max(row)
        if not top > float("-inf"):
            raise SamplingError("every token is masked: nothing can be sampled")
        if cfg.greedy:
            return best
        self.draws += 1
        return sample_candidates(row.numpy(), cfg, self.rng.uniform())
