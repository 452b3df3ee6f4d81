"""Qwen2 / Qwen2.5 (dense): the llama block with biases on Q, K and V and NEOX RoPE."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.models import llama


@dataclass
class Config(llama.Config):
    rope_neox: bool = True


TENSORS = llama.TENSORS + tuple(llama.T(n, size, role="bias", suffix="bias")
                                for n, size in (("attn_q", "q_out"), ("attn_k", "kv_out"), ("attn_v", "v_out")))


class Model(llama.Model):
    config_class = Config
    tensors = TENSORS
