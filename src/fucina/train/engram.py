"""Training an Engram graft on a frozen (still quantized) model: only the graft's
parameters learn; the model's blocks run in torch with autograd through them
(train.forward's TrainCache), the graft's hooks adding its memory before its layers. The
layers below the first memory layer do not depend on the graft: they run once per
window, without gradient, and each step starts from their output.

The tokenizer's compression table (the reference's normalisation: NFKC, NFD, accents
stripped, lower case, runs of whitespace as one space, a lone space kept) is built here,
from the tokenizer, and travels in the graft's file: inference needs no tokenizer.
"""
from __future__ import annotations

import math
import re
import time
import unicodedata
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fucina.errors import FucinaError
from fucina.models.engram import Engram
from fucina.train.forward import TrainCache

_WS = re.compile(r"[ \t\r\n]+")


def normalize(text: str) -> str:
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = "".join(ch for ch in t if unicodedata.category(ch) != "Mn").lower()
    t = _WS.sub(" ", t)
    return " " if t == " " else t.strip()


def compress_table(tok) -> np.ndarray:
    """int64 [n_vocab]: token id -> the first id with the same normal form (its text, or
    its token string when the piece alone is not valid UTF-8)."""
    first: dict[str, int] = {}
    out = np.empty(tok.n_vocab, dtype=np.int64)
    for tid in range(tok.n_vocab):
        text = tok.token_to_piece(tid).decode("utf-8", errors="replace")
        key = tok.token_text(tid) if "\ufffd" in text else (normalize(text) or text)
        out[tid] = first.setdefault(key, len(first))
    return out


def windows(ids: Sequence[int], ctx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, next-token labels) of ctx tokens each, starting every ctx / 2 tokens (the
    last one ends at the corpus's end)."""
    if len(ids) < 2:
        raise FucinaError("engram training: the corpus encodes to fewer than 2 tokens")
    n = min(ctx, len(ids) - 1)
    starts = sorted(set(range(0, len(ids) - n, max(1, n // 2))) | {len(ids) - 1 - n})
    t = torch.tensor(list(ids), dtype=torch.long)
    return [(t[s:s + n], t[s + 1:s + n + 1]) for s in starts]


@torch.no_grad()
def prefix(model, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The residual entering `layer` (no graft, no gradient: the frozen layers below the
    first memory layer give the same rows every step, so they run once per window)."""
    x = model.embed(ids).float()
    cache = TrainCache(model, ids.numel())
    for i in range(layer):
        x = model.block(i, x, cache, 0)
    return x


def window_loss(model, x: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, start: int) -> torch.Tensor:
    """Mean next-token cross-entropy of layers start.. (residual hooks included) and the head."""
    cache = TrainCache(model, ids.numel())
    for i in range(start, model.config.n_layer):
        if i in model.residual_hooks:
            x = model.run_hooks(i, x, ids, 0, cache)
        x = model.block(i, x, cache, 0)
    return F.cross_entropy(model.head(x).float(), labels)


def fit(model, params: list[torch.Tensor], ids: Sequence[int], start: int, *, steps: int, lr: float, ctx: int,
        seed: int = 0, log: Callable[[str], None] | None = None) -> list[float]:
    """`steps` Adam steps (cosine schedule to zero) on `params` over windows of `ids` in a
    seeded order, the forward starting at layer `start` from each window's cached prefix;
    returns each step's loss."""
    if steps < 1:
        raise FucinaError("engram training: --steps must be >= 1")
    opt = torch.optim.Adam(params, lr=lr)
    rng = np.random.default_rng(seed)
    wins = [(prefix(model, x, start), x, y) for x, y in windows(ids, ctx)]
    losses, t0, order = [], time.perf_counter(), []
    for step in range(steps):
        if not order:
            order = list(rng.permutation(len(wins)))
        h, x, y = wins[order.pop()]
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = window_loss(model, h, x, y, start)
            loss.backward()
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.step()
        losses.append(loss.item())
        if log and (step % 10 == 0 or step == steps - 1):
            log(f"step {step + 1}/{steps}  loss {losses[-1]:.4f}  {time.perf_counter() - t0:.0f} s")
    return losses


def train(model, eng: Engram, ids: Sequence[int], *, steps: int, lr: float = 3e-3, ctx: int = 256, seed: int = 0,
          log: Callable[[str], None] | None = None) -> list[float]:
    """Train only the graft's parameters (attached while it trains); each step's loss."""
    params = list(eng.parameters())
    for p in params:
        p.requires_grad_(True)
    attached = eng._attached is not None
    if not attached:
        eng.attach(model)
    try:
        return fit(model, params, ids, min(eng.plan.layer_ids), steps=steps, lr=lr, ctx=ctx, seed=seed, log=log)
    finally:
        for p in params:
            p.requires_grad_(False)
        if not attached:
            eng.detach()


def trainable_parameters(eng: Engram) -> int:
    return sum(p.numel() for p in eng.parameters())
