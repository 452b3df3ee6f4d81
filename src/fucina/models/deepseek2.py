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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fucina.errors import GGUFError, KVCacheError
from fucina.gguf import GGUFFile, meta_float_opt
from fucina.models import llama
from fucina.models.base import (LayerSpec, Ragged, TensorSpec, check_shape, load_layer_tensors, load_linear,
                                load_vector, meta_field)
from fucina.models.cache import KVCache, LatentKV, Q8Cache
from fucina.models.mla import MLAGeometry, MLAWeights, YarnParams, mla_attention, yarn_rope, yarn_scales
from fucina.models.moe import Experts, Routing, mix
from fucina.weights import ExpertStack

GATING = {1: "softmax", 2: "sigmoid"}   # llama_expert_gating_func_type values this family uses


@dataclass
class Config(llama.Config):
    q_lora_rank: int = meta_field("attention.q_lora_rank", 0, zero_ok=True)
    kv_lora_rank: int = meta_field("attention.kv_lora_rank")
    head_k_mla: int = meta_field("attention.key_length_mla", 0, zero_ok=True)
    head_v_mla: int = meta_field("attention.value_length_mla", 0, zero_ok=True)
    n_dense_lead: int = meta_field("leading_dense_block_count", 0, zero_ok=True)
    n_ff_exp: int = meta_field("expert_feed_forward_length", 0, zero_ok=True)
    n_expert: int = meta_field("expert_count", 0, zero_ok=True)
    n_expert_used: int = meta_field("expert_used_count", 0, zero_ok=True)
    n_expert_shared: int = meta_field("expert_shared_count", 0, zero_ok=True)
    n_expert_groups: int = meta_field("expert_group_count", 0, zero_ok=True)
    n_group_used: int = meta_field("expert_group_used_count", 0, zero_ok=True)
    expert_weights_scale: float = meta_field("expert_weights_scale", 0.0, kind=float)
    gating_func: int = meta_field("expert_gating_func", 0, zero_ok=True)
    expert_weights_norm: bool = False
    nope: int = 0            # per-head key dims without RoPE
    v_head: int = 0          # per-head value dims
    yarn: YarnParams | None = None

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        m, a = f.metadata, self.arch
        mla = bool(self.head_k_mla and self.head_v_mla)    # llama_hparams::is_mla
        k_full = self.head_k_mla if mla else self.head_dim
        self.v_head = self.head_v_mla if mla else self.v_dim
        self.nope = k_full - self.n_rot
        if self.nope < 1 or self.n_rot % 2:
            raise GGUFError(f"{f.path}: deepseek2 key length {k_full} leaves no room for {self.n_rot} rope dims")
        self.expert_weights_norm = bool(m.get(f"{a}.expert_weights_norm", False))
        if self.gating_func == 0:   # older V2/V2.5 files: softmax (GLM-4.7-Lite's shape: sigmoid)
            self.gating_func = 2 if self.n_layer in (47, 48) and self.n_vocab == 154880 else 1
        if self.gating_func not in GATING:
            raise GGUFError(f"{f.path}: expert_gating_func {self.gating_func} is not softmax (1) or sigmoid (2)")
        if self.n_dense_lead < self.n_layer:
            self._check_moe(f.path)
        self.yarn = _yarn(m, a, self.n_ctx_train)

    def _check_moe(self, path: str) -> None:
        if not (0 < self.n_expert_used <= self.n_expert) or self.n_ff_exp <= 0:
            raise GGUFError(f"{path}: MoE layers need 0 < expert_used_count ({self.n_expert_used}) <= "
                            f"expert_count ({self.n_expert}) and expert_feed_forward_length")
        g = self.n_expert_groups
        if g > 1 and (self.n_expert % g or not 0 < self.n_group_used < g
                      or self.n_group_used * (self.n_expert // g) < self.n_expert_used
                      or self.n_expert // g < 2):
            raise GGUFError(f"{path}: expert groups {g} / used {self.n_group_used} do not fit "
                            f"{self.n_expert} experts, {self.n_expert_used} used")

    def layer_spec(self, i: int) -> LayerSpec:
        # the cache rows per position: one latent [kv_lora_rank] and one rope key [n_rot]
        return LayerSpec(mixer="mla", ffn="dense" if i < self.n_dense_lead else "moe", n_head=self.n_head,
                         n_head_kv=1, head_dim=self.kv_lora_rank, v_dim=self.n_rot)

    def geometry(self) -> MLAGeometry:
        return MLAGeometry(self.n_head, self.q_lora_rank, self.kv_lora_rank, self.nope, self.n_rot, self.v_head)


def _yarn(m: dict, a: str, n_ctx_train: int) -> YarnParams:
    """The context parameters llama.cpp derives from rope.scaling.* (its defaults when absent)."""
    kind = m.get(f"{a}.rope.scaling.type", "linear")
    factor = meta_float_opt(m, a, "rope.scaling.factor") or meta_float_opt(m, a, "rope.scale_linear") or 0.0
    log_mul = meta_float_opt(m, a, "rope.scaling.yarn_log_multiplier")
    orig = m.get(f"{a}.rope.scaling.original_context_length") or n_ctx_train
    return YarnParams(freq_scale=1.0 if kind == "none" or not factor else 1.0 / factor,
                      ext_factor=1.0 if kind == "yarn" else 0.0,
                      log_mul=(log_mul or 0.0) / 0.1,   # deepseek2's converter stores 0.1 * mscale_all_dim
                      attn_factor=meta_float_opt(m, a, "rope.scaling.attn_factor") or 1.0,
                      n_ctx_orig=int(orig))


def T(name: str, *shape: str, required: bool = True) -> TensorSpec:
    return llama.T(name, *shape, required=required)


# the attention tensors (one of the q paths and one of the kv_b generations must be present)
ATTN: tuple[TensorSpec, ...] = (
    llama.norm("attn_norm"),
    T("attn_q_a", "q_lora", "n_embd", required=False), llama.norm("attn_q_a_norm", "q_lora", required=False),
    T("attn_q_b", "q_out", "q_lora", required=False), T("attn_q", "q_out", "n_embd", required=False),
    T("attn_kv_a_mqa", "kv_a_out", "n_embd"), llama.norm("attn_kv_a_norm", "kv_lora"),
    T("attn_k_b", "k_b_rows", "nope", required=False), T("attn_v_b", "v_b_rows", "kv_lora", required=False),
    T("attn_kv_b", "kv_b_out", "kv_lora", required=False),
    T("attn_output", "n_embd", "o_in"),
    llama.norm("ffn_norm"),
)
DENSE = (T("ffn_gate", "n_ff", "n_embd"), T("ffn_up", "n_ff", "n_embd"), T("ffn_down", "n_embd", "n_ff"))
MOE = (
    T("ffn_gate_inp", "n_expert", "n_embd"),
    TensorSpec("exp_probs_b", ("n_expert",), False, "bias", "bias"),
    T("ffn_gate_exps", "exp_ff", "n_embd", required=False), T("ffn_up_exps", "exp_ff", "n_embd", required=False),
    T("ffn_gate_up_exps", "exp_gu", "n_embd", required=False),
    T("ffn_down_exps", "exp_embd", "n_ff_exp"),
    T("ffn_gate_shexp", "n_ff_sh", "n_embd", required=False), T("ffn_up_shexp", "n_ff_sh", "n_embd", required=False),
    T("ffn_down_shexp", "n_embd", "n_ff_sh", required=False),
)
TENSORS = ATTN + DENSE     # a dense layer's schema (MoE layers use ATTN + MOE)


def tensor_dims(c: Config) -> dict[str, int]:
    H = c.n_head
    return dict(n_embd=c.n_embd, q_lora=c.q_lora_rank or 1, q_out=H * (c.nope + c.n_rot),
                kv_a_out=c.kv_lora_rank + c.n_rot, kv_lora=c.kv_lora_rank, nope=c.nope,
                k_b_rows=H * c.kv_lora_rank, v_b_rows=H * c.v_head, kv_b_out=H * (c.nope + c.v_head),
                o_in=H * c.v_head, n_ff=c.n_ff, n_expert=c.n_expert, n_ff_exp=c.n_ff_exp,
                exp_ff=c.n_expert * c.n_ff_exp, exp_gu=2 * c.n_expert * c.n_ff_exp, exp_embd=c.n_expert * c.n_embd,
                n_ff_sh=c.n_ff_exp * c.n_expert_shared)


# -- the layers ---------------------------------------------------------------------

class Layer:
    def __init__(self, f: GGUFFile, i: int, c: Config):
        self.moe = i >= c.n_dense_lead
        t = load_layer_tensors(f, i, ATTN + (MOE if self.moe else DENSE), tensor_dims(c))
        self.attn_norm, self.ffn_norm = t["attn_norm"], t["ffn_norm"]
        self.post_attn_norm = self.post_ffn_norm = None    # the llama block's hooks
        self.attn = MLAWeights(t, c.geometry(), f"{f.path}: blk.{i}")
        if not self.moe:
            self.gate, self.up, self.down = t["ffn_gate"], t["ffn_up"], t["ffn_down"]
            return
        if t["ffn_gate_up_exps"] is None and (t["ffn_gate_exps"] is None or t["ffn_up_exps"] is None):
            raise GGUFError(f"{f.path}: blk.{i} needs ffn_gate_exps + ffn_up_exps or ffn_gate_up_exps")
        self.router, self.exp_bias = t["ffn_gate_inp"], t["exp_probs_b_bias"]
        stack = lambda w: ExpertStack(w, c.n_expert) if w is not None else None   # noqa: E731
        self.experts = Experts(stack(t["ffn_gate_exps"]), stack(t["ffn_up_exps"]), stack(t["ffn_down_exps"]),
                               stack(t["ffn_gate_up_exps"]))
        shared = [t["ffn_gate_shexp"], t["ffn_up_shexp"], t["ffn_down_shexp"]]
        if c.n_expert_shared and any(s is None for s in shared):
            raise GGUFError(f"{f.path}: blk.{i} has {c.n_expert_shared} shared experts but no ffn_*_shexp")
        self.shared = shared if c.n_expert_shared else None


class Model(llama.Model):
    supports_batch = True
    config_class = Config
    tensors = TENSORS

    def __init__(self, f: GGUFFile):
        c = self.config = Config.from_gguf(f)
        self.tok_embd = check_shape(load_linear(f, "token_embd.weight"), c.n_vocab, c.n_embd)
        self.output_norm = load_vector(f, "output_norm.weight", c.n_embd)
        out = load_linear(f, "output.weight", required=False)
        self.output = check_shape(out, c.n_vocab, c.n_embd) if out else self.tok_embd
        self.layers = [Layer(f, i, c) for i in range(c.n_layer)]
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
