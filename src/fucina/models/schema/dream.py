"""Dream's schema (torch-free): Qwen2's layer (Q, K, V biases, NEOX RoPE) as a
bidirectional denoiser, plus the diffusion fields (mask token, logits shift)."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.gguf import GGUFFile
from fucina.models.schema import qwen2
from fucina.models.schema.diffusion import DiffusionFields


@dataclass
class Config(DiffusionFields, qwen2.Config):
    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        self.read_diffusion(f)


TENSORS = qwen2.TENSORS


class Schema(qwen2.Schema):
    config_class = Config
    tensors = TENSORS
