"""Text diffusion: llama.cpp's denoising loop (examples/diffusion), so the same settings
give the same canvas.

A canvas of `canvas` positions holds the prompt, then mask tokens. Each step runs the
model over the whole canvas (bidirectional: `Denoiser.forward_canvas`), samples a token
for every masked position of the current block, and keeps some of them:

- the schedule: timestep-based (`eps` > 0, Dream's: of the r masked positions step s of
  S keeps int(r * (1 - s'/t)), t = 1 - s/S (1 - eps), s' the same at s + 1, all of them
  at the last step) or block-based (`block_length` > 0, LLaDA's: the canvas is cut into
  canvas / block_length blocks starting after the prompt, each denoised for
  steps / blocks steps keeping an even share of its masks per step);
- the algorithm picks which: 0 origin (each masked position kept with the step's
  probability, by a draw), 1 entropy, 2 margin, 3 random, 4 confidence (the sampled
  token's probability), highest first, ties to the earlier position;
- sampling is llama.cpp's chain for this loop: top-k (if > 0), top-p (if < 1),
  temperature (only if > 0: temperature 0 samples at temperature 1, as llama.cpp does;
  `top_k=1` is the deterministic setting), then one draw. Two Mersenne Twisters seeded
  with `seed` as llama.cpp's: the chain's draw (doubles) and the loop's own (origin's
  and random's floats, gumbel noise's doubles).

Every float operation that decides a token is done in llama.cpp's precision and order
(float32 softmax, double cumulative draw, float32 schedule arithmetic). The logits shift
(`shift_logits`): position p reads row p - 1 (row 0 for p = 0).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from fucina.errors import InvalidArgument
from fucina.text.sampler import check_numbers, with_keywords

ALGORITHMS = ("origin", "entropy", "margin", "random", "confidence")
ORIGIN, ENTROPY, MARGIN, RANDOM, CONFIDENCE = range(5)


@dataclass(frozen=True)
class DiffusionConfig:
    """llama-diffusion-cli's settings, by its flag names; `canvas` is its `-ub`: the
    canvas length, prompt included. Neither eps nor block_length: eps 0.001."""
    canvas: int = 256
    steps: int = 128
    eps: float = 0.0
    block_length: int = 0
    algorithm: int = CONFIDENCE
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0
    add_gumbel_noise: bool = False

    def __post_init__(self):
        check_numbers(self, InvalidArgument, "diffusion ", skip=("add_gumbel_noise",))
        if self.canvas < 2:
            raise InvalidArgument(f"the canvas must hold at least 2 positions, got {self.canvas}")
        if self.steps < 1:
            raise InvalidArgument(f"diffusion steps must be >= 1, got {self.steps}")
        if self.eps < 0 or self.eps >= 1:
            raise InvalidArgument(f"diffusion eps must be in [0, 1), got {self.eps}")
        if self.block_length < 0:
            raise InvalidArgument(f"diffusion block length must be >= 0, got {self.block_length}")
        if self.eps and self.block_length:
            raise InvalidArgument("give diffusion eps (timestep schedule) or block length (block schedule), not both")
        if self.block_length:
            if self.canvas % self.block_length:
                raise InvalidArgument(f"the canvas ({self.canvas}) must be a multiple of the block length "
                                      f"({self.block_length})")
            if self.steps % (self.canvas // self.block_length):
                raise InvalidArgument(f"diffusion steps ({self.steps}) must be a multiple of the number of blocks "
                                      f"({self.canvas // self.block_length})")
        if not 0 <= self.algorithm < len(ALGORITHMS):
            raise InvalidArgument(f"diffusion algorithm must be 0-4 ({', '.join(ALGORITHMS)}), got {self.algorithm}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in [0, 1], got {self.top_p}")

    @property
    def schedule_eps(self) -> float:
        return self.eps if self.eps or self.block_length else 1e-3

    @classmethod
    def from_kwargs(cls, base: "DiffusionConfig | None" = None, **kw: Any) -> "DiffusionConfig":
        """From keyword names (None skipped; `temp` for temperature); unknown names raise."""
        return with_keywords(cls, base, kw, InvalidArgument, "diffusion")


DIFFUSION_KEYS = frozenset(f.name for f in fields(DiffusionConfig)) | {"temp"}


class StdMT:
    """std::mt19937 seeded with one 32-bit value, and libstdc++'s uniform_real_distribution
    on it: a double from two outputs (a + b 2^32) / 2^64, a float from one, float(a) / 2^32,
    each clamped below 1."""

    def __init__(self, seed: int):
        self._bg = np.random.MT19937()
        self._bg._legacy_seeding(seed & 0xFFFFFFFF)   # init_genrand: std::mt19937(seed)

    def doubles(self, n: int) -> np.ndarray:
        r = self._bg.random_raw(2 * n).astype(np.float64).reshape(n, 2)
        u = (r[:, 0] + r[:, 1] * 4294967296.0) / 18446744073709551616.0
        return np.minimum(u, np.nextafter(1.0, 0.0))

    def floats(self, n: int) -> np.ndarray:
        u = self._bg.random_raw(n).astype(np.float32) / np.float32(4294967296.0)
        return np.minimum(u, np.nextafter(np.float32(1.0), np.float32(0.0)))


def transfer_count(step: int, total: int, remaining: int, eps: float, block_counts: Sequence[int] | None) -> int:
    """How many of `remaining` masked positions step `step` of `total` keeps (float32, as
    llama.cpp's calculate_transfer_count)."""
    if block_counts is not None:
        return block_counts[step] if step < len(block_counts) else remaining // (total - step)
    one, e = np.float32(1.0), np.float32(eps)
    t = one - np.float32(step) / np.float32(total) * (one - e)
    s = one - np.float32(step + 1) / np.float32(total) * (one - e)
    p = one - s / t if step < total - 1 else one
    return int(np.float32(remaining) * p)


def block_counts(masked: int, steps: int) -> list[int]:
    base, extra = divmod(masked, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


@dataclass
class Draws:
    """The chain's result for M rows: kept candidates per row (ids, probabilities, in the
    chain's order, `size` of them) and the selected column."""
    ids: np.ndarray      # [M, K] int64
    p: np.ndarray        # [M, K] float32 (0 past size)
    size: np.ndarray     # [M]
    sel: np.ndarray      # [M]

    @property
    def tokens(self) -> np.ndarray:
        return self.ids[np.arange(self.ids.shape[0]), self.sel]


def _top(vals: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of each row, descending, ties to the lower id: (ids, values)."""
    M, V = vals.shape
    if k < V:
        part = np.sort(np.argpartition(-vals, k - 1, axis=1)[:, :k], axis=1)
    else:
        part = np.broadcast_to(np.arange(V), (M, V))
    pv = np.take_along_axis(vals, part, axis=1)
    order = np.argsort(-pv, axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1), np.take_along_axis(pv, order, axis=1)


def sample_rows(logits: np.ndarray, top_k: int, top_p: float, temperature: float, u: np.ndarray) -> Draws:
    """llama.cpp's chain (top-k, top-p, temperature, dist) on each row of float32 logits
    [M, V], row i drawing with u[i]."""
    M, V = logits.shape
    vals = logits.astype(np.float32, copy=False)
    ids = np.broadcast_to(np.arange(V), (M, V))
    is_sorted = False
    if top_k > 0:
        ids, vals = _top(vals, min(top_k, V))
        is_sorted = True
    size = np.full(M, vals.shape[1])
    if top_p < 1.0:   # softmax in the current order (summed in it), then sorted
        top = vals[:, :1] if is_sorted else vals.max(axis=1, keepdims=True)
        e = np.exp(vals - top, dtype=np.float32)
        p = e / np.cumsum(e, axis=1, dtype=np.float32)[:, -1:]
        if not is_sorted:
            ids, vals = _top(vals, V)
            p = np.take_along_axis(p, ids, axis=1)
            is_sorted = True
        hit = np.cumsum(p, axis=1, dtype=np.float32) >= np.float32(top_p)
        size = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, vals.shape[1])
    if temperature > 0:
        vals = vals / np.float32(temperature)
    live = np.arange(vals.shape[1])[None, :] < size[:, None]
    top = vals[:, :1] if is_sorted else vals.max(axis=1, keepdims=True)
    e = np.where(live, np.exp(np.where(live, vals - top, np.float32(0)), dtype=np.float32), np.float32(0))
    run = np.cumsum(e.astype(np.float64), axis=1)
    total = run[:, -1]
    sel = np.argmax(run >= (total * u)[:, None], axis=1)
    p = (e.astype(np.float64) / total[:, None]).astype(np.float32)
    one = size == 1
    if one.any():
        p[one, 0] = 1.0
    return Draws(np.ascontiguousarray(ids), p, size, sel)


def confidence(d: Draws, algorithm: int, rng: StdMT) -> np.ndarray:
    """Each row's confidence (llama.cpp's calculate_confidence), float32."""
    M = d.p.shape[0]
    if algorithm in (CONFIDENCE, ORIGIN):
        return d.p[np.arange(M), d.sel]
    if algorithm == ENTROPY:   # llama.cpp returns -sum p log(p + 1e-10): the entropy, ranked highest first
        terms = d.p * np.log(d.p + np.float32(1e-10), dtype=np.float32)
        live = np.arange(d.p.shape[1])[None, :] < d.size[:, None]
        return -np.cumsum(np.where(live, terms, np.float32(0)), axis=1, dtype=np.float32)[:, -1]
    if algorithm == MARGIN:    # the first two in the chain's order (sorted only after top-k/top-p)
        second = d.p[:, 1] if d.p.shape[1] > 1 else np.zeros(M, np.float32)
        return np.where(d.size > 1, d.p[:, 0] - second, d.p[:, 0]).astype(np.float32)
    return rng.floats(M)       # RANDOM


def gumbel(row: np.ndarray, temperature: float, rng: StdMT) -> np.ndarray:
    """llama.cpp's add_gumbel_noise on one row: exp(l) / (-log u)^temperature."""
    u = np.maximum(rng.doubles(row.shape[0]), 1e-20)
    return (np.exp(row, dtype=np.float32) / np.power(-np.log(u), temperature)).astype(np.float32)


StepCallback = Callable[[int, int, np.ndarray], bool | None]


def denoise(model, prompt: Sequence[int], cfg: DiffusionConfig, on_step: StepCallback | None = None) -> list[int]:
    """The canvas after llama.cpp's loop (prompt included). `on_step(step, steps, canvas)`
    before each step (False ends the block, as llama.cpp's callback does)."""
    out = None
    for _, _, out in blocks(model, prompt, cfg, on_step):
        pass
    return out.tolist()


def blocks(model, prompt: Sequence[int], cfg: DiffusionConfig,
           on_step: StepCallback | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
    """llama.cpp's loop, yielding (start, end, canvas) as each block is done (one block,
    the whole canvas, under the timestep schedule); the canvas array is live."""
    c = model.config
    mask = c.mask_token_id
    n_input, L = len(prompt), cfg.canvas
    if n_input < 1:
        raise InvalidArgument("the prompt encodes to no tokens")
    if L <= n_input:
        raise InvalidArgument(f"the canvas ({L}) must be longer than the prompt ({n_input} tokens)")
    if any(int(t) == mask for t in prompt):
        raise InvalidArgument(f"the prompt holds the mask token ({mask})")
    cache = model.canvas_cache(L)
    out = np.full(L, mask, dtype=np.int64)
    out[:n_input] = np.asarray(prompt, dtype=np.int64)
    rng, dist = StdMT(cfg.seed), StdMT(cfg.seed)
    blocked = cfg.block_length > 0
    n_blocks = L // cfg.block_length if blocked else 1
    per_block = cfg.steps // n_blocks
    eps = cfg.schedule_eps
    for b in range(n_blocks):
        start = n_input + b * cfg.block_length if blocked else 0
        end = min(n_input + (b + 1) * cfg.block_length, L) if blocked else L
        if start >= end:
            break   # llama.cpp's blocks start after the prompt: the last ones fall off the canvas
        counts = block_counts(int((out[start:end] == mask).sum()), per_block) if blocked else None
        for step in range(per_block):
            if on_step is not None and on_step(b * per_block + step, cfg.steps, out) is False:
                break
            where = np.nonzero(out[start:end] == mask)[0] + start
            if where.size == 0:
                break
            _step(model, cache, out, where, step, per_block, eps, counts, cfg, rng, dist)
        yield max(start, n_input), end, out


def _step(model, cache, out, where, step, total, eps, counts, cfg: DiffusionConfig, rng: StdMT, dist: StdMT) -> None:
    import torch

    shift = model.config.shift_logits
    rows = np.maximum(where - 1, 0) if shift else where
    need, inv = np.unique(rows, return_inverse=True)
    logits = model.forward_canvas(torch.from_numpy(out), cache, rows=torch.from_numpy(need)).numpy()
    if cfg.add_gumbel_noise and cfg.temperature > 0:   # llama.cpp noises the first row only
        noisy = gumbel(logits[0] if need[0] == 0 else np.zeros(model.config.n_vocab, np.float32), cfg.temperature, rng)
        if need[0] == 0:
            logits = logits.copy()
            logits[0] = noisy
    n = where.size
    keep = transfer_count(step, total, n, eps, counts)
    if cfg.algorithm == ORIGIN:
        p = np.float32(keep) / np.float32(n)
        chosen = np.nonzero(rng.floats(n) < p)[0]
        if chosen.size:
            d = sample_rows(logits[inv[chosen]], cfg.top_k, cfg.top_p, cfg.temperature, dist.doubles(chosen.size))
            out[where[chosen]] = d.tokens
        return
    d = sample_rows(logits[inv], cfg.top_k, cfg.top_p, cfg.temperature, dist.doubles(n))
    conf = confidence(d, cfg.algorithm, rng)
    if keep > 0:
        order = np.lexsort((np.arange(n), -conf.astype(np.float64)))[:min(keep, n)]
        out[where[order]] = d.tokens[order]


# -- the reply: what the API, the CLI and the server stream -----------------------------

#: keywords that only a diffusion model takes (the sampling ones are shared)
DIFFUSION_ONLY = frozenset(("canvas", "steps", "eps", "block_length", "algorithm", "add_gumbel_noise"))


def is_diffusion(model) -> bool:
    return bool(getattr(model, "diffusion", False))


def fit(n_prompt: int, max_tokens: int, kw: dict) -> dict:
    """Settings left unset, for a reply of `max_tokens` after `n_prompt` prompt tokens:
    the canvas holds the prompt and the reply, rounded up to whole blocks under a block
    schedule, whose steps (default 128) are then rounded down to a multiple of the blocks."""
    kw = dict(kw)
    b = kw.get("block_length") or 0
    if kw.get("canvas") is None:
        n = n_prompt + max(max_tokens, 1)
        kw["canvas"] = -(-n // b) * b if b else n
    if b and kw.get("steps") is None and kw["canvas"] % b == 0:
        blocks = kw["canvas"] // b
        kw["steps"] = blocks * max(1, DiffusionConfig.steps // blocks)
    return kw


def reply(model, tokenizer, ids: Sequence[int], cfg: DiffusionConfig, on_step: StepCallback | None = None):
    """Denoise after `ids`, yielding the reply's text as it is committed: block by block
    under a block schedule (a finished block never changes), all at once otherwise. The
    reply ends at its first end-of-generation token (no later block is denoised).
    Returns a generate.Reply."""
    from fucina.text.generate import PieceStream, Reply

    eog = set(getattr(tokenizer, "eog_ids", ()) or ())
    done = Reply(prompt_tokens=len(ids))
    pieces = PieceStream(tokenizer)
    for start, end, canvas in blocks(model, ids, cfg, on_step):
        text = _emit(canvas[start:end].tolist(), eog, done, pieces)
        if text:
            yield text
        if done.finish_reason == "stop":
            break
    tail = pieces.flush()
    if tail:
        done.text += tail
        yield tail
    return done


def _emit(tokens: list[int], eog: set[int], done, pieces) -> str:
    """Commit `tokens` to the reply up to the first end-of-generation token."""
    if done.finish_reason == "stop":
        return ""
    out = []
    for t in tokens:
        if t in eog:
            done.finish_reason, done.stop_token = "stop", t
            break
        done.tokens.append(t)
        out.append(pieces.push(t))
    text = "".join(out)
    done.text += text
    return text
