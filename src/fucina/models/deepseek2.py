"""DeepSeek-V2 / V2-Lite and the later GGUFs on the `deepseek2` architecture (llama.cpp
b11434 src/models/deepseek2.cpp): MLA attention (models/mla.py) with an absorbed,
latent-only cache, then per layer a dense SwiGLU ffn (the first
`leading_dense_block_count` layers) or a mixture of experts with shared experts.

Both GGUF generations load: the newer one stores attn_k_b / attn_v_b (and
attention.key_length_mla / value_length_mla); the older one only attn_kv_b, split
here at load (llama.cpp runs those without MLA, as full multi-head attention; the
math is the same, the cache here is the latent either way).

The MoE is models/moe.py's, shared with qwen3moe: `Routing` (softmax or sigmoid gate, the
`exp_probs_b` selection bias, grouped selection n_group/topk_group, top-k, normalised
weights, the routed scaling factor; llama.cpp's build_moe_ffn) and `mix` over the
zero-copy expert stacks (fused gate_up_exps included), so the expert store
(models/expert_store.py) serves this family too. RoPE is GGML's NORM mode with YaRN (mla.yarn_rope).
The native layer step runs it (`plan_layer`): the MLA mixer over the latent cache
(csrc/generic/mla_impl.inc, FK_MLA_FIELDS) and the plan's MoE ffn (softmax or sigmoid routing
with the selection bias, the fused gate_up stack as two strided views, the plain shared
experts); grouped routing (n_group > 1) keeps the torch blocks, which stay the reference
(FUCINA_NATIVE_STEP=0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fucina import kernels
from fucina.gguf import GGUFFile
from fucina.models import llama, moe
from fucina.models.base import Ragged, Tensors, layer_tensors
from fucina.models.cache import KVCache, LatentKV, Q8Cache, cache_capacity
from fucina.models.mla import MLAWeights, mla_attention, stacked_heads, yarn_rope, yarn_scales
from fucina.models.moe import Experts, Routing, mix
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.deepseek2 import (ATTN, DENSE, GATING, MOE, TENSORS, Config, Schema, T,  # noqa: F401
                                            tensor_dims)
from fucina.weights import ExpertStack
from fucina.weights.row_groups import row_view


# -- the layers ---------------------------------------------------------------------

class Layer:
    def __init__(self, tensors: Tensors, i: int, c: Config):
        self.moe = i >= c.n_dense_lead
        t = layer_tensors(tensors, i, ATTN + (MOE if self.moe else DENSE))
        self.attn_norm, self.ffn_norm = t["attn_norm"], t["ffn_norm"]
        self.post_attn_norm = self.post_ffn_norm = None    # the llama block's hooks
        self.attn = MLAWeights(t, c.geometry())
        # the native step reads the heads' k_b / v_b in the file's type (the older GGUFs'
        # attn_kv_b split at load: the F32 split the torch mixer holds)
        self.k_b, self.v_b = t.get("attn_k_b"), t.get("attn_v_b")
        if not self.moe:
            self.gate, self.up, self.down = t["ffn_gate"], t["ffn_up"], t["ffn_down"]
            return
        self.router, self.exp_bias = t["ffn_gate_inp"], t["exp_probs_b_bias"]
        stack = lambda w: ExpertStack(w, c.n_expert) if w is not None else None   # noqa: E731
        self.experts = Experts(stack(t["ffn_gate_exps"]), stack(t["ffn_up_exps"]), stack(t["ffn_down_exps"]),
                               stack(t["ffn_gate_up_exps"]))
        shared = [t["ffn_gate_shexp"], t["ffn_up_shexp"], t["ffn_down_shexp"]]
        self.shared = shared if c.n_expert_shared else None   # the schema checked all three are there


class Model(llama.Model):
    supports_batch = True
    schema = Schema

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        t = self.check_and_embed(f, checked)
        c = self.config
        self.layers = [Layer(t, i, c) for i in range(c.n_layer)]
        self.routing = Routing(c.n_expert, c.n_expert_used, GATING[c.gating_func], c.expert_weights_norm,
                               c.expert_weights_scale, c.n_expert_groups, c.n_group_used)
        rope_attn, self.scale = yarn_scales(c.yarn, c.nope + c.n_rot)
        self.rope = yarn_rope(c.n_rot, c.rope_base, c.yarn, rope_attn)
        self.native_plan = self.build_plan()

    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16", rewindable: bool = False) -> KVCache:
        """One LatentKV per layer: (kv_lora_rank + n_rot) values per position."""
        c = self.config
        cap = cache_capacity(capacity, c.n_ctx_train, cache_type)
        mems = [LatentKV(cap, c.kv_lora_rank, c.n_rot, cache_type, dtype) for _ in range(c.n_layer)]
        return (Q8Cache if cache_type == "q8_0" else KVCache).of(mems, cap)

    def kv_geometry(self) -> tuple[list[int], list[int]]:
        # callers estimate 2 * heads * dim values per position: the latent row and the rope row
        n = self.config.n_layer
        return [1] * n, [(self.config.kv_lora_rank + self.config.n_rot) // 2] * n

    def mixer(self, i: int, L: Layer, x: torch.Tensor, cache: KVCache | Ragged, pos0: int) -> torch.Tensor:
        return mla_attention(L.attn, x, cache, i, pos0, self.rope, self.scale, self.config.rms_eps)

    def ffn(self, i: int, L: Layer, x: torch.Tensor) -> torch.Tensor:
        if not L.moe:
            return L.down(F.silu(L.gate(x)) * L.up(x))
        ids, w = self.routing(L.router(x), L.exp_bias)
        out = mix(x, ids, w, L.experts, F.silu)
        if L.shared is not None:
            g, u, d = L.shared
            out = out + d(F.silu(g(x)) * u(x))
        return out

    # -- the native step: the MLA mixer, the dense or MoE ffn ---------------------------
    def build_plan(self) -> "kernels.DecoderPlan | None":
        c = self.config
        if c.n_rot % 2 or self.routing.groups > 1:
            return None
        if getattr(self, "expert_store", None) is not None and any(
                L.moe and L.experts.gate_up is not None for L in self.layers):
            return None   # the store's table holds a fused stack's experts whole; the plan reads halves
        return kernels.DecoderPlan.build(
            n_embd=c.n_embd, n_ff=max(c.n_ff, c.n_ff_exp * c.n_expert_shared), n_rot=c.n_rot, neox=False,
            act="silu", eps=c.rms_eps, scale=self.scale, layers=[self.plan_layer(i, L) for i, L in enumerate(self.layers)])

    def plan_layer(self, i: int, L: Layer) -> dict:
        c, a = self.config, L.attn
        g = a.g
        d = dict(mixer="mla", n_head=g.n_head, n_kv=1, head_dim=0, mla_rank=g.kv_lora, mla_nope=g.nope,
                 mla_rope=g.rope, mla_v=g.v_dim, attn_norm=L.attn_norm, ffn_norm=L.ffn_norm, wq=a.q, q_a=a.q_a,
                 q_a_norm=a.q_a_norm, q_b=a.q_b, kv_a=a.kv_a, kv_a_norm=a.kv_a_norm, wo=a.wo,
                 k_b=stacked_heads(L.k_b, a.k_b, "attn_k_b"), v_b=stacked_heads(L.v_b, a.v_b, "attn_v_b"))
        if not L.moe:
            return dict(d, ffn="dense", gate=L.gate, up=L.up, down=L.down, layer_ff=c.n_ff)
        r, ex = self.routing, L.experts
        if ex.gate_up is not None:   # expert e's [gate | up] rows: two strided views of the stack
            whole, M = ex.gate_up.whole, c.n_ff_exp
            span = (c.n_expert - 1) * 2 * M + M
            stacks = dict(gate_exps=row_view(whole, 0, span, f"{whole.name}[0:]"),
                          up_exps=row_view(whole, M, span, f"{whole.name}[{M}:]"), exps_stride=2 * M)
        else:
            stacks = dict(gate_exps=ex.gate.whole, up_exps=ex.up.whole)
        shared = {}
        if L.shared is not None:
            gs, us, ds = L.shared
            shared = dict(gate=gs, up=us, down=ds, layer_ff=ds.in_features)
        return dict(d, ffn="moe", n_expert=r.n_expert, n_expert_used=r.k, n_ff_exp=c.n_ff_exp, moe_norm=int(r.norm),
                    moe_scale=r.scale, moe_sigmoid=int(r.gating == "sigmoid"), exp_probs_b=L.exp_bias,
                    gate_inp=L.router, down_exps=ex.down.whole, **stacks, **shared, **moe.store_fields(self, i))

