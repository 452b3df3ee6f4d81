"""Phi-3 / Phi-3.5 (dense): the llama block with Q, K and V fused in one `attn_qkv` and
gate/up fused in one `ffn_up` [gate | up], NEOX RoPE. Its RoPE variants, as llama.cpp
reads the metadata: per-frequency factors `rope_factors_long` / `rope_factors_short`
(LongRoPE; the long ones when the context exceeds rope.scaling.original_context_length),
or one `rope_freqs`, and `rope.scaling.attn_factor` scaling cos/sin."""
from __future__ import annotations

import torch

from fucina.gguf import GGUFFile
from fucina.models import llama
from fucina.models.base import Rope, Tensors, vector
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.phi3 import TENSORS, Config, Schema  # noqa: F401


class Model(llama.Model):
    schema = Schema

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        super().__init__(f, checked)
        c = self.config
        self.rope.mscale = c.rope_attn_factor
        self.rope_long = None
        long = vector(self.checked["rope_factors_long.weight"])
        if long is not None:
            self.rope_long = Rope(c.n_rot, c.rope_base, True, c.rope_scale)
            self.rope_long.inv_freq = self.rope_long.inv_freq / long.double()
            self.rope_long.mscale = c.rope_attn_factor

    def rope_factors(self, t: Tensors) -> torch.Tensor | None:
        if t["rope_freqs.weight"] is not None:
            return vector(t["rope_freqs.weight"])
        return vector(t["rope_factors_short.weight"])

    def rope_tables(self, capacity: int = 0) -> list[Rope]:
        if self.rope_long is not None and capacity > self.config.n_ctx_orig:
            return [self.rope_long]
        return [self.rope]
