"""Qwen3 (dense): the llama block with per-head q/k RMSNorm and NEOX RoPE; the output
projection is usually tied to the embeddings."""
from __future__ import annotations

from fucina.gguf import GGUFFile
from fucina.models import llama


class Config(llama.Config):
    @classmethod
    def from_gguf(cls, f: GGUFFile, neox: bool = True) -> "Config":
        return super().from_gguf(f, neox=True)


class Model(llama.Model):
    def __init__(self, f: GGUFFile):
        super().__init__(f, Config.from_gguf(f))
        if any(L.q_norm is None or L.k_norm is None for L in self.layers):
            from fucina.errors import GGUFError
            raise GGUFError(f"{f.path}: qwen3 needs attn_q_norm/attn_k_norm in every layer")
