"""Phi-3's schema (torch-free): fused attn_qkv and [gate | up] ffn_up, LongRoPE keys and
factor tensors (rope_freqs, else rope_factors_short; rope_factors_long optional)."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.models.schema import llama
from fucina.models.schema.base import Tensors, meta_field


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    n_ctx_orig: int = meta_field("rope.scaling.original_context_length", derive=lambda v: v["n_ctx_train"])
    rope_attn_factor: float = meta_field("rope.scaling.attn_factor", 1.0, kind=float)


TENSORS = (
    llama.norm("attn_norm"),
    llama.T("attn_qkv", "qkv_out", "n_embd"), llama.T("attn_output", "n_embd", "q_out"),
    llama.norm("ffn_norm"),
    llama.T("ffn_up", "gu_out", "n_embd"), llama.T("ffn_down", "n_embd", "n_ff"),
)


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        n = (t.config.n_rot // 2,)
        if t.want("rope_freqs.weight", n, required=False) is None:
            t.want("rope_factors_short.weight", n, required=False)
        t.want("rope_factors_long.weight", n, required=False)
