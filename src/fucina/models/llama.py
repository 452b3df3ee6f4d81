"""Llama family (SmolLM2, Llama 2/3, Mistral-style dense decoders), and the block skeleton
every dense family reuses through hooks.

A block is a mixer and an ffn, each behind a pre-norm, with optional post-norms:
    x = x + post_attn_norm(mixer(attn_norm(x)));  x = x + post_ffn_norm(ffn(ffn_norm(x)))
The mixer is attention (optional QKV bias, optional per-head q/k norms, RoPE from the
layer's table, the layer's window); the ffn is dense: down(act(gate(h)) * up(h)). What a
family changes is data: its tensor schema (`TENSORS`), its config fields, `act`,
`embed_scale`, `rope_tables`; the block itself is written once, here, and so is its
native plan. RoPE is GGML's NORM mode (adjacent pairs) unless the config says NEOX.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fucina import kernels
from fucina.gguf import GGUFFile
from fucina.models.base import DecoderBase, Rope, Tensors, TensorSpec, attend, attn_scale, layer_tensors, linear, \
    rms_norm, tensor_dims, vector
from fucina.models.cache import KVCache
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.llama import QK_NORMS, TENSORS, Config, Schema, T, norm, with_qk_norms  # noqa: F401
from fucina.weights import LinearWeight
from fucina.weights.ptqtp import PtqtpWeight


class Layer:
    """One layer's tensors, named as the schema says, in the shape the block uses:
    wqkv (fused) or wq/wk/wv, bqkv (fused bias) or None, w_gate_up (fused) or gate/up."""

    def __init__(self, tensors: Tensors, i: int, c: Config, schema: tuple[TensorSpec, ...]):
        f, t = tensors.f, layer_tensors(tensors, i, schema)
        self.attn_norm, self.ffn_norm = t["attn_norm"], t["ffn_norm"]
        self.q_norm, self.k_norm = t.get("attn_q_norm"), t.get("attn_k_norm")
        self.post_attn_norm, self.post_ffn_norm = t.get("post_attention_norm"), t.get("post_ffw_norm")
        self.wo, self.down = t["attn_output"], t.get("ffn_down")   # None: a MoE layer
        dims = tensor_dims(c)
        self.split_qkv = [dims["q_out"], dims["kv_out"], dims["v_out"]]
        self.wq, self.wk, self.wv = t.get("attn_q"), t.get("attn_k"), t.get("attn_v")
        self.wqkv = t.get("attn_qkv") or fuse(f, [self.wq, self.wk, self.wv])
        biases = [t.get("attn_q_bias"), t.get("attn_k_bias"), t.get("attn_v_bias")]
        self.bqkv = torch.cat(biases).contiguous() if all(b is not None for b in biases) else None
        if "ffn_gate" in t:
            self.gate, self.up = t["ffn_gate"], t["ffn_up"]
            self.w_gate_up = fuse(f, [self.gate, self.up])
        else:   # the checkpoint stores [gate | up] as one ffn_up of 2 * n_ff rows (or none: MoE)
            self.gate = self.up = None
            self.w_gate_up = t.get("ffn_up")

    def qkv(self, x: torch.Tensor):
        if self.wqkv is not None:
            out = self.wqkv(x)
            if self.bqkv is not None:
                out = out + self.bqkv
            return out.split(self.split_qkv, dim=-1)
        if self.bqkv is not None:
            return (self.wqkv_parts(x) + self.bqkv).split(self.split_qkv, dim=-1)
        return self.wq(x), self.wk(x), self.wv(x)

    def wqkv_parts(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.wq(x), self.wk(x), self.wv(x)], dim=-1)

    def gate_up(self, x: torch.Tensor):
        if self.w_gate_up is not None:
            return self.w_gate_up(x).chunk(2, dim=-1)
        return self.gate(x), self.up(x)


def fuse(f: GGUFFile, parts: list[LinearWeight | None]) -> LinearWeight | None:
    """Stack same-typed weights into one (the parts' mmap pages are then released)."""
    if any(p is None for p in parts):
        return None
    if all(isinstance(p, PtqtpWeight) for p in parts):   # trit-planes fuse plane by plane
        return PtqtpWeight.fuse(parts)
    if any(not isinstance(p, LinearWeight) for p in parts) or len({p.qtype for p in parts}) != 1:
        return None
    fused = LinearWeight.fuse(parts)
    for p in parts:
        f.release(f.tensor(p.name))
    return fused


ACTS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


class Model(DecoderBase):
    supports_batch = True
    schema = Schema         # the config and every tensor read, checked (models/schema/llama.py);
                            # schema.tensors: the per-layer list (tests/synth.py writes the same one)
    layer_class = Layer     # what loads one layer's tensors (gemma4 adds its own, a MoE family its experts)
    act = "silu"            # the ffn's activation (ACTS)
    embed_scale = 1.0       # embeddings times this (Gemma: sqrt(n_embd))
    final_softcap = 0.0     # logits -> tanh(l / cap) * cap when > 0
    causal = True           # False: a diffusion canvas, every row attends to every row

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        t = self.check_and_embed(f, checked)
        c = self.config
        self.layers = [self.layer_class(t, i, c, self.schema.tensors) for i in range(c.n_layer)]
        self.rope = Rope(c.n_rot, c.rope_base, c.rope_neox, c.rope_scale)
        freqs = self.rope_factors(t)
        if freqs is not None:  # long-context factors divide the frequencies
            self.rope.inv_freq = self.rope.inv_freq / freqs.double()
        self.scale = attn_scale(c.head_dim)
        self.native_plan = self.build_plan()

    def check_and_embed(self, f: GGUFFile, checked: Tensors | None) -> Tensors:
        """load()'s check of `f` (the schema lists every tensor read below and in the
        layers; `checked`: the table load() already made), then the embeddings and the
        head; returns the checked table."""
        t = self.checked = checked if checked is not None else self.schema.check(f)
        self.config = t.config
        self.tok_embd = linear(t["token_embd.weight"])
        self.output_norm = vector(t["output_norm.weight"])
        self.output = linear(t["output.weight"]) or self.tok_embd   # absent: tied
        return t

    def rope_factors(self, t: Tensors) -> torch.Tensor | None:
        return vector(t["rope_freqs.weight"])

    # -- the block, as hooks ---------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embd.rows(ids)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.output.linear(rms_norm(x, self.output_norm, self.config.rms_eps))
        cap = self.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def mixer(self, i: int, L: Layer, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        """Attention of the normed residual x [m, n_embd] -> [m, n_embd]."""
        c, s, m = self.config, self.config.layers[i], x.shape[0]
        q, k, v = L.qkv(x)
        q = q.reshape(m, s.n_head, s.head_dim)
        k = k.reshape(m, s.n_head_kv, s.head_dim)
        v = v.reshape(m, s.n_head_kv, s.v_dim)
        if L.q_norm is not None:
            q = rms_norm(q, L.q_norm, c.rms_eps)
        if L.k_norm is not None:
            k = rms_norm(k, L.k_norm, c.rms_eps)
        rope = self.rope_tables(cache.capacity)[s.rope]
        return self.attn_out(L, attend(q, k, v, cache, i, pos0, rope, self.plan_scale(), s.window, causal=self.causal))

    def attn_out(self, L: Layer, a: torch.Tensor) -> torch.Tensor:
        """The attention heads [m, n_head * v_dim] through the output projection."""
        return L.wo(a)

    def ffn(self, i: int, L: Layer, x: torch.Tensor) -> torch.Tensor:
        g, u = L.gate_up(x)
        return L.down(ACTS[self.act](g) * u)

    def block(self, i: int, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        L, eps = self.layers[i], self.config.rms_eps
        a = self.mixer(i, L, rms_norm(x, L.attn_norm, eps), cache, pos0)
        x = x + (rms_norm(a, L.post_attn_norm, eps) if L.post_attn_norm is not None else a)
        f = self.ffn(i, L, rms_norm(x, L.ffn_norm, eps))
        return x + (rms_norm(f, L.post_ffn_norm, eps) if L.post_ffn_norm is not None else f)

    # -- the native layer step: what each layer hands kernels.DecoderPlan ----------------
    def plan_layer(self, i: int, L: Layer) -> dict:
        s = self.config.layers[i]
        fused_qkv = dict(wqkv=L.wqkv) if L.wqkv is not None else dict(wq=L.wq, wk=L.wk, wv=L.wv)
        fused_gu = dict(gate_up=L.w_gate_up) if L.w_gate_up is not None else dict(gate=L.gate, up=L.up)
        return dict(mixer=s.mixer, ffn=s.ffn, n_head=s.n_head, n_kv=s.n_head_kv, head_dim=s.head_dim,
                    window=s.window, rope=s.rope, attn_norm=L.attn_norm, q_norm=L.q_norm, k_norm=L.k_norm,
                    post_attn_norm=L.post_attn_norm, ffn_norm=L.ffn_norm, post_ffn_norm=L.post_ffn_norm,
                    qkv_bias=L.bqkv, wo=L.wo, down=L.down, bidir=int(not self.causal), **fused_qkv, **fused_gu)

    def build_plan(self) -> "kernels.DecoderPlan | None":
        c = self.config
        if c.n_rot % 2 or any(s.head_dim % 16 or c.n_rot > s.head_dim or s.v_dim != s.head_dim
                              for s in c.layers):
            return None
        cls = type(self)
        if (cls.block is not Model.block or cls.mixer is not Model.mixer or cls.ffn is not Model.ffn) \
                and cls.plan_layer is Model.plan_layer:
            return None   # a family with its own block math must describe it to get a plan
        return kernels.DecoderPlan.build(
            n_embd=c.n_embd, n_ff=c.n_ff, n_rot=c.n_rot, neox=c.rope_neox, act=self.act, eps=c.rms_eps,
            scale=self.plan_scale(), layers=[self.plan_layer(i, L) for i, L in enumerate(self.layers)])

    def plan_scale(self) -> float:
        return self.scale
