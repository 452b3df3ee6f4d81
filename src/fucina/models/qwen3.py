"""Qwen3 (dense): the llama block with per-head q/k RMSNorm and NEOX RoPE; the output
projection is usually tied to the embeddings."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.models import llama


@dataclass
class Config(llama.Config):
    rope_neox: bool = True


TENSORS = llama.with_qk_norms(llama.TENSORS)


class Model(llama.Model):
    config_class = Config
    tensors = TENSORS
