"""Gemma 3: sliding-window local layers interleaved with global ones (every 6th is
global), q/k RMSNorm, post-attention and post-FFN norms, GeGLU, embeddings scaled by
sqrt(n_embd), local layers on their own RoPE base, optional final logit soft-capping.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fucina.gguf import GGUFFile, meta_float_opt, meta_int_opt
from fucina.models import llama
from fucina.models.base import Rope, attend, load_vector, rms_norm
from fucina.models.cache import KVCache


@dataclass
class Config(llama.Config):
    sliding_window: int = 0
    swa_layers: list[bool] = field(default_factory=list)
    rope_base_swa: float = 10000.0
    attn_scale: float = 1.0
    final_softcap: float = 0.0

    @classmethod
    def from_gguf(cls, f: GGUFFile, neox: bool = True) -> "Config":
        base = llama.Config.from_gguf(f, neox=True)
        m, a = f.metadata, f.architecture
        c = cls(**vars(base))
        c.sliding_window = meta_int_opt(m, a, "attention.sliding_window") or 0
        pattern = m.get(f"{a}.attention.sliding_window_pattern")
        if c.sliding_window == 0:
            c.swa_layers = [False] * c.n_layer
        elif isinstance(pattern, (list, np.ndarray)):
            c.swa_layers = [bool(x) for x in pattern][: c.n_layer]
        else:
            n = int(pattern) if pattern else 6
            c.swa_layers = [n == 0 or i % n < n - 1 for i in range(c.n_layer)]
        c.rope_base_swa = meta_float_opt(m, a, "rope.freq_base_swa") or 10000.0
        big = c.n_layer == 62  # Gemma 3 27B scales by the model width, the rest by head_dim
        c.attn_scale = 1.0 / math.sqrt(c.n_embd / c.n_head if big else c.head_dim)
        c.final_softcap = meta_float_opt(m, a, "final_logit_softcapping") or 0.0
        return c


class Layer(llama.Layer):
    def __init__(self, f: GGUFFile, i: int, c: Config):
        super().__init__(f, i, c)
        p = f"blk.{i}."
        self.post_attn_norm = load_vector(f, p + "post_attention_norm.weight", c.n_embd)
        self.post_ffn_norm = load_vector(f, p + "post_ffw_norm.weight", c.n_embd)


class Model(llama.Model):
    layer_class = Layer

    def __init__(self, f: GGUFFile):
        super().__init__(f, Config.from_gguf(f))
        c = self.config
        self.rope_global = self.rope   # NEOX at the global base (Config sets rope_neox)
        self.rope_local = Rope(c.n_rot, c.rope_base_swa, True)
        self.embd_scale = math.sqrt(c.n_embd)

    plan_act = "gelu_tanh"

    def plan_layer(self, i: int, L: Layer) -> dict:
        c, local = self.config, self.config.swa_layers[i]
        return dict(super().plan_layer(i, L), post_attn_norm=L.post_attn_norm,
                    post_ffn_norm=L.post_ffn_norm, rope=1 if local else 0,
                    window=c.sliding_window if local else 0)

    def plan_scale(self) -> float:
        return self.config.attn_scale

    def rope_tables(self) -> list[Rope]:
        return [self.rope_global, self.rope_local]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok_embd.rows(ids) * self.embd_scale

    def head(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().head(x)
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def block(self, i: int, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        L, c = self.layers[i], self.config
        local = c.swa_layers[i]
        m = x.shape[0]
        q, k, v = L.qkv(rms_norm(x, L.attn_norm, c.rms_eps))
        q = rms_norm(q.reshape(m, c.n_head, c.head_dim), L.q_norm, c.rms_eps)
        k = rms_norm(k.reshape(m, c.n_head_kv, c.head_dim), L.k_norm, c.rms_eps)
        v = v.reshape(m, c.n_head_kv, c.head_dim)
        rope = self.rope_local if local else self.rope_global
        a = attend(q * c.attn_scale, k, v, cache, i, pos0, rope, 1.0, c.sliding_window if local else 0)
        x = x + rms_norm(L.wo(a), L.post_attn_norm, c.rms_eps)
        g, u = L.gate_up(rms_norm(x, L.ffn_norm, c.rms_eps))
        ff = L.down(F.gelu(g, approximate="tanh") * u)
        return x + rms_norm(ff, L.post_ffn_norm, c.rms_eps)
