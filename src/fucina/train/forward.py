"""The training forward: the family's own torch blocks, one checkpointed segment per layer,
and cross-entropy on the supervised positions only.

Blocks write K/V into a cache object; during training a `_LayerKV` stands in for it and
just hands the layer's (differentiable) K/V back to the attention, so every family that
routes attention through `models.base.attend` trains with no change to its code.

Memory vs speed (`checkpoint`, one of CHECKPOINT_MODES; "auto", the default, is "off"
while a row's estimated activations fit AUTO_BUDGET_BYTES, else "keep-matmul"):
- "full": only each layer's input [T, n_embd] is kept between forward and backward; the
  layer is recomputed during backward (one extra forward);
- "keep-matmul": the same segments, but the frozen quantized matmuls' outputs are kept
  from the forward (`MatmulMemo`) and the recompute re-runs only the cheap ops (norms,
  RoPE, attention, activations, the LoRA deltas): +4 bytes per matmul output value;
- "off": torch keeps every activation (no recompute).
The LM head runs on the supervised rows only, in chunks (each a segment too), so the
[T, n_vocab] logits never exist at once.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from fucina.errors import FucinaError
from fucina.train.lora import MatmulMemo, recording

CHECKPOINT_MODES = ("auto", "full", "keep-matmul", "off")
DEFAULT_CHECKPOINT = "auto"
#: "auto" keeps every activation ("off") while a row's estimated activations fit this;
#: otherwise "keep-matmul"
AUTO_BUDGET_BYTES = int(float(os.environ.get("FUCINA_TRAIN_ACT_BUDGET_MB", "1024")) * (1 << 20))
HEAD_CHUNK = 256   # supervised rows per LM-head chunk ([256, 49152] f32 logits = 50 MB)


class _LayerKV:
    """Duck-typed KV cache for one block call at pos0 = 0: keeps what the block appends.
    `capacity` (the sequence length) is what a family reads to pick a context-dependent
    RoPE variant (phi3's LongRoPE factors)."""

    len = 0
    training = True   # models.base.attention: the flash SDPA (no [heads, T, T] probabilities kept)

    def __init__(self, capacity: int):
        self.capacity = capacity

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def span(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[start:end], self.v[start:end]


def checkpoint_mode(mode: bool | str, model=None, rows: int = 0) -> str:
    """True/False (older callers) -> the default / "off"; a name is checked; "auto" is
    resolved for rows of `rows` tokens (see `activation_bytes`)."""
    if mode is True:
        mode = DEFAULT_CHECKPOINT
    if mode is False:
        return "off"
    if mode not in CHECKPOINT_MODES:
        raise FucinaError(f"unknown gradient checkpointing mode {mode!r} ({', '.join(CHECKPOINT_MODES)})")
    if mode == "auto":
        return "off" if activation_bytes(model, rows) <= AUTO_BUDGET_BYTES else "keep-matmul"
    return mode


def activation_bytes(model, rows: int) -> int:
    """Estimated bytes autograd keeps for one row of `rows` tokens with no checkpointing:
    what one layer saves for a 64-token row (measured once per model, unique storages),
    scaled to `rows` tokens and every layer, plus the [rows, rows] causal mask per layer."""
    per_token = getattr(model, "_train_act_bytes_per_token", None)
    if per_token is None:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
            return t

        x = torch.zeros(64, model.config.n_embd, requires_grad=True)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _block(model, 0, x)
        per_token = model._train_act_bytes_per_token = sum(seen.values()) / 64
    return int((per_token * rows + rows * rows) * model.config.n_layer)


def _block(model, i: int, x: torch.Tensor) -> torch.Tensor:
    return model.block(i, x, _LayerKV(x.shape[0]), 0)


def _run_memo(memo: MatmulMemo, fn, *args):
    with recording(memo):
        return fn(*args)


def _segment(mode: str, fn, *args):
    """fn(*args) as one gradient-checkpointed segment in `mode` (not "off")."""
    if mode == "keep-matmul":
        return _checkpoint(_run_memo, MatmulMemo(), fn, *args, use_reentrant=False,
                           preserve_rng_state=False)
    return _checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def hidden(model, ids: torch.Tensor, use_checkpoint: bool | str = True) -> torch.Tensor:
    """Final residual stream [T, n_embd] of one sequence (positions 0..T-1)."""
    mode = checkpoint_mode(use_checkpoint, model, ids.numel())
    x = model.embed(ids).float()
    grad = torch.is_grad_enabled()
    for i in range(model.config.n_layer):
        if mode != "off" and grad:
            x = _segment(mode, _block, model, i, x)
        else:
            x = _block(model, i, x)
    return x


def _head_loss(model, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model.head(h).float()
    return F.cross_entropy(logits, targets, reduction="sum")


def loss_sum(model, ids: torch.Tensor, labels: torch.Tensor, use_checkpoint: bool | str = True
             ) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over positions whose label is >= 0, and their count.
    `labels[t]` is the target for position t (already shifted; -100 = not supervised)."""
    mode = checkpoint_mode(use_checkpoint, model, ids.numel())
    x = hidden(model, ids, mode)
    rows = (labels >= 0).nonzero().reshape(-1)
    total = x.new_zeros(())
    grad = torch.is_grad_enabled()
    for s in range(0, rows.numel(), HEAD_CHUNK):
        r = rows[s:s + HEAD_CHUNK]
        h, t = x[r], labels[r]
        if mode != "off" and grad:
            total = total + _segment(mode, _head_loss, model, h, t)
        else:
            total = total + _head_loss(model, h, t)
    return total, int(rows.numel())
