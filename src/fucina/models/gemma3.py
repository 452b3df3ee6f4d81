"""Gemma 3: sliding-window local layers interleaved with global ones (every 6th is
global), q/k RMSNorm, post-attention and post-FFN norms, GeGLU, embeddings scaled by
sqrt(n_embd), local layers on their own RoPE base, optional final logit soft-capping.
All of it is data for the llama skeleton: the schema adds the norms, the config the
window pattern, the layer specs the window and RoPE table per layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fucina.gguf import GGUFFile
from fucina.models import llama
from fucina.models.base import LayerSpec, Rope, meta_field


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    sliding_window: int = meta_field("attention.sliding_window", 0)
    rope_base_swa: float = meta_field("rope.freq_base_swa", 10000.0, kind=float)
    final_softcap: float = meta_field("final_logit_softcapping", 0.0, kind=float)
    attn_scale: float = 1.0
    swa_pattern: object = None

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        self.swa_pattern = f.metadata.get(f"{self.arch}.attention.sliding_window_pattern")
        big = self.n_layer == 62  # Gemma 3 27B scales by the model width, the rest by head_dim
        self.attn_scale = 1.0 / math.sqrt(self.n_embd / self.n_head if big else self.head_dim)

    def is_local(self, i: int) -> bool:
        p = self.swa_pattern
        if self.sliding_window == 0:
            return False
        if isinstance(p, (list, np.ndarray)):
            return i < len(p) and bool(p[i])
        n = int(p) if p else 6
        return n == 0 or i % n < n - 1

    def layer_spec(self, i: int) -> LayerSpec:
        s = super().layer_spec(i)
        if self.is_local(i):
            s.window, s.rope = self.sliding_window, 1
        return s


TENSORS = llama.with_qk_norms(llama.TENSORS) + (llama.norm("post_attention_norm"), llama.norm("post_ffw_norm"))


class Model(llama.Model):
    config_class = Config
    tensors = TENSORS
    act = "gelu_tanh"

    def __init__(self, f: GGUFFile):
        super().__init__(f)
        c = self.config
        self.rope_global = self.rope   # NEOX at the global base
        self.rope_local = Rope(c.n_rot, c.rope_base_swa, True)
        self.embed_scale = math.sqrt(c.n_embd)
        self.final_softcap = c.final_softcap

    def plan_scale(self) -> float:
        return self.config.attn_scale

    def rope_tables(self, capacity: int = 0) -> list[Rope]:
        return [self.rope_global, self.rope_local]
