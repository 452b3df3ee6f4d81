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
No native layer step: the torch blocks serve every call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fucina.errors import KVCacheError
from fucina.gguf import GGUFFile
from fucina.models import llama
from fucina.models.base import Ragged, Tensors, layer_tensors
from fucina.models.cache import KVCache, LatentKV, Q8Cache
from fucina.models.mla import MLAWeights, mla_attention, yarn_rope, yarn_scales
from fucina.models.moe import Experts, Routing, mix
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.deepseek2 import (ATTN, DENSE, GATING, MOE, TENSORS, Config, Schema, T,  # noqa: F401
                                            tensor_dims)
from fucina.weights import ExpertStack


# -- the layers ---------------------------------------------------------------------

class Layer:
    def __init__(self, tensors: Tensors, i: int, c: Config):
        self.moe = i >= c.n_dense_lead
        t = layer_tensors(tensors, i, ATTN + (MOE if self.moe else DENSE))
        self.attn_norm, self.ffn_norm = t["attn_norm"], t["ffn_norm"]
        self.post_attn_norm = self.post_ffn_norm = None    # the llama block's hooks
        self.attn = MLAWeights(t, c.geometry())
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
        self.native_plan = None

    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16", rewindable: bool = False) -> KVCache:
        """One LatentKV per layer: (kv_lora_rank + n_rot) values per position."""
        c = self.config
        if cache_type not in ("f16", "q8_0"):
            raise KVCacheError(f"unknown cache type {cache_type!r} (f16 or q8_0)")
        cap = capacity or min(c.n_ctx_train, 4096)
        if cap <= 0:
            raise KVCacheError(f"cache capacity must be positive, got {cap}")
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
