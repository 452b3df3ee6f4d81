"""Llama's schema (torch-free): the config and the dense layer every llama-shaped family
starts from (qwen2 adds biases, phi3 fuses, gemma3 post-norms, qwen3 q/k norms)."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.models.schema import base
from fucina.models.schema.base import BaseConfig, TensorSpec


@dataclass
class Config(BaseConfig):
    rope_neox: bool = False


def T(name: str, *shape: str, required: bool = True, role: str = "mat", suffix: str = "weight") -> TensorSpec:
    return TensorSpec(name, shape, required, role, suffix)


def norm(name: str, size: str = "n_embd", required: bool = True) -> TensorSpec:
    return T(name, size, required=required, role="norm")


# the llama layer; other families start from it (qwen2 adds biases, phi3 fuses, gemma3 post-norms)
TENSORS: tuple[TensorSpec, ...] = (
    norm("attn_norm"),
    T("attn_q", "q_out", "n_embd"), T("attn_k", "kv_out", "n_embd"), T("attn_v", "v_out", "n_embd"),
    T("attn_output", "n_embd", "q_out"),
    norm("ffn_norm"),
    T("ffn_gate", "n_ff", "n_embd"), T("ffn_up", "n_ff", "n_embd"), T("ffn_down", "n_embd", "n_ff"),
)
QK_NORMS = (norm("attn_q_norm", "head_dim"), norm("attn_k_norm", "head_dim"))


def with_qk_norms(schema: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """The schema with per-head q/k norms after the attention output (the synth order)."""
    at = [t.name for t in schema].index("attn_output") + 1
    return schema[:at] + QK_NORMS + schema[at:]


class Schema(base.Schema):
    config_class = Config
    tensors = TENSORS
