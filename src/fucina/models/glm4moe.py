"""GLM-4.5 / GLM-4.5-Air and the other `glm4moe` GGUFs (llama.cpp b11434
src/models/glm4-moe.cpp): the llama block with optional Q/K/V biases and q/k norms,
partial NEOX RoPE (`rope.dimension_count` of the head), the ffn behind
`post_attention_norm`; the first `leading_dense_block_count` layers dense SwiGLU, the
rest models/moe.py's routing (sigmoid gate, the `exp_probs_b` selection bias, optional
normalisation and scale) over zero-copy expert stacks plus the shared experts. The trunk
is `block_count - nextn_predict_layers` layers; the NextN block after it (the model's own
multi-token-prediction head) is built by models/mtp.py. The native layer step runs it all
(`plan_layer`: the biases, q/k norms and partial NEOX RoPE are the llama plan's; the MoE ffn
routes by sigmoid with the selection bias, csrc/fk_plan.h FK_MOE_SIGMOID_FIELDS, and adds
the plain shared expert, csrc/generic/moe_shared_impl.inc), the NextN block's one-layer
plan too; the torch blocks stay the reference (FUCINA_NATIVE_STEP=0). The expert store
streams the routed stacks (`--moe-ram`) as for qwen3moe.
"""
from __future__ import annotations

import functools

import torch

from fucina import kernels
from fucina.models import llama, moe
from fucina.models.base import Tensors, layer_tensors
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.glm4moe import ATTN, DENSE, MOE, TENSORS, Config, Schema, layer_schema  # noqa: F401


class Layer(llama.Layer):
    """Attention as llama's (biases and q/k norms optional), the ffn dense or routed."""

    def __init__(self, tensors: Tensors, i: int, c: Config, schema=None):
        t = layer_tensors(tensors, i, layer_schema(c, i))
        f = tensors.f
        self.attn_norm, self.ffn_norm = t["attn_norm"], t["post_attention_norm"]
        self.q_norm, self.k_norm = t["attn_q_norm"], t["attn_k_norm"]
        self.post_attn_norm = self.post_ffn_norm = None
        self.wo = t["attn_output"]
        q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        self.split_qkv = [q, kv, c.n_head_kv * c.v_dim]
        self.wq, self.wk, self.wv = t["attn_q"], t["attn_k"], t["attn_v"]
        self.wqkv = llama.fuse(f, [self.wq, self.wk, self.wv])
        biases = [t["attn_q_bias"], t["attn_k_bias"], t["attn_v_bias"]]
        if any(b is not None for b in biases):   # each optional (llama.cpp): an absent one adds zeros
            sizes = [q, kv, c.n_head_kv * c.v_dim]
            self.bqkv = torch.cat([b if b is not None else torch.zeros(n) for b, n in zip(biases, sizes)]).contiguous()
        else:
            self.bqkv = None
        self.moe = c.is_moe(i)
        self.gate = self.up = self.down = self.w_gate_up = self.w_shared = None
        self.gate_shexp = self.up_shexp = self.down_shexp = None   # the shared experts, when there are
        if not self.moe:
            self.gate, self.up, self.down = t["ffn_gate"], t["ffn_up"], t["ffn_down"]
            self.w_gate_up = llama.fuse(f, [self.gate, self.up])
            return
        self.router, self.exp_bias = t["ffn_gate_inp"], t["exp_probs_b_bias"]
        self.experts = moe.Experts(t["ffn_gate_exps"], t["ffn_up_exps"], t["ffn_down_exps"])
        if c.n_expert_shared:   # the parts stay attributes: LoRA adapts the fused weight through them
            self.gate_shexp, self.up_shexp, self.down_shexp = t["ffn_gate_shexp"], t["ffn_up_shexp"], t["ffn_down_shexp"]
            self.w_shared = llama.fuse(f, [self.gate_shexp, self.up_shexp])

    def qkv(self, x: torch.Tensor):
        if self.bqkv is not None and self.wqkv is None:
            return (self.wqkv_parts(x) + self.bqkv).split(self.split_qkv, dim=-1)
        return super().qkv(x)


class Model(llama.Model):
    schema = Schema
    layer_class = Layer

    @functools.cached_property
    def routing(self) -> moe.Routing:
        """The router's math, for the torch blocks and the plan alike."""
        return self.config.routing

    def rope_factors(self, t: Tensors):
        return None

    def ffn(self, i: int, L: Layer, x: torch.Tensor) -> torch.Tensor:
        if not L.moe:
            g, u = L.gate_up(x)
            return L.down(llama.ACTS[self.act](g) * u)
        ids, w = self.routing(L.router(x), L.exp_bias)
        out = moe.mix(x, ids, w, L.experts, llama.ACTS[self.act])
        if L.down_shexp is not None:
            g, u = L.w_shared(x).chunk(2, dim=-1) if L.w_shared is not None else (L.gate_shexp(x), L.up_shexp(x))
            out = out + L.down_shexp(llama.ACTS[self.act](g) * u)
        return out

    # -- the native step: the llama plan, the MoE layers' sigmoid routing and shared expert ----
    def build_plan(self) -> "kernels.DecoderPlan | None":
        c = self.config
        if c.n_rot % 2 or any(s.head_dim % 16 or c.n_rot > s.head_dim or s.v_dim != s.head_dim for s in c.layers):
            return None
        return kernels.DecoderPlan.build(
            n_embd=c.n_embd, n_ff=max(c.n_ff, c.n_ff_exp * c.n_expert_shared), n_rot=c.n_rot, neox=c.rope_neox,
            act=self.act, eps=c.rms_eps, scale=self.plan_scale(),
            layers=[self.plan_layer(i, L) for i, L in enumerate(self.layers)])

    def plan_layer(self, i: int, L: Layer) -> dict:
        c, d = self.config, super().plan_layer(i, L)
        if not L.moe:
            return dict(d, ffn="dense", layer_ff=c.n_ff)
        r, ex = self.routing, L.experts
        shared = {}
        if L.down_shexp is not None:
            shared = dict(gate_up=L.w_shared) if L.w_shared is not None else dict(gate=L.gate_shexp, up=L.up_shexp)
            shared.update(down=L.down_shexp, layer_ff=L.down_shexp.in_features)
        # the store's hook only where it streams this layer's stacks (not the NextN block's)
        store = moe.store_fields(self, i) if ex.on_use is not None else {}
        return dict(d, ffn="moe", n_expert=r.n_expert, n_expert_used=r.k, n_ff_exp=ex.gate.out_features,
                    moe_norm=int(r.norm), moe_scale=r.scale, moe_sigmoid=int(r.gating == "sigmoid"),
                    exp_probs_b=L.exp_bias, gate_inp=L.router, gate_exps=ex.gate.whole, up_exps=ex.up.whole,
                    down_exps=ex.down.whole, **shared, **store)
