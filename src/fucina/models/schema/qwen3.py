"""Qwen3's schema (torch-free): llama's layer with per-head q/k norms, NEOX RoPE."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.models.schema import llama


@dataclass
class Config(llama.Config):
    rope_neox: bool = True


TENSORS = llama.with_qk_norms(llama.TENSORS)


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS
