"""LLaDA's schema (torch-free): llama's layer (NORM RoPE, no biases) as a bidirectional
denoiser, plus the diffusion fields (mask token, logits shift: false in LLaDA files)."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.models.schema import llama
from fucina.models.schema.diffusion import DiffusionFields


@dataclass
class Config(DiffusionFields, llama.Config):
    pass


TENSORS = llama.TENSORS


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS
