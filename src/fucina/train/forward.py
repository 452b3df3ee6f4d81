"""The training forward: the family's own torch blocks, one checkpointed segment per layer,
and cross-entropy on the supervised positions only.

Blocks write K/V into a cache object; during training a `_LayerKV` stands in for it and
just hands the layer's (differentiable) K/V back to the attention, so every family that
routes attention through `models.base.attend` trains with no change to its code.

Memory: with `checkpoint=True` only each layer's input [T, n_embd] is kept between forward
and backward; the layer is recomputed during backward (one extra forward). The LM head runs
on the supervised rows only, in chunks, each chunk checkpointed too, so the
[T, n_vocab] logits never exist at once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HEAD_CHUNK = 256   # supervised rows per LM-head chunk ([256, 49152] f32 logits = 50 MB)


class _LayerKV:
    """Duck-typed KV cache for one block call at pos0 = 0: keeps what the block appends.
    `capacity` (the sequence length) is what a family reads to pick a context-dependent
    RoPE variant (phi3's LongRoPE factors)."""

    len = 0

    def __init__(self, capacity: int):
        self.capacity = capacity

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def span(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[start:end], self.v[start:end]


def _block(model, i: int, x: torch.Tensor) -> torch.Tensor:
    return model.block(i, x, _LayerKV(x.shape[0]), 0)


def hidden(model, ids: torch.Tensor, use_checkpoint: bool = True) -> torch.Tensor:
    """Final residual stream [T, n_embd] of one sequence (positions 0..T-1)."""
    x = model.embed(ids).float()
    grad = torch.is_grad_enabled()
    for i in range(model.config.n_layer):
        if use_checkpoint and grad:
            x = checkpoint(_block, model, i, x, use_reentrant=False, preserve_rng_state=False)
        else:
            x = _block(model, i, x)
    return x


def _head_loss(model, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model.head(h).float()
    return F.cross_entropy(logits, targets, reduction="sum")


def loss_sum(model, ids: torch.Tensor, labels: torch.Tensor, use_checkpoint: bool = True
             ) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over positions whose label is >= 0, and their count.
    `labels[t]` is the target for position t (already shifted; -100 = not supervised)."""
    x = hidden(model, ids, use_checkpoint)
    rows = (labels >= 0).nonzero().reshape(-1)
    total = x.new_zeros(())
    grad = torch.is_grad_enabled()
    for s in range(0, rows.numel(), HEAD_CHUNK):
        r = rows[s:s + HEAD_CHUNK]
        h, t = x[r], labels[r]
        if use_checkpoint and grad:
            total = total + checkpoint(_head_loss, model, h, t, use_reentrant=False,
                                       preserve_rng_state=False)
        else:
            total = total + _head_loss(model, h, t)
    return total, int(rows.numel())
