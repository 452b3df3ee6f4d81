"""Gemma 3's schema (torch-free): the window pattern and per-layer window / RoPE table,
q/k norms and the post-attention and post-FFN norms."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fucina.gguf import GGUFFile
from fucina.models.schema import llama
from fucina.models.schema.base import LayerSpec, meta_field


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


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS
