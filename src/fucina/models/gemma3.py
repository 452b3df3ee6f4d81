"""Gemma 3: sliding-window local layers interleaved with global ones (every 6th is
global), q/k RMSNorm, post-attention and post-FFN norms, GeGLU, embeddings scaled by
sqrt(n_embd), local layers on their own RoPE base, optional final logit soft-capping.
All of it is data for the llama skeleton: the schema adds the norms, the config the
window pattern, the layer specs the window and RoPE table per layer.
"""
from __future__ import annotations

import math

from fucina.gguf import GGUFFile
from fucina.models import llama
from fucina.models.base import Rope, Tensors
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.gemma3 import TENSORS, Config, Schema  # noqa: F401


class Model(llama.Model):
    schema = Schema
    act = "gelu_tanh"

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        super().__init__(f, checked)
        c = self.config
        self.rope_global = self.rope   # NEOX at the global base
        self.rope_local = Rope(c.n_rot, c.rope_base_swa, True)
        self.embed_scale = math.sqrt(c.n_embd)
        self.final_softcap = c.final_softcap

    def plan_scale(self) -> float:
        return self.config.attn_scale

    def rope_tables(self, capacity: int = 0) -> list[Rope]:
        return [self.rope_global, self.rope_local]
