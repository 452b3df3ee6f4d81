"""Mixture-of-experts feed-forward math shared by the MoE families (qwen3moe and deepseek2,
whose variants plug in here).

Two pieces, separate so a family can change one without the other:
- `Routing` turns router logits [m, n_expert] into each row's chosen experts and their
  weights [m, k]: a gating function (softmax today) over the logits, top-k, then the
  optional normalisation of the chosen weights (`norm_topk_prob`) and a scale (the
  routed scaling factor); deepseek2's variants too: sigmoid gating, a selection-only
  expert bias, grouped top-k.
- `mix` runs the chosen experts with the rows grouped by expert, so each expert's
  weights are read once per call whatever the batch, and sums each row's experts in
  ascending expert order: a row's result does not depend on the rows it was computed
  with (the matmuls are batch-invariant per row, and so is this order). Before it reads
  them it tells the layer's `on_use` hook which experts it chose (the expert store,
  models/expert_store.py, streams them under a RAM budget).
The math follows llama.cpp's build_moe_ffn (b11434); the native layer step has the same
in csrc/generic/moe_impl.inc.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fucina.errors import FucinaError
from fucina.weights import ExpertStack, LinearWeight

# smallest weight sum the normalisation divides by (llama.cpp clamps to f16's min normal)
NORM_MIN = 6.103515625e-05

GATINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "sigmoid": torch.sigmoid,
}


@dataclass(frozen=True)
class Routing:
    n_expert: int
    k: int                       # experts used per row
    gating: str = "softmax"
    norm: bool = True            # renormalise the chosen weights to sum to 1
    scale: float = 1.0           # chosen weights times this (0 or 1: unscaled)
    groups: int = 0              # > 1: grouped routing, rows choose within `groups_used` groups
    groups_used: int = 0

    def __post_init__(self):
        if not 0 < self.k <= self.n_expert:
            raise FucinaError(f"moe: {self.k} experts used of {self.n_expert}")
        if self.gating not in GATINGS:
            raise FucinaError(f"moe: gating {self.gating!r} is not supported (have {', '.join(GATINGS)})")
        if self.groups > 1 and (self.n_expert % self.groups or not 0 < self.groups_used <= self.groups):
            raise FucinaError(f"moe: {self.n_expert} experts in {self.groups} groups, {self.groups_used} used")

    def __call__(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [m, n_expert] -> (expert ids [m, k] int64, weights [m, k] f32), as llama.cpp's
        build_moe_ffn: `bias` steers the selection only (the weights are the unbiased gate
        values); grouped routing keeps the groups_used groups whose two best scores sum highest."""
        probs = GATINGS[self.gating](logits.float())
        sel = probs + bias if bias is not None else probs
        if self.groups > 1:
            m = sel.shape[0]
            grouped = sel.view(m, self.groups, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1)                      # [m, groups]
            keep = best.topk(self.groups_used, dim=-1).indices
            dropped = torch.ones_like(best, dtype=torch.bool).scatter_(1, keep, False)
            sel = grouped.masked_fill(dropped[..., None], float("-inf")).view(m, -1)
        ids = sel.topk(self.k, dim=-1).indices
        weights = probs.gather(1, ids)
        if self.norm:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=NORM_MIN)
        if self.scale not in (0.0, 1.0):
            weights = weights * self.scale
        return ids, weights


@dataclass
class Experts:
    """One layer's expert stacks, SwiGLU-style: down(act(gate(x)) * up(x)), gate and up as two
    stacks or one fused stack (each expert's gate rows then its up rows, deepseek2's
    ffn_gate_up_exps; used when present). `on_use(experts)`, when set (models/expert_store.py),
    is told the experts a call chose before it reads them and answers their weights, as
    `expert` does."""
    gate: ExpertStack | None
    up: ExpertStack | None
    down: ExpertStack
    gate_up: ExpertStack | None = None
    on_use: Callable[[list[int]], dict[int, tuple[LinearWeight, ...]]] | None = None

    def __post_init__(self):
        if self.gate_up is None and (self.gate is None or self.up is None):
            raise FucinaError(f"{self.down.name}: the experts need gate and up stacks, or one fused gate_up")

    @property
    def n_expert(self) -> int:
        return self.down.n_expert

    @property
    def stacks(self) -> tuple[ExpertStack, ...]:
        return (self.gate_up,) if self.gate_up is not None else (self.gate, self.up)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stacks + (self.down,))

    def expert(self, e: int) -> tuple[LinearWeight, ...]:
        """Expert e's weights in the stacks' order, down last: views of the stacks' bytes."""
        return tuple(s.expert(e) for s in self.stacks + (self.down,))


def mix(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
        act: Callable[[torch.Tensor], torch.Tensor] | None,
        run: Callable[[int, tuple, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """sum over each row's chosen experts e of weight * down_e(act(gate_e(x)) * up_e(x)):
    x [m, n_embd], ids/weights [m, k] -> [m, n_embd]. `run(e, expert e's weights, rows)`,
    when given, is the expert's own function instead (gpt-oss: biases, swiglu_oai)."""
    m, k = ids.shape
    out = torch.zeros(m, experts.down.out_features, dtype=torch.float32)
    flat = ids.reshape(-1)
    if int(flat.min()) < 0 or int(flat.max()) >= experts.n_expert:
        raise FucinaError(f"moe: expert id out of range [0, {experts.n_expert})")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.n_expert).tolist()
    chosen = [e for e, n in enumerate(counts) if n]
    held = experts.on_use(chosen) if experts.on_use is not None else {e: experts.expert(e) for e in chosen}
    rows_of, w_of = order // k, weights.reshape(-1)[order]
    at = 0
    for e in chosen:
        n = counts[e]
        rows, w = rows_of[at:at + n], w_of[at:at + n]
        at += n
        xs, ws = x[rows], held[e]
        if run is not None:
            out.index_add_(0, rows, run(e, ws, xs) * w[:, None])
            continue
        g, u = ws[0](xs).chunk(2, dim=-1) if len(ws) == 2 else (ws[0](xs), ws[1](xs))
        out.index_add_(0, rows, ws[-1](act(g) * u) * w[:, None])
    return out


def store_fields(model, i: int) -> dict:
    """Layer i's plan fields calling the expert store (models/expert_store.py), when one is
    attached to `model`; none otherwise."""
    store = getattr(model, "expert_store", None)
    return store.plan_fields(i) if store is not None else {}
