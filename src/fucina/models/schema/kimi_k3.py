"""Kimi-K3's schema (torch-free), as llama.cpp b11434 loads it (src/models/kimi-k3.cpp):
kimi-linear's layer pattern and keys (KDA where `attention.head_count_kv` is 0, NoPE MLA
elsewhere, dense ffns first, then routed + shared experts) with what K3 changes:

- KDA: one full-rank output gate `ssm_g` [d_inner, n_embd] (no g_a/g_b), ssm_a a plain
  [n_head] vector, and `kda.gate_lower_bound` (optional): when present the decay gate is
  lower_bound * sigmoid(exp(A_log) * (f_b(f_a x) + dt_bias)), else kimi-linear's softplus form.
- MLA: an optional sigmoid output gate `attn_gate` [n_head * v, n_embd] before attn_output,
  the query one attn_q or the low-rank attn_q_a / attn_q_a_norm / attn_q_b.
- SiTU (`activation.situ_beta`, `activation.situ_linear_beta`) instead of SwiGLU.
- latent MoE: the router reads the full width; with `expert_latent_length` > 0 the routed
  experts run in that latent space (ffn_routed_down in, optional ffn_routed_norm, then
  ffn_routed_up out); shared experts stay at n_embd. `expert_weights_norm` (default off)
  renormalises the chosen weights.
- cross-layer residual attention every `attn_res.block_size` layers (0: none), with the
  score vectors attn_res_score / ffn_res_score per layer and output_res_score.
"""
from __future__ import annotations

from dataclasses import dataclass

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile
from fucina.models.schema import kimi_linear, llama
from fucina.models.schema.base import Tensors, TensorSpec, meta_field
from fucina.models.schema.qwen35 import BareSpec

GATING = kimi_linear.GATING


@dataclass
class Config(kimi_linear.Config):
    n_q_lora: int = meta_field("attention.q_lora_rank", 0, zero_ok=True)
    n_latent: int = meta_field("expert_latent_length", 0, zero_ok=True)
    res_block: int = meta_field("attn_res.block_size", zero_ok=True)
    situ_beta: float = meta_field("activation.situ_beta", kind=float)
    situ_linear_beta: float = meta_field("activation.situ_linear_beta", kind=float)
    gate_lower_bound: float = meta_field("kda.gate_lower_bound", float("-inf"), kind=float)
    expert_weights_norm: bool = False

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        self.expert_weights_norm = bool(f.metadata.get(f"{self.arch}.expert_weights_norm", False))
        if self.situ_beta == 0.0:
            raise GGUFError(f"{f.path}: {self.arch}.activation.situ_beta must not be 0 (SiTU divides by it)")
        if self.res_block < 0 or self.n_latent < 0:
            raise GGUFError(f"{f.path}: attn_res.block_size and expert_latent_length must not be negative")

    @property
    def latent(self) -> int:
        """The routed experts' width (n_embd without a latent space)."""
        return self.n_latent or self.n_embd

    def dims(self) -> dict[str, int]:
        d = super().dims()
        lat = self.latent
        d.update(latent=lat, q_lora=max(self.n_q_lora, 1), q_out=self.n_head * self.head_k_mla,
                 exp_lat=self.n_expert * lat)
        return d


T, norm = llama.T, llama.norm
NORMS = kimi_linear.NORMS
RES_SCORES = (norm("attn_res_score"), norm("ffn_res_score"))
KDA = (T("attn_q", "d_inner", "n_embd"), T("attn_k", "d_inner", "n_embd"), T("attn_v", "d_inner", "n_embd"),
       T("ssm_conv1d_q", "d_inner", "d_conv", role="conv"), T("ssm_conv1d_k", "d_inner", "d_conv", role="conv"),
       T("ssm_conv1d_v", "d_inner", "d_conv", role="conv"),
       T("ssm_f_a", "kda_dim", "n_embd"), T("ssm_f_b", "d_inner", "kda_dim"),
       T("ssm_beta", "n_head", "n_embd"), BareSpec("ssm_a", ("n_head",), role="decay"),
       T("ssm_dt", "d_inner", role="bias", suffix="bias"), T("ssm_g", "d_inner", "n_embd"),
       norm("ssm_norm", "kda_dim"), T("attn_output", "n_embd", "d_inner"))
MLA = (T("attn_q", "q_out", "n_embd", required=False), T("attn_q_a", "q_lora", "n_embd", required=False),
       norm("attn_q_a_norm", "q_lora", required=False), T("attn_q_b", "q_out", "q_lora", required=False),
       T("attn_kv_a_mqa", "kv_a_out", "n_embd"), norm("attn_kv_a_norm", "kv_lora"),
       T("attn_k_b", "k_b_rows", "nope"), T("attn_v_b", "v_b_rows", "kv_lora"),
       T("attn_gate", "o_in", "n_embd", required=False), T("attn_output", "n_embd", "o_in"))
DENSE = kimi_linear.DENSE
MOE = (T("ffn_gate_inp", "n_expert", "n_embd"), TensorSpec("exp_probs_b", ("n_expert",), True, "bias", "bias"),
       T("ffn_gate_exps", "exp_ff", "latent"), T("ffn_up_exps", "exp_ff", "latent"),
       T("ffn_down_exps", "exp_lat", "n_ff_exp"),
       T("ffn_gate_shexp", "n_ff_sh", "n_embd", required=False), T("ffn_up_shexp", "n_ff_sh", "n_embd", required=False),
       T("ffn_down_shexp", "n_embd", "n_ff_sh", required=False))
LATENT = (T("ffn_routed_down", "latent", "n_embd"), T("ffn_routed_up", "n_embd", "latent"),
          norm("ffn_routed_norm", "latent", required=False))


def layer_schema(c: Config, i: int) -> tuple[TensorSpec, ...]:
    ffn = DENSE if i < c.n_dense_lead else MOE + (LATENT if c.n_latent else ())
    return NORMS + (RES_SCORES if c.res_block else ()) + (KDA if c.recurrent[i] else MLA) + ffn


class Schema(llama.Schema):
    config_class = Config
    tensors = NORMS + KDA + DENSE     # a dense KDA layer's schema (layer_schema picks per layer)

    @classmethod
    def check_globals(cls, t: Tensors) -> None:
        c = t.config
        t.want("token_embd.weight", (c.n_vocab, c.n_embd))
        t.want("output_norm.weight", (c.n_embd,))
        t.want("output.weight", (c.n_vocab, c.n_embd))
        if c.res_block:
            t.want("output_res_score.weight", (c.n_embd,))

    @classmethod
    def check_layer(cls, t: Tensors, i: int) -> None:
        c = t.config
        got = t.layer(i, layer_schema(c, i), c.dims())
        where = f"{t.f.path}: blk.{i}"
        if not c.recurrent[i]:
            low = [got[k] is not None for k in ("attn_q_a", "attn_q_a_norm", "attn_q_b")]
            if got["attn_q"] is None and not all(low):
                raise GGUFError(f"{where} (an MLA layer) needs attn_q or attn_q_a + attn_q_a_norm + attn_q_b")
            if got["attn_q"] is None and not c.n_q_lora:
                raise GGUFError(f"{where}: attn_q_a needs {c.arch}.attention.q_lora_rank")
        if i >= c.n_dense_lead:
            sh = [got[k] is not None for k in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")]
            if any(sh) and not all(sh):
                raise GGUFError(f"{where}: the shared expert needs ffn_gate_shexp, ffn_up_shexp and ffn_down_shexp")

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        pass   # no RoPE anywhere: no rope_freqs
