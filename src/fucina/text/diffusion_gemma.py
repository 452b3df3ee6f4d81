"""diffusion-gemma's generation: fixed-length canvases denoised by the entropy-bound (EB)
sampler and committed block-autoregressively (the passes: models/diffusion_gemma.py).

`generate` encodes the prompt causally into the cache once; then, per block, denoises a
canvas of `canvas_length` positions over it, keeps the canvas up to its first
end-of-generation token (or the start of a runaway repetition: one token repeated at
stride 1 or 2 over 7+ positions), and, unless the reply is over, encodes the whole
canvas into the cache so the next block reads it. Block b is denoised with seed + b.

One canvas (`denoise_canvas`): the canvas starts as uniform-random token ids; step s of
S (s = 0 first) runs at temperature t = t_min + (t_max - t_min) * (S - s) / S, so from
t_max down to just above t_min; one canvas pass, then per position the argmax, the
entropy of softmax(z / t) and one multinomial draw from it; the positions are accepted
by ascending entropy while the summed entropy of the strictly-lower ones stays within
`entropy_bound`; accepted positions keep their draw, the rest are renoised with fresh
uniform-random ids; the next pass conditions on this step's softmax(z / t)
(self-conditioning, when the file has the MLP). The denoising stops early once the
argmax canvas has held still for `stability_threshold` steps with mean entropy under
`confidence_threshold`; the result is the last argmax canvas.

Randomness is pre-drawn single-threaded from a counter-based generator (numpy's Philox
keyed by the block's seed): the canvas init, then per step C uniforms and C renoise
ids, so the draws do not depend on the thread count. The sampler's sums run in float64
in vocabulary order (the draw: the first id whose cumulative mass reaches u * Z).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from fucina.errors import ContextFull, InvalidArgument
from fucina.models.schema.diffusion_gemma import EbParams
from fucina.text.sampler import check_numbers, with_keywords

ROWS = 16          # canvas rows per sampler chunk (bounds the float64 scratch: ROWS x vocab)


@dataclass(frozen=True)
class GemmaDiffusionConfig(EbParams):
    """The EB sampler's settings (EbParams: the file's, else the reference generation
    config's), the seed, and the self-conditioning switch and its candidate cut."""
    seed: int = 0
    self_conditioning: bool = True
    sc_p_min: float = 1e-6
    sc_max_per_row: int = 512

    def __post_init__(self):
        check_numbers(self, InvalidArgument, "diffusion ", skip=("self_conditioning",))
        if self.max_steps < 1:
            raise InvalidArgument(f"diffusion steps must be >= 1, got {self.max_steps}")
        if not 0 < self.t_min <= self.t_max:
            raise InvalidArgument(f"temperatures must satisfy 0 < t_min <= t_max, got {self.t_min}, {self.t_max}")
        if self.entropy_bound < 0 or self.confidence_threshold < 0 or self.stability_threshold < 0:
            raise InvalidArgument("entropy_bound, confidence_threshold and stability_threshold must be >= 0")
        if not 0 <= self.sc_p_min < 1 or self.sc_max_per_row < 1:
            raise InvalidArgument("sc_p_min must be in [0, 1) and sc_max_per_row >= 1")

    @classmethod
    def for_model(cls, model, **kw: Any) -> "GemmaDiffusionConfig":
        """The file's EB settings, then `kw` (`steps` for max_steps; None skipped; unknown
        names raise)."""
        if "steps" in kw:
            kw["max_steps"] = kw.pop("steps")
        eb = model.config.eb
        base = cls(**{f.name: getattr(eb, f.name) for f in fields(EbParams)})
        return with_keywords(cls, base, kw, InvalidArgument, "diffusion-gemma")


KEYS = frozenset(f.name for f in fields(GemmaDiffusionConfig)) - {"max_steps"} | {"steps"}
#: keywords only a diffusion-gemma model takes (an autoregressive model refuses them)
ONLY = KEYS - {"seed", "steps"}


@dataclass
class Pass:
    """One sampler pass over C rows: argmax, the draw, the entropy (nats) of softmax(z/t),
    and the self-conditioning candidates (None when not collected)."""
    argmax: np.ndarray     # int64 [C]
    sampled: np.ndarray    # int64 [C]
    entropy: np.ndarray    # float32 [C]
    sc: Any = None         # models.diffusion_gemma.ScSignal-shaped: ids, probs, offsets


@dataclass
class Signal:
    ids: np.ndarray
    probs: np.ndarray
    offsets: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1


