"""Dream's schema (torch-free): Qwen2's layer (Q, K, V biases, NEOX RoPE) as a
bidirectional denoiser, plus the diffusion fields (mask token, logits shift)."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.models.schema import qwen2
from fucina.models.schema.diffusion import DiffusionFields


@dataclass
class Config(DiffusionFields, qwen2.Config):
    pass


TENSORS = qwen2.TENSORS


class Schema(qwen2.Schema):
    config_class = Config
    tensors = TENSORS
