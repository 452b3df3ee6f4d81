"""The training forward: the family's own torch blocks, one checkpointed segment per layer,
and cross-entropy on the supervised positions only.

Blocks write K/V into a cache object; during training a `TrainCache` stands in for it and
hands the layers' (differentiable) K/V back to their attention (shared-KV layers: their
source's; recurrent layers: a zero state), so the families train with no change to their code.

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
from fucina.models.cache import AliasKV, RecurrentState
from fucina.models.cache.dsv4 import DSV4Memory
from fucina.train.lora import MatmulMemo, recording

CHECKPOINT_MODES = ("auto", "full", "keep-matmul", "off")
DEFAULT_CHECKPOINT = "auto"
#: "auto" keeps every activation ("off") while a row's estimated activations fit this;
#: otherwise "keep-matmul"
AUTO_BUDGET_BYTES = int(float(os.environ.get("FUCINA_TRAIN_ACT_BUDGET_MB", "1024")) * (1 << 20))
HEAD_CHUNK = 256   # supervised rows per LM-head chunk ([256, 49152] f32 logits = 50 MB)


class TrainCache:
    """Duck-typed KV cache for one training sequence at pos0 = 0, shared by its layers: it
    keeps what each block appends (the differentiable K/V, or MLA's latent) and hands it
    back to the attention, so every family routes its mixers through it unchanged. Its
    layout mirrors the model's own cache (`model.init_cache`, read once per model): a
    layer whose memory aliases another (gemma4's shared-KV layers) reads that layer's
    rows; a recurrent layer (qwen35's DeltaNet) starts from a zero state each sequence
    and keeps no snapshots (horizon 0: the whole row runs the chunked scan).
    `capacity` (the sequence length) is what a family reads to pick a context-dependent
    RoPE variant (phi3's LongRoPE factors)."""

    len = 0
    training = True   # models.base.attention: flash SDPA; qwen35: no native decode step

    def __init__(self, model, capacity: int):
        self.capacity = capacity
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        layout = _cache_layout(model)
        self.source = [kind[1] if kind[0] == "alias" else i for i, kind in enumerate(layout)]
        self.memories = [_ZeroState(*kind[1:]) if kind[0] == "recur"
                         else DSV4Memory(capacity, *kind[1:], row_dtype=torch.float32) if kind[0] == "dsv4"
                         else None for kind in layout]
        self.shared = {src for i, src in enumerate(self.source) if src != i}   # rows read later

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for done in [n for n in self.rows if n not in self.shared]:   # read by their own layer only
            del self.rows[done]
        self.rows[layer] = (k, v)

    def span(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.rows[self.source[layer]]
        return k[start:end], v[start:end]


class _ZeroState:
    """A recurrent layer's memory during training: a zero conv window and state in, nothing kept."""

    horizon = 0

    def __init__(self, conv: tuple[int, ...], state: tuple[int, ...]):
        self.conv, self.state = conv, state

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(self.conv), torch.zeros(self.state)

    def write(self, *args) -> None:
        pass


def _cache_layout(model) -> list[tuple]:
    """Per layer ("rows",), ("alias", source layer) or ("recur", conv shape, state shape),
    read from a small cache of the model's own (memoized on the model)."""
    layout = getattr(model, "_train_cache_layout", None)
    if layout is None:
        layout = []
        for i, mem in enumerate(model.init_cache(64).memories):
            if isinstance(mem, AliasKV):
                layout.append(("alias", mem.target_layer))
            elif isinstance(mem, RecurrentState):
                layout.append(("recur", tuple(mem.conv.shape), tuple(mem.state.shape)))
            elif isinstance(mem, DSV4Memory):   # deepseek4: its rows and compressor state, f32, per sequence
                layout.append(("dsv4", mem.ratio, mem.head_dim, mem.idx_dim))
            else:
                layout.append(("rows",))
        model._train_cache_layout = layout
    return layout


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

        ids = torch.zeros(64, dtype=torch.long)
        x = model.embed(ids).float().requires_grad_()
        model.bind_ids(0, ids)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.block(0, x, TrainCache(model, 64), 0)
        per_token = model._train_act_bytes_per_token = sum(seen.values()) / 64
    return int((per_token * rows + rows * rows) * model.config.n_layer)


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
    cache = TrainCache(model, ids.numel())
    model.bind_ids(0, ids)
    hooks = getattr(model, "residual_hooks", None)
    for i in range(model.config.n_layer):
        if hooks and i in hooks:
            x = model.run_hooks(i, x, ids, 0, cache)
        if mode != "off" and grad:
            x = _segment(mode, model.block, i, x, cache, 0)
        else:
            x = model.block(i, x, cache, 0)
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