def sampler_pass(logits: np.ndarray, temp: float, u: np.ndarray, *, collect_sc: bool = True,
                 sc_p_min: float = 1e-6, sc_max_per_row: int = 512) -> Pass:
    """Per row of float32 logits [C, V] at temperature `temp`, row c drawing with u[c]."""
    C, V = logits.shape
    if u.shape != (C,):
        raise InvalidArgument(f"{u.shape[0] if u.ndim else 0} uniforms for {C} canvas rows")
    inv = np.float32(1.0) / np.float32(temp)
    argmax = np.empty(C, np.int64)
    sampled = np.empty(C, np.int64)
    entropy = np.empty(C, np.float32)
    sc_ids, sc_probs, counts = [], [], np.zeros(C, np.int64)
    for r0 in range(0, C, ROWS):
        z = logits[r0:r0 + ROWS].astype(np.float32, copy=False) * inv
        top = z.argmax(axis=1)
        d = (z - z[np.arange(z.shape[0]), top][:, None]).astype(np.float64)
        e = np.exp(d)
        cum = np.cumsum(e, axis=1)
        Z = cum[:, -1]
        entropy[r0:r0 + ROWS] = (np.log(Z) - (e * d).sum(axis=1) / Z).astype(np.float32)
        target = u[r0:r0 + ROWS].astype(np.float64) * Z
        hit = cum >= target[:, None]
        sampled[r0:r0 + ROWS] = np.where(hit.any(axis=1), hit.argmax(axis=1), V - 1)
        argmax[r0:r0 + ROWS] = top
        if collect_sc:
            for j in range(z.shape[0]):
                keep = np.nonzero(e[j] >= sc_p_min * Z[j])[0]
                if keep.size > sc_max_per_row:     # the most probable, in id order
                    keep = np.sort(keep[np.argsort(-e[j, keep], kind="stable")[:sc_max_per_row]])
                if keep.size == 0:
                    keep = top[j:j + 1]
                p = e[j, keep]
                sc_ids.append(keep.astype(np.int64))
                sc_probs.append((p / p.sum()).astype(np.float32))
                counts[r0 + j] = keep.size
    sc = None
    if collect_sc:
        sc = Signal(np.concatenate(sc_ids), np.concatenate(sc_probs),
                    np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
    return Pass(argmax, sampled, entropy, sc)


def entropy_bound_accept(entropy: np.ndarray, bound: float) -> np.ndarray:
    """Positions accepted by ascending entropy (ties: the earlier position first) while
    the summed entropy of those before it in that order is <= bound; bool [C]."""
    order = np.argsort(entropy, kind="stable")
    h = entropy[order].astype(np.float64)
    before = np.concatenate([[0.0], np.cumsum(h)[:-1]])
    accepted = np.zeros(entropy.shape[0], bool)
    accepted[order[before <= bound]] = True
    return accepted


class Draws:
    """The block's pre-drawn randomness: Philox keyed by the seed, drawn in one order."""

    def __init__(self, seed: int, vocab: int):
        self.g = np.random.Generator(np.random.Philox(key=seed & 0xFFFFFFFFFFFFFFFF))
        self.vocab = vocab

    def tokens(self, n: int) -> np.ndarray:
        return self.g.integers(0, self.vocab, n, dtype=np.int64)

    def uniforms(self, n: int) -> np.ndarray:
        return self.g.random(n, dtype=np.float32)


@dataclass
class Step:
    """What a step callback sees: the step (0-based, per canvas), the argmax canvas, the
    acceptance and the mean entropy."""
    index: int
    total: int
    argmax: np.ndarray
    accepted: np.ndarray
    mean_entropy: float


def denoise_canvas(model, cache, cfg: GemmaDiffusionConfig, seed: int,
                   on_step: Callable[[Step], Any] | None = None) -> tuple[np.ndarray, int]:
    """One canvas of the model's canvas_length over what `cache` holds (left unchanged);
    returns (the final argmax canvas, steps run)."""
    C, V = model.config.canvas_length, model.config.n_vocab
    if cache.len + C > cache.capacity:
        raise ContextFull(f"{cache.len} cached + a canvas of {C} exceed the cache's {cache.capacity} positions")
    draws = Draws(seed, V)
    canvas = draws.tokens(C)
    use_sc = cfg.self_conditioning and model.has_self_conditioning
    sc, prev, held, steps = None, None, 0, 0
    S = cfg.max_steps
    t_min, t_max = np.float32(cfg.t_min), np.float32(cfg.t_max)
    argmax = canvas
    for s in range(S):
        t = t_min + (t_max - t_min) * (np.float32(S - s) / np.float32(S))
        u, renoise = draws.uniforms(C), draws.tokens(C)
        logits = model.canvas_forward(cache, canvas, sc).float().numpy()
        p = sampler_pass(logits, float(t), u, collect_sc=use_sc, sc_p_min=cfg.sc_p_min,
                         sc_max_per_row=cfg.sc_max_per_row)
        steps += 1
        accepted = entropy_bound_accept(p.entropy, cfg.entropy_bound)
        canvas = np.where(accepted, p.sampled, renoise)
        argmax = p.argmax
        mean = float(p.entropy.astype(np.float64).mean())
        if on_step is not None:
            on_step(Step(s, S, argmax, accepted, mean))
        if use_sc:
            sc = p.sc
        held = held + 1 if prev is not None and np.array_equal(prev, argmax) else 0
        prev = argmax
        if held >= cfg.stability_threshold and mean < cfg.confidence_threshold:
            break
    return argmax.copy(), steps


def repetition_onset(tokens: Sequence[int], run: int = 6) -> int | None:
    """Where a runaway repetition starts: the first position from which `run` consecutive
    positions each repeat the token 1 (or, failing that, 2) before them."""
    t = np.asarray(tokens)
    for stride in (1, 2):
        if t.size < stride + run:
            continue
        same = t[stride:] == t[:-stride]
        n = 0
        for j, eq in enumerate(same):
            n = n + 1 if eq else 0
            if n >= run:
                return j - run + 1
    return None


@dataclass
class Block:
    index: int
    kept: list[int]
    steps: int
    stopped: bool      # cut at an end-of-generation token or a repetition: the reply is over


def blocks(model, cache, prompt: Sequence[int], max_tokens: int, cfg: GemmaDiffusionConfig,
           eog: set[int], on_step: Callable[[Step], Any] | None = None) -> Iterator[Block]:
    """Encode `prompt` into the empty `cache`, then denoise and commit block after block,
    yielding each block's kept tokens, until max_tokens or an end-of-generation token."""
    if not prompt:
        raise InvalidArgument("the prompt encodes to no tokens")
    C = model.config.canvas_length
    if len(prompt) + C > cache.capacity:
        raise ContextFull(f"the prompt ({len(prompt)} tokens) and a canvas of {C} exceed the context of "
                          f"{cache.capacity}")
    cache.reset()
    model.encode_step(cache, list(prompt), 0)
    produced, b = 0, 0
    while produced < max_tokens:
        if cache.len + C > cache.capacity:
            return      # the context is full: the reply ends here (finish "length")
        canvas, steps = denoise_canvas(model, cache, cfg, cfg.seed + b, on_step)
        cut = next((i for i, tok in enumerate(canvas.tolist()) if tok in eog), None)
        finished = cut is not None
        if cut is None:
            cut = repetition_onset(canvas)
            finished = cut is not None
        keep = min(C if cut is None else cut, max_tokens - produced)
        produced += keep
        last = finished or produced >= max_tokens
        yield Block(b, canvas[:keep].tolist(), steps, finished)
        if last:
            return
        model.encode_step(cache, canvas, cache.len)
        b += 1


def capacity(n_prompt: int, max_tokens: int, canvas: int) -> int:
    """The cache a reply of max_tokens needs: the prompt, the committed canvases and one
    canvas being denoised."""
    return n_prompt + max(1, -(-max_tokens // canvas)) * canvas


def reply(model, tokenizer, ids: Sequence[int], max_tokens: int, cfg: GemmaDiffusionConfig, n_ctx: int,
          on_step: Callable[[Step], Any] | None = None):
    """Yield the reply's text block by block as each is committed; returns a
    generate.Reply (finish "stop" at an end-of-generation token or a trimmed repetition)."""
    from fucina.text.generate import PieceStream, Reply

    C = model.config.canvas_length
    if len(ids) + C > n_ctx:
        raise ContextFull(f"the prompt ({len(ids)} tokens) and a canvas of {C} positions exceed the context of "
                          f"{n_ctx}")
    cache = model.init_cache(min(capacity(len(ids), max_tokens, C), n_ctx))
    eog = set(getattr(tokenizer, "eog_ids", ()) or ())
    done = Reply(prompt_tokens=len(ids))
    pieces = PieceStream(tokenizer)
    for blk in blocks(model, cache, ids, max_tokens, cfg, eog, on_step):
        done.tokens += blk.kept
        text = "".join(pieces.push(t) for t in blk.kept)
        done.steps = getattr(done, "steps", 0) + blk.steps
        if blk.stopped:
            done.finish_reason = "stop"
        if text:
            done.text += text
            yield text
    tail = pieces.flush()
    if tail:
        done.text += tail
        yield tail
    return done
