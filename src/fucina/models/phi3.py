"""Phi-3 / Phi-3.5 (dense): the llama block with Q, K and V fused in one `attn_qkv` and
gate/up fused in one `ffn_up` [gate | up], NEOX RoPE. Its RoPE variants, as llama.cpp
reads the metadata: per-frequency factors `rope_factors_long` / `rope_factors_short`
(LongRoPE; the long ones when the context exceeds rope.scaling.original_context_length),
or one `rope_freqs`, and `rope.scaling.attn_factor` scaling cos/sin."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fucina.gguf import GGUFFile
from fucina.models import llama
from fucina.models.base import Rope, load_vector, meta_field


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    n_ctx_orig: int = meta_field("rope.scaling.original_context_length", derive=lambda v: v["n_ctx_train"])
    rope_attn_factor: float = meta_field("rope.scaling.attn_factor", 1.0, kind=float)


TENSORS = (
    llama.norm("attn_norm"),
    llama.T("attn_qkv", "qkv_out", "n_embd"), llama.T("attn_output", "n_embd", "q_out"),
    llama.norm("ffn_norm"),
    llama.T("ffn_up", "gu_out", "n_embd"), llama.T("ffn_down", "n_embd", "n_ff"),
)


class Model(llama.Model):
    config_class = Config
    tensors = TENSORS

    def __init__(self, f: GGUFFile):
        super().__init__(f)
        c = self.config
        self.rope.mscale = c.rope_attn_factor
        self.rope_long = None
        long = load_vector(f, "rope_factors_long.weight", c.n_rot // 2, required=False)
        if long is not None:
            self.rope_long = Rope(c.n_rot, c.rope_base, True, c.rope_scale)
            self.rope_long.inv_freq = self.rope_long.inv_freq / long.double()
            self.rope_long.mscale = c.rope_attn_factor

    def rope_factors(self, f: GGUFFile) -> torch.Tensor | None:
        n = self.config.n_rot // 2
        freqs = load_vector(f, "rope_freqs.weight", n, required=False)
        return freqs if freqs is not None else load_vector(f, "rope_factors_short.weight", n, required=False)

    def rope_tables(self, capacity: int = 0) -> list[Rope]:
        if self.rope_long is not None and capacity > self.config.n_ctx_orig:
            return [self.rope_long]
        return [self.rope]
