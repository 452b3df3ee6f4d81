"""GLM-4.5 / GLM-4.5-Air and the other `glm4moe` GGUFs (llama.cpp b11434
src/models/glm4-moe.cpp): the llama block with optional Q/K/V biases and q/k norms,
partial NEOX RoPE (`rope.dimension_count` of the head), the ffn behind
`post_attention_norm`; the first `leading_dense_block_count` layers dense SwiGLU, the
rest models/moe.py's routing (sigmoid gate, the `exp_probs_b` selection bias, optional
normalisation and scale) over zero-copy expert stacks plus the shared experts. The trunk
is `block_count - nextn_predict_layers` layers; the NextN block after it (the model's own
multi-token-prediction head) is built by models/mtp.py. No native layer step yet (the plan
has no sigmoid routing nor shared experts): the torch blocks serve every call, and the
expert store streams the routed stacks (`--moe-ram`) as for qwen3moe.
"""
from __future__ import annotations

import torch

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
        self.bqkv = torch.cat(biases).contiguous() if all(b is not None for b in biases) else None
        self.moe = c.is_moe(i)
        self.gate = self.up = self.down = self.w_gate_up = None
        if not self.moe:
            self.gate, self.up, self.down = t["ffn_gate"], t["ffn_up"], t["ffn_down"]
            self.w_gate_up = llama.fuse(f, [self.gate, self.up])
            return
        self.router, self.exp_bias = t["ffn_gate_inp"], t["exp_probs_b_bias"]
        self.experts = moe.Experts(t["ffn_gate_exps"], t["ffn_up_exps"], t["ffn_down_exps"])
        shared = (t["ffn_gate_shexp"], t["ffn_up_shexp"], t["ffn_down_shexp"])
        self.shared = shared if c.n_expert_shared else None

    def qkv(self, x: torch.Tensor):
        if self.bqkv is not None and self.wqkv is None:
            return (self.wqkv_parts(x) + self.bqkv).split(self.split_qkv, dim=-1)
        return super().qkv(x)


class Model(llama.Model):
    schema = Schema
    layer_class = Layer

    def __init__(self, f, checked: Tensors | None = None):
        super().__init__(f, checked)
        self.routing = self.config.routing
        self.native_plan = None

    def rope_factors(self, t: Tensors):
        return None

    def ffn(self, i: int, L: Layer, x: torch.Tensor) -> torch.Tensor:
        if not L.moe:
            g, u = L.gate_up(x)
            return L.down(llama.ACTS[self.act](g) * u)
        ids, w = self.routing(L.router(x), L.exp_bias)
        out = moe.mix(x, ids, w, L.experts, llama.ACTS[self.act])
        if L.shared is not None:
            g, u, d = L.shared
            out = out + d(llama.ACTS[self.act](g(x)) * u(x))
        return out

    def build_plan(self):
        return None
