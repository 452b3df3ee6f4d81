"""gpt-oss (OpenAI's open-weight MoE, llama.cpp's `gpt-oss`, src/models/openai-moe.cpp).

What differs from the llama skeleton, all in this file's hooks:
- attention: Q/K/V and output biases; a learned sink logit per head that joins each
  row's softmax (it takes probability mass and gives no value); YaRN RoPE (NEOX) on every
  layer; scale 1/sqrt(head_dim); even layers see the last `sliding_window` (128) positions;
- the block: attn_norm -> attention -> residual -> post_attention_norm -> MoE -> residual
  (gpt-oss's "post_attention_norm" is the ffn's pre-norm);
- the MoE: router logits plus a bias, the top k logits chosen and softmaxed among
  themselves (llama.cpp's SOFTMAX_WEIGHT gating), each chosen expert
  down(swiglu_oai(gate(x) + bg, up(x) + bu)) + bd with swiglu_oai(g, u) =
  min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1), weighted and summed.
The expert stacks stay zero-copy in the mmap (MXFP4 goes through the native canonical
matmul). The native layer step runs it all (`plan_layer`: csrc/fk_plan.h's FK_GPTOSS_FIELDS
for the sinks, the output bias, the router bias with SOFTMAX_WEIGHT gating and the expert
biases, the plan act swiglu_oai; the YaRN tables carry their frequencies and magnitude, so
RoPE is the plan's); the hooks below are its torch reference and the route of caches
without a native table.
"""
from __future__ import annotations

import torch

from fucina.gguf import GGUFFile
from fucina.models import llama, moe
from fucina.models.base import (Ragged, Rope, Tensors, attn_scale, causal_mask, layer_tensors, rowwise,
                                tensor_dims)
from fucina.models.cache import KVCache
from fucina.models.mla import yarn_rope, yarn_scales
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.gpt_oss import ATTENTION, MOE_TENSORS, TENSORS, Config, Schema  # noqa: F401

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def swiglu_oai(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """ggml_swiglu_oai: the gate clamped from above, the up clamped both ways and offset by 1."""
    g = g.clamp(max=SWIGLU_LIMIT)
    return g * torch.sigmoid(SWIGLU_ALPHA * g) * (u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT) + 1.0)


