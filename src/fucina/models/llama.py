"""Llama family (SmolLM2, Llama 2/3, Mistral-style dense decoders).

x = x + attn(rms_norm(x)); x = x + down(silu(gate(h)) * up(h)) with h = rms_norm(x).
RoPE is GGML's NORM mode (adjacent pairs): llama converters permute Q/K for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fucina import kernels
from fucina.gguf import GGUFFile, meta_float, meta_float_opt, meta_int, meta_int_opt
from fucina.models.base import (BaseConfig, DecoderBase, Rope, attend, attn_scale, check_shape,
                                load_linear, load_vector, rms_norm)
from fucina.models.cache import KVCache
from fucina.weights import LinearWeight


@dataclass
class Config(BaseConfig):
    rope_neox: bool = False
    rope_scale: float = 1.0

    @classmethod
    def from_gguf(cls, f: GGUFFile, neox: bool = False) -> "Config":
        m, a = f.metadata, f.architecture
        n_embd = meta_int(m, a, "embedding_length")
        n_head = meta_int(m, a, "attention.head_count")
        head_dim = meta_int_opt(m, a, "attention.key_length") or n_embd // n_head
        n_vocab = meta_int_opt(m, a, "vocab_size") or f.tensor("token_embd.weight").ne[1]
        scale = 1.0
        if m.get(f"{a}.rope.scaling.type") == "linear":
            scale = 1.0 / (meta_float_opt(m, a, "rope.scaling.factor") or 1.0)
        return cls(
            arch=a, n_vocab=n_vocab, n_embd=n_embd,
            n_layer=meta_int(m, a, "block_count"),
            n_head=n_head,
            n_head_kv=meta_int_opt(m, a, "attention.head_count_kv") or n_head,
            head_dim=head_dim,
            n_ff=meta_int(m, a, "feed_forward_length"),
            n_ctx_train=meta_int_opt(m, a, "context_length") or 4096,
            rms_eps=meta_float(m, a, "attention.layer_norm_rms_epsilon"),
            rope_base=meta_float_opt(m, a, "rope.freq_base") or 10000.0,
            n_rot=meta_int_opt(m, a, "rope.dimension_count") or head_dim,
            rope_neox=neox, rope_scale=scale,
        )


class Layer:
    def __init__(self, f: GGUFFile, i: int, c: Config):
        p = f"blk.{i}."
        q_out, kv_out = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        self.attn_norm = load_vector(f, p + "attn_norm.weight", c.n_embd)
        self.wq = check_shape(load_linear(f, p + "attn_q.weight"), q_out, c.n_embd)
        self.wk = check_shape(load_linear(f, p + "attn_k.weight"), kv_out, c.n_embd)
        self.wv = check_shape(load_linear(f, p + "attn_v.weight"), kv_out, c.n_embd)
        self.wo = check_shape(load_linear(f, p + "attn_output.weight"), c.n_embd, q_out)
        self.q_norm = load_vector(f, p + "attn_q_norm.weight", c.head_dim, required=False)
        self.k_norm = load_vector(f, p + "attn_k_norm.weight", c.head_dim, required=False)
        self.ffn_norm = load_vector(f, p + "ffn_norm.weight", c.n_embd)
        self.gate = check_shape(load_linear(f, p + "ffn_gate.weight"), c.n_ff, c.n_embd)
        self.up = check_shape(load_linear(f, p + "ffn_up.weight"), c.n_ff, c.n_embd)
        self.down = check_shape(load_linear(f, p + "ffn_down.weight"), c.n_embd, c.n_ff)
        # one matmul instead of three (QKV) and two (gate/up) where the types agree
        self.wqkv = fuse(f, [self.wq, self.wk, self.wv])
        self.w_gate_up = fuse(f, [self.gate, self.up])
        self.split_qkv = [q_out, kv_out, kv_out]

    def qkv(self, x: torch.Tensor):
        if self.wqkv is not None:
            return self.wqkv(x).split(self.split_qkv, dim=-1)
        return self.wq(x), self.wk(x), self.wv(x)

    def gate_up(self, x: torch.Tensor):
        if self.w_gate_up is not None:
            return self.w_gate_up(x).chunk(2, dim=-1)
        return self.gate(x), self.up(x)


def fuse(f: GGUFFile, parts: list[LinearWeight]) -> LinearWeight | None:
    """Stack same-typed weights into one (the parts' mmap pages are then released)."""
    if len({p.qtype for p in parts}) != 1:
        return None
    fused = LinearWeight.fuse(parts)
    for p in parts:
        f.release(f.tensor(p.name))
    return fused


class Model(DecoderBase):
    supports_batch = True
    layer_class = Layer     # a family with extra per-layer tensors subclasses Layer

    def __init__(self, f: GGUFFile, config: Config | None = None):
        c = self.config = config or Config.from_gguf(f)
        self.tok_embd = check_shape(load_linear(f, "token_embd.weight"), c.n_vocab, c.n_embd)
        self.output_norm = load_vector(f, "output_norm.weight", c.n_embd)
        out = load_linear(f, "output.weight", required=False)
        self.output = check_shape(out, c.n_vocab, c.n_embd) if out else self.tok_embd  # tied
        self.layers = [self.layer_class(f, i, c) for i in range(c.n_layer)]
        freqs = load_vector(f, "rope_freqs.weight", c.n_rot // 2, required=False)
        self.rope = Rope(c.n_rot, c.rope_base, c.rope_neox, c.rope_scale)
        if freqs is not None:  # Llama 3 long-context factors divide the frequencies
            self.rope.inv_freq = self.rope.inv_freq / freqs.double()
        self.scale = attn_scale(c.head_dim)
        self.native_plan = self.build_plan()

    # -- the native layer step: what each layer hands kernels.DecoderPlan ----------------
    plan_act = "silu"

    def plan_layer(self, i: int, L: Layer) -> dict:
        return dict(attn_norm=L.attn_norm, q_norm=L.q_norm, k_norm=L.k_norm, ffn_norm=L.ffn_norm,
                    qkv=[L.wqkv] if L.wqkv is not None else [L.wq, L.wk, L.wv], wo=L.wo,
                    gu=[L.w_gate_up] if L.w_gate_up is not None else [L.gate, L.up], down=L.down)

    def build_plan(self) -> "kernels.DecoderPlan | None":
        c = self.config
        if c.head_dim % 16 or c.n_rot % 2 or c.n_rot > c.head_dim:
            return None
        cls = type(self)
        if cls.block is not Model.block and cls.plan_layer is Model.plan_layer:
            return None   # a family with its own block math must describe it to get a plan
        return kernels.DecoderPlan.build(
            n_embd=c.n_embd, n_head=c.n_head, n_kv=c.n_head_kv, head_dim=c.head_dim, n_ff=c.n_ff,
            n_rot=c.n_rot, neox=c.rope_neox, act=self.plan_act, eps=c.rms_eps, scale=self.plan_scale(),
            layers=[self.plan_layer(i, L) for i, L in enumerate(self.layers)])

    def plan_scale(self) -> float:
        return self.scale

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok_embd.rows(ids)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.output.linear(rms_norm(x, self.output_norm, self.config.rms_eps))

    def attn(self, L: Layer, x: torch.Tensor, cache: KVCache, i: int, pos0: int) -> torch.Tensor:
        c, m = self.config, x.shape[0]
        q, k, v = L.qkv(x)
        q = q.reshape(m, c.n_head, c.head_dim)
        k = k.reshape(m, c.n_head_kv, c.head_dim)
        v = v.reshape(m, c.n_head_kv, c.head_dim)
        if L.q_norm is not None:
            q = rms_norm(q, L.q_norm, c.rms_eps)
        if L.k_norm is not None:
            k = rms_norm(k, L.k_norm, c.rms_eps)
        return L.wo(attend(q, k, v, cache, i, pos0, self.rope, self.scale))

    def block(self, i: int, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        L, eps = self.layers[i], self.config.rms_eps
        x = x + self.attn(L, rms_norm(x, L.attn_norm, eps), cache, i, pos0)
        g, u = L.gate_up(rms_norm(x, L.ffn_norm, eps))
        return x + L.down(F.silu(g) * u)
