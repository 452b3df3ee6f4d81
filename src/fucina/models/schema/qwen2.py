"""Qwen2's schema (torch-free): llama's layer with Q, K and V biases, NEOX RoPE."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.models.schema import llama


@dataclass
class Config(llama.Config):
    rope_neox: bool = True


TENSORS = llama.TENSORS + tuple(llama.T(n, size, role="bias", suffix="bias")
                                for n, size in (("attn_q", "q_out"), ("attn_k", "kv_out"), ("attn_v", "v_out")))


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS
