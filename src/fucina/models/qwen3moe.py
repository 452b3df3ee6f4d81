"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm, NEOX
RoPE) with every ffn a routed mixture of SwiGLU experts: softmax over the router's
logits, the top `expert_used_count` experts, their weights renormalised to sum to 1
(llama.cpp b11434 always normalises for this family, whatever norm_topk_prob was). The
expert stacks stay zero-copy in the mmap (weights.ExpertStack); the math is models/moe.py,
the native step's is csrc/generic/moe_impl.inc; `--moe-ram` streams the stacks under a RAM
budget (models/expert_store.py)."""
from __future__ import annotations

import torch

from fucina.models import llama, moe
from fucina.models.base import Tensors, layer_tensors
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.qwen3moe import ATTENTION, MOE_TENSORS, TENSORS, Config, Schema  # noqa: F401


class Layer(llama.Layer):
    """The llama layer without a dense ffn, plus the router and the expert stacks."""

    def __init__(self, tensors: Tensors, i: int, c: Config, schema):
        names = {t.name for t in MOE_TENSORS}
        super().__init__(tensors, i, c, tuple(t for t in schema if t.name not in names))
        t = layer_tensors(tensors, i, [t for t in schema if t.name in names])
        self.router = t["ffn_gate_inp"]
        self.experts = moe.Experts(t["ffn_gate_exps"], t["ffn_up_exps"], t["ffn_down_exps"])


class Model(llama.Model):
    schema = Schema
    layer_class = Layer

    def ffn(self, i: int, L: Layer, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.config.routing(L.router(x))
        return moe.mix(x, ids, weights, L.experts, llama.ACTS[self.act])

    def plan_layer(self, i: int, L: Layer) -> dict:
        r, ex = self.config.routing, L.experts
        return dict(super().plan_layer(i, L), n_expert=r.n_expert, n_expert_used=r.k, n_ff_exp=ex.gate.out_features,
                    moe_norm=int(r.norm), moe_scale=r.scale, gate_inp=L.router, gate_exps=ex.gate.whole,
                    up_exps=ex.up.whole, down_exps=ex.down.whole, **self.store_hook(i))

    def store_hook(self, i: int) -> dict:
        """The plan's call into the expert store (models/expert_store.py), when one is attached."""
        return moe.store_fields(self, i)