def sink_attention(q: torch.Tensor, cache: KVCache, layer: int, pos0: int, scale: float, window: int,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [m, heads, d] at pos0.. over the cache, one extra logit per head
    (sinks [heads]) in every row's softmax: p_j = exp(s_j) / (sum_j exp(s_j) + exp(sink))."""
    m, n_head, d = q.shape
    if rowwise(m, cache, q):
        # row by row, each as its own decode step reads: batch invariance (base._rows_attention)
        return torch.cat([sink_attention(q[r:r + 1], cache, layer, pos0 + r, scale, window, sinks)
                          for r in range(m)])
    n = pos0 + m
    start = max(0, pos0 - window + 1) if window > 0 else 0
    k, v = cache.span(layer, start, n)
    k = k.float().transpose(0, 1)
    v = v.float().transpose(0, 1)
    group = n_head // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    s = (q.transpose(0, 1).float() @ k.transpose(1, 2)) * scale            # [heads, m, n - start]
    s = s.masked_fill(~causal_mask(pos0, m, start, window), float("-inf"))
    s = torch.cat([s, sinks.view(n_head, 1, 1).expand(n_head, m, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    return (p @ v).transpose(0, 1).reshape(m, n_head * d)


class Layer(llama.Layer):
    """The llama layer's attention (biased), the sinks, the output bias, the router and the
    biased expert stacks."""

    def __init__(self, tensors: Tensors, i: int, c: Config, schema):
        f, t = tensors.f, layer_tensors(tensors, i, schema)
        self.attn_norm, self.ffn_norm = t["attn_norm"], t["post_attention_norm"]
        self.q_norm = self.k_norm = self.post_attn_norm = self.post_ffn_norm = None
        self.wo, self.down, self.bo, self.sinks = t["attn_output"], None, t["attn_output_bias"], t["attn_sinks"]
        dims = tensor_dims(c)
        self.split_qkv = [dims["q_out"], dims["kv_out"], dims["v_out"]]
        self.wq, self.wk, self.wv = t["attn_q"], t["attn_k"], t["attn_v"]
        self.wqkv = llama.fuse(f, [self.wq, self.wk, self.wv])
        self.bqkv = torch.cat([t["attn_q_bias"], t["attn_k_bias"], t["attn_v_bias"]]).contiguous()
        self.gate = self.up = self.w_gate_up = None
        self.router, self.router_bias = t["ffn_gate_inp"], t["ffn_gate_inp_bias"]
        self.experts = moe.Experts(t["ffn_gate_exps"], t["ffn_up_exps"], t["ffn_down_exps"])
        ne = c.n_expert
        self.bg = t["ffn_gate_exps_bias"].dequantize().reshape(ne, -1)
        self.bu = t["ffn_up_exps_bias"].dequantize().reshape(ne, -1)
        self.bd = t["ffn_down_exps_bias"].dequantize().reshape(ne, -1)


class Model(llama.Model):
    schema = Schema
    layer_class = Layer
    act = "swiglu_oai"   # the experts' (the native plan's act; `ffn` below calls swiglu_oai itself)

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        super().__init__(f, checked)
        c = self.config
        self.scale = attn_scale(c.head_dim)
        attn = yarn_scales(c.yarn, c.n_rot)[0]   # ggml's attn_factor (the kq scale part is deepseek2's)
        self.rope_global = self._yarn(c.rope_base, attn)
        self.rope_local = self._yarn(c.rope_base_swa or c.rope_base, attn)

    def _yarn(self, base: float, attn: float) -> Rope:
        r = yarn_rope(self.config.n_rot, base, self.config.yarn, attn)
        r.neox = True
        return r

    def rope_tables(self, capacity: int = 0) -> list[Rope]:
        return [self.rope_global, self.rope_local]

    def rope_factors(self, t: Tensors) -> torch.Tensor | None:
        return None

    def plan_layer(self, i: int, L: Layer) -> dict:
        """The llama layer's fields plus the sinks, the output bias, the biased router with
        SOFTMAX_WEIGHT gating and the biased expert stacks (csrc/fk_plan.h FK_GPTOSS_FIELDS);
        the plan's act is swiglu_oai."""
        c, ex = self.config, L.experts
        store = getattr(self, "expert_store", None)
        return dict(super().plan_layer(i, L), attn_sinks=L.sinks, wo_bias=L.bo, n_expert=c.n_expert,
                    n_expert_used=c.n_expert_used, n_ff_exp=ex.gate.out_features, gate_inp=L.router, gate_inp_b=L.router_bias, moe_weight_softmax=1,
                    gate_exps=ex.gate.whole, up_exps=ex.up.whole, down_exps=ex.down.whole,
                    gate_exps_b=L.bg.reshape(-1), up_exps_b=L.bu.reshape(-1), down_exps_b=L.bd.reshape(-1),
                    **(store.plan_fields(i) if store is not None else {}))

    def mixer(self, i: int, L: Layer, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        s, m = self.config.layers[i], x.shape[0]
        q, k, v = L.qkv(x)
        q = q.reshape(m, s.n_head, s.head_dim)
        k = k.reshape(m, s.n_head_kv, s.head_dim)
        v = v.reshape(m, s.n_head_kv, s.v_dim)
        rope = self.rope_tables(cache.capacity)[s.rope]
        if not isinstance(cache, Ragged):
            q, k = rope(q, pos0), rope(k, pos0)
            cache.append(i, k, v)
            out = sink_attention(q, cache, i, pos0, self.scale, s.window, L.sinks)
        else:
            q, k = rope.at(q, cache.positions), rope.at(k, cache.positions)
            rows = []
            for r, (c, p) in enumerate(zip(cache.caches, cache.pos0s)):
                c.append(i, k[r:r + 1], v[r:r + 1])
                rows.append(sink_attention(q[r:r + 1], c, i, p, self.scale, s.window, L.sinks))
            out = torch.cat(rows)
        return L.wo(out) + L.bo

    def ffn(self, i: int, L: Layer, x: torch.Tensor) -> torch.Tensor:
        logits = L.router(x) + L.router_bias
        ids = logits.topk(self.config.n_expert_used, dim=-1).indices   # the biased logits choose
        weights = torch.softmax(logits.float().gather(1, ids), dim=-1)
        return mix_biased(x, ids, weights, L)


def mix_biased(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, L: Layer) -> torch.Tensor:
    """moe.mix (rows grouped by expert, each row's experts summed in ascending expert order)
    with each expert's biases and swiglu_oai."""
    def run(e: int, ws: tuple, xs: torch.Tensor) -> torch.Tensor:
        gate, up, down = ws
        return down(swiglu_oai(gate(xs) + L.bg[e], up(xs) + L.bu[e])) + L.bd[e]
    return moe.mix(x, ids, weights, L.experts, None, run)
