"""Kimi-Linear's schema (torch-free): which layers are KDA (recurrent) and which MLA, the KDA
and MLA geometry keys with their checks, and the tensors of each layer kind, as llama.cpp
b11434 loads them (src/models/kimi-linear.cpp).

A layer is KDA when `attention.head_count_kv` (an array) is 0 for it, MLA otherwise (the
converter writes 1: MLA as one latent KV head). Both kinds use `attention.head_count` heads:
KDA heads of `kda.head_dim` (keys and values alike), MLA heads of key_length_mla (nope +
rope) / value_length_mla with a `kv_lora_rank` latent and no RoPE at all. The first
`leading_dense_block_count` ffns are dense SwiGLU, the rest a routed MoE (sigmoid or
softmax gating, selection bias exp_probs_b, renormalised top-k, expert_weights_scale) plus
the shared experts."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile
from fucina.models.schema import llama
from fucina.models.schema.base import LayerSpec, Tensors, TensorSpec, meta_field
from fucina.models.schema.mla import MLAGeometry
from fucina.models.schema.qwen35 import BareSpec

GATING = {1: "softmax", 2: "sigmoid"}   # llama_expert_gating_func_type values llama.cpp accepts here


@dataclass
class Config(llama.Config):
    n_head_kv: int = 0       # an array (0 on KDA layers): read in finish, not by the scalar reader
    kv_lora_rank: int = meta_field("attention.kv_lora_rank")
    head_k_mla: int = meta_field("attention.key_length_mla")
    head_v_mla: int = meta_field("attention.value_length_mla")
    d_conv: int = meta_field("ssm.conv_kernel")
    kda_head_dim: int = meta_field("kda.head_dim")
    n_dense_lead: int = meta_field("leading_dense_block_count", 0, zero_ok=True)
    n_ff_exp: int = meta_field("expert_feed_forward_length", 0, zero_ok=True)
    n_expert: int = meta_field("expert_count", 0, zero_ok=True)
    n_expert_used: int = meta_field("expert_used_count", 0, zero_ok=True)
    n_expert_shared: int = meta_field("expert_shared_count", 0, zero_ok=True)
    expert_weights_scale: float = meta_field("expert_weights_scale", 0.0, kind=float)
    gating_func: int = meta_field("expert_gating_func")
    nope: int = 0            # MLA per-head key dims (no RoPE on any)
    recurrent: list[bool] = field(default_factory=list)

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        a, n = self.arch, self.n_layer
        kv = f.metadata.get(f"{a}.attention.head_count_kv")
        if kv is None:                      # llama.cpp's default: n_head_kv = n_head, every layer MLA
            kv = [self.n_head] * n
        elif isinstance(kv, (list, tuple, np.ndarray)):
            if len(kv) != n:
                raise GGUFError(f"{f.path}: {a}.attention.head_count_kv has {len(kv)} entries for {n} layers")
        elif isinstance(kv, (int, np.integer)) and not isinstance(kv, bool):
            kv = [int(kv)] * n
        else:
            raise GGUFError(f"{f.path}: {a}.attention.head_count_kv = {kv!r} is not an integer or an array")
        self.recurrent = [int(x) == 0 for x in kv]
        self.n_head_kv = 1
        self.nope = self.head_k_mla - self.n_rot
        if any(not r for r in self.recurrent) and (self.nope < 1 or self.n_rot < 1):
            raise GGUFError(f"{f.path}: kimi-linear key_length_mla {self.head_k_mla} must exceed "
                            f"rope.dimension_count {self.n_rot} (the MLA key's shared part)")
        if self.d_conv < 2:
            raise GGUFError(f"{f.path}: kimi-linear ssm.conv_kernel {self.d_conv} must be at least 2")
        if self.gating_func not in GATING:
            raise GGUFError(f"{f.path}: expert_gating_func {self.gating_func} is not softmax (1) or sigmoid (2)")
        if self.n_dense_lead < n and (not 0 < self.n_expert_used <= self.n_expert or self.n_ff_exp <= 0
                                      or self.n_expert_shared < 1):
            raise GGUFError(f"{f.path}: MoE layers need 0 < expert_used_count ({self.n_expert_used}) <= "
                            f"expert_count ({self.n_expert}), expert_feed_forward_length and "
                            f"expert_shared_count >= 1 (llama.cpp always runs the shared expert)")

    def layer_spec(self, i: int) -> LayerSpec:
        ffn = "dense" if i < self.n_dense_lead else "moe"
        if self.recurrent[i]:
            return LayerSpec(mixer="kda", ffn=ffn)
        # the cache rows per position: one latent [kv_lora_rank] and one key row [n_rot]
        return LayerSpec(mixer="mla", ffn=ffn, n_head=self.n_head, n_head_kv=1, head_dim=self.kv_lora_rank,
                         v_dim=self.n_rot)

    def geometry(self) -> MLAGeometry:
        return MLAGeometry(self.n_head, 0, self.kv_lora_rank, self.nope, self.n_rot, self.head_v_mla)

    def dims(self) -> dict[str, int]:
        H, d = self.n_head, self.kda_head_dim
        return dict(n_embd=self.n_embd, n_head=H, kda_dim=d, d_inner=H * d, qkv_out=3 * H * d, d_conv=self.d_conv,
                    q_out=H * self.head_k_mla, kv_a_out=self.kv_lora_rank + self.n_rot, kv_lora=self.kv_lora_rank,
                    nope=self.nope, k_b_rows=H * self.kv_lora_rank, v_b_rows=H * self.head_v_mla,
                    o_in=H * self.head_v_mla, n_ff=self.n_ff, n_expert=self.n_expert, n_ff_exp=self.n_ff_exp,
                    exp_ff=self.n_expert * self.n_ff_exp, exp_embd=self.n_expert * self.n_embd,
                    n_ff_sh=self.n_ff_exp * max(self.n_expert_shared, 1))


T, norm = llama.T, llama.norm
NORMS = (norm("attn_norm"), norm("ffn_norm"))
# KDA: q/k/v (or one attn_qkv), their short convs (role "conv": f32, never quantized), the
# per-channel decay gate f_b(f_a x) + dt bias times the per-head ssm_a (-exp(A_log), "decay"),
# beta, the output gate g_b(g_a x) and the per-head output norm
KDA = (T("attn_q", "d_inner", "n_embd", required=False), T("attn_k", "d_inner", "n_embd", required=False),
       T("attn_v", "d_inner", "n_embd", required=False), T("attn_qkv", "qkv_out", "n_embd", required=False),
       T("ssm_conv1d_q", "d_inner", "d_conv", role="conv"), T("ssm_conv1d_k", "d_inner", "d_conv", role="conv"),
       T("ssm_conv1d_v", "d_inner", "d_conv", role="conv"),
       T("ssm_f_a", "kda_dim", "n_embd"), T("ssm_f_b", "d_inner", "kda_dim"),
       T("ssm_beta", "n_head", "n_embd"), BareSpec("ssm_a", ("n_head",), role="decay"),
       T("ssm_dt", "d_inner", role="bias", suffix="bias"),
       T("ssm_g_a", "kda_dim", "n_embd"), T("ssm_g_b", "d_inner", "kda_dim"),
       norm("ssm_norm", "kda_dim"), T("attn_output", "n_embd", "d_inner"))
# MLA without q-LoRA (llama.cpp's graph reads attn_q) and with the split k_b / v_b (its MLA cache)
MLA = (T("attn_q", "q_out", "n_embd"), T("attn_kv_a_mqa", "kv_a_out", "n_embd"), norm("attn_kv_a_norm", "kv_lora"),
       T("attn_k_b", "k_b_rows", "nope"), T("attn_v_b", "v_b_rows", "kv_lora"), T("attn_output", "n_embd", "o_in"))
DENSE = (T("ffn_gate", "n_ff", "n_embd"), T("ffn_up", "n_ff", "n_embd"), T("ffn_down", "n_embd", "n_ff"))
MOE = (T("ffn_gate_inp", "n_expert", "n_embd"), TensorSpec("exp_probs_b", ("n_expert",), True, "bias", "bias"),
       T("ffn_gate_exps", "exp_ff", "n_embd"), T("ffn_up_exps", "exp_ff", "n_embd"),
       T("ffn_down_exps", "exp_embd", "n_ff_exp"),
       T("ffn_gate_shexp", "n_ff_sh", "n_embd"), T("ffn_up_shexp", "n_ff_sh", "n_embd"),
       T("ffn_down_shexp", "n_embd", "n_ff_sh"))


def layer_schema(c: Config, i: int) -> tuple[TensorSpec, ...]:
    return NORMS + (KDA if c.recurrent[i] else MLA) + (DENSE if i < c.n_dense_lead else MOE)


class Schema(llama.Schema):
    config_class = Config
    tensors = NORMS + KDA + DENSE     # a dense KDA layer's schema (layer_schema picks per layer)

    @classmethod
    def check_layer(cls, t: Tensors, i: int) -> None:
        c = t.config
        got = t.layer(i, layer_schema(c, i), c.dims())
        if c.recurrent[i] and got["attn_qkv"] is None and any(got[k] is None for k in ("attn_q", "attn_k", "attn_v")):
            raise GGUFError(f"{t.f.path}: blk.{i} (a KDA layer) needs attn_q + attn_k + attn_v or attn_qkv")

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        pass   # no RoPE anywhere: no rope_freqs
