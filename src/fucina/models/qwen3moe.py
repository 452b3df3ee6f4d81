"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm, NEOX
RoPE) with every ffn a routed mixture of SwiGLU experts: softmax over the router's
logits, the top `expert_used_count` experts, their weights renormalised to sum to 1
(llama.cpp b11434 always normalises for this family, whatever norm_topk_prob was). The
expert stacks stay zero-copy in the mmap (weights.ExpertStack); the math is models/moe.py,
the native step's is csrc/generic/moe_impl.inc; `--moe-ram` streams the stacks under a RAM
budget (models/expert_store.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile
from fucina.models import llama, moe
from fucina.models.base import LayerSpec, load_layer_tensors, meta_field, tensor_dims


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    n_expert: int = meta_field("expert_count")
    n_expert_used: int = meta_field("expert_used_count")
    n_ff_exp: int = meta_field("expert_feed_forward_length", derive=lambda v: v["n_ff"] // v["n_expert_used"])
    routing: moe.Routing | None = None

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        if not 0 < self.n_expert_used <= self.n_expert:
            raise GGUFError(f"{f.path}: {self.n_expert_used} experts used of {self.n_expert}")
        self.routing = moe.Routing(self.n_expert, self.n_expert_used, norm=True)

    def layer_spec(self, i: int) -> LayerSpec:
        s = super().layer_spec(i)
        s.ffn = "moe"
        return s

    def extra_dims(self) -> dict[str, int]:
        return dict(n_expert=self.n_expert, n_ff_exp=self.n_ff_exp)


MOE_TENSORS = (
    llama.T("ffn_gate_inp", "n_expert", "n_embd", role="router"),
    llama.T("ffn_gate_exps", "n_expert", "n_ff_exp", "n_embd"),
    llama.T("ffn_up_exps", "n_expert", "n_ff_exp", "n_embd"),
    llama.T("ffn_down_exps", "n_expert", "n_embd", "n_ff_exp"),
)
ATTENTION = tuple(t for t in llama.TENSORS if t.name == "ffn_norm" or not t.name.startswith("ffn_"))
TENSORS = llama.with_qk_norms(ATTENTION) + MOE_TENSORS


class Layer(llama.Layer):
    """The llama layer without a dense ffn, plus the router and the expert stacks."""

    def __init__(self, f: GGUFFile, i: int, c: Config, schema):
        names = {t.name for t in MOE_TENSORS}
        super().__init__(f, i, c, tuple(t for t in schema if t.name not in names))
        t = load_layer_tensors(f, i, [t for t in schema if t.name in names], tensor_dims(c))
        self.router = t["ffn_gate_inp"]
        self.experts = moe.Experts(t["ffn_gate_exps"], t["ffn_up_exps"], t["ffn_down_exps"])


class Model(llama.Model):
    config_class = Config
    tensors = TENSORS
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
        store = getattr(self, "expert_store", None)
        return store.plan_fields(i) if store is not None else {}
