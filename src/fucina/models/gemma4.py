"""Gemma 4 (dense; the E2B/E4B geometries included): the geometry-heavy Gemma.

What differs from Gemma 3, as llama.cpp b11434 runs it (src/models/gemma4.cpp):
- per-layer KV geometry: sliding-window layers and global layers have their own head
  dims (`attention.key_length_swa` vs `attention.key_length`), KV-head counts (an
  array `attention.head_count_kv`), RoPE bases and rotary widths; the global layers'
  RoPE divides its frequencies by `rope_freqs` (proportional partial rotary);
- the last `attention.shared_kv_layers` layers store no K/V: each reads the last
  earlier writer of its own type (an AliasKV memory);
- V is RMS-normed (no weight), Q and K by their norms; attention scale 1;
  a layer without attn_v uses K's projection as V;
- per-layer embeddings (E-models): a token's per-layer row plus a projection of its
  embedding, gated into the residual after each layer's FFN;
- an optional per-layer output scale, and the final logit soft-cap.

The per-layer inputs ride along the residual as trailing columns (embed appends them,
each block reads its slice and passes them on, head drops them), so the generic
prefill chunking and batched decode carry them without knowing about them.
The native layer step runs every dense geometry (per-layer head dims, KV heads, rotary
widths and FFN widths, V norm, output scale, shared-KV layers reading their source's
rows, the per-layer inputs riding in each row's trailing columns); the torch blocks stay
the reference (FUCINA_NATIVE_STEP=0).

The MoE variant (26B-A4B: layers with ffn_gate_inp) keeps the dense FFN as a shared
expert beside the routed ones, each with its own norms: ffn = post_ffw_norm(
post_ffw_norm_1(mlp(ffn_norm(h))) + post_ffw_norm_2(experts(pre_ffw_norm_2(h)))); the
router reads rms(h) / sqrt(n_embd) * ffn_gate_inp.scale, softmax top-k renormalised
(moe.Routing), the optional ffn_down_exps.scale weighs each expert's output, GELU experts
(moe.mix). Those files run the torch blocks (the native step has no such ffn).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from fucina import kernels
from fucina.errors import GGUFError, UnsupportedArchitecture
from fucina.gguf import GGUFFile
from fucina.models import llama, moe
from fucina.models.base import (LayerSpec, Ragged, Rope, attend, attention, check_shape, load_layer_tensors, meta_field,
                                load_experts, load_linear, load_vector, rms_norm)
from fucina.models.cache import AliasKV, KVCache


def _per_layer(f: GGUFFile, key: str, n: int, default=None) -> list[int] | None:
    """An int-or-array key broadcast over the layers (llama.cpp's get_key_or_arr)."""
    v = f.metadata.get(key)
    if v is None:
        return None if default is None else [default] * n
    if isinstance(v, (list, tuple, np.ndarray)):
        if len(v) != n:
            raise GGUFError(f"{f.path}: {key} has {len(v)} entries for {n} layers")
        return [int(x) for x in v]
    return [int(v)] * n


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    # arrays in the E-models: read in finish, not by the generic scalar reader
    n_head_kv: int = 0
    n_ff: int = 0
    sliding_window: int = meta_field("attention.sliding_window")
    head_dim_swa: int = meta_field("attention.key_length_swa", derive=lambda v: v["head_dim"])
    v_dim_swa: int = meta_field("attention.value_length_swa", derive=lambda v: v["head_dim_swa"])
    n_rot_swa: int = meta_field("rope.dimension_count_swa", derive=lambda v: v["n_rot"])
    rope_base_swa: float = meta_field("rope.freq_base_swa", 10000.0, kind=float)
    n_kv_shared: int = meta_field("attention.shared_kv_layers", 0, zero_ok=True)
    n_embd_per_layer: int = meta_field("embedding_length_per_layer_input", 0, zero_ok=True)
    final_softcap: float = meta_field("final_logit_softcapping", 0.0, kind=float)
    n_expert: int = meta_field("expert_count", 0, zero_ok=True)
    n_expert_used: int = meta_field("expert_used_count", 0, zero_ok=True)
    n_ff_exp: int = 0
    routing: moe.Routing | None = None
    swa: tuple = ()
    kv_heads: tuple = ()
    ffs: tuple = ()

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        a, n = self.arch, self.n_layer
        pattern = f.metadata.get(f"{a}.attention.sliding_window_pattern")
        if pattern is None:
            raise GGUFError(f"{f.path}: missing metadata key {a}.attention.sliding_window_pattern")
        self.swa = tuple(bool(p) for p in pattern) if isinstance(pattern, (list, tuple, np.ndarray)) \
            else tuple(i % int(pattern) < int(pattern) - 1 for i in range(n))
        if len(self.swa) != n:
            raise GGUFError(f"{f.path}: sliding_window_pattern has {len(self.swa)} entries for {n} layers")
        self.kv_heads = tuple(_per_layer(f, f"{a}.attention.head_count_kv", n, self.n_head))
        self.ffs = tuple(_per_layer(f, f"{a}.feed_forward_length", n) or [])
        if not self.ffs or min(self.kv_heads) <= 0 or min(self.ffs) <= 0:
            raise GGUFError(f"{f.path}: feed_forward_length and head_count_kv must be positive")
        self.n_head_kv, self.n_ff = self.kv_heads[0], self.ffs[0]
        if self.n_kv_shared and n - self.n_kv_shared < 2:
            raise GGUFError(f"{f.path}: shared_kv_layers {self.n_kv_shared} leaves fewer than 2 KV layers")
        for i in range(self.first_shared, n):
            if self.swa[self.kv_source(i)] != self.swa[i] or self.kv_heads[self.kv_source(i)] != self.kv_heads[i]:
                raise GGUFError(f"{f.path}: shared-KV layer {i} reads layer {self.kv_source(i)} of another geometry")
        if self.head_dim != self.v_dim or self.head_dim_swa != self.v_dim_swa:
            raise GGUFError(f"{f.path}: gemma4 needs key and value head sizes equal")
        if self.n_expert:
            widths = set(_per_layer(f, f"{a}.expert_feed_forward_length", n) or [0])
            if len(widths) != 1 or min(widths) <= 0 or not 0 < self.n_expert_used <= self.n_expert:
                raise GGUFError(f"{f.path}: MoE needs one positive expert_feed_forward_length and "
                                f"0 < expert_used_count <= expert_count")
            self.n_ff_exp = widths.pop()
            self.routing = moe.Routing(self.n_expert, self.n_expert_used, norm=True)

    @property
    def first_shared(self) -> int:
        return self.n_layer - self.n_kv_shared

    def kv_source(self, i: int) -> int:
        """The layer whose K/V layer i reads (itself unless it is a shared-KV layer):
        the last KV layer of the same type, as llama.cpp's layer_reuse_cb picks it."""
        if i < self.first_shared:
            return i
        return self.first_shared - (2 if self.swa[i] else 1)

    def layer_spec(self, i: int) -> LayerSpec:
        local = self.swa[i]
        d = self.head_dim_swa if local else self.head_dim
        return LayerSpec(n_head=self.n_head, n_head_kv=self.kv_heads[i], head_dim=d, v_dim=d,
                         window=self.sliding_window if local else 0, rope=1 if local else 0)


# attn_k/attn_k_norm are absent on shared-KV layers, attn_v on "K = V" layers
TENSORS = (
    llama.norm("attn_norm"),
    llama.T("attn_q", "q_out", "n_embd"), llama.T("attn_k", "kv_out", "n_embd", required=False),
    llama.T("attn_v", "v_out", "n_embd", required=False),
    llama.T("attn_output", "n_embd", "q_out"),
    llama.norm("attn_q_norm", "head_dim"), llama.norm("attn_k_norm", "head_dim", required=False),
    llama.norm("ffn_norm"),
    llama.T("ffn_gate", "n_ff", "n_embd"), llama.T("ffn_up", "n_ff", "n_embd"), llama.T("ffn_down", "n_embd", "n_ff"),
    llama.norm("post_attention_norm"), llama.norm("post_ffw_norm"),
)
# per-layer embeddings (when embedding_length_per_layer_input > 0)
PLE_TENSORS = (llama.T("inp_gate", "n_ple", "n_embd"), llama.T("proj", "n_embd", "n_ple"), llama.norm("post_norm"))
OUT_SCALE = (llama.norm("layer_output_scale", "one", required=False),)
# a MoE layer's router and norms (its ffn_gate/up/down are the shared expert)
MOE_TENSORS = (llama.T("ffn_gate_inp", "n_expert", "n_embd"), llama.T("ffn_gate_inp", "n_embd", suffix="scale"),
               llama.norm("pre_ffw_norm_2"), llama.norm("post_ffw_norm_1"), llama.norm("post_ffw_norm_2"),
               llama.T("ffn_down_exps", "n_expert", suffix="scale", required=False))


class _Half:
    """The gate (half 0) or up (half 1) rows of a fused gate_up expert stack, as moe.mix
    reads a stack: expert e's [n_ff_exp, n_embd] matrix."""

    def __init__(self, pairs, half: int):
        self.pairs, self.half = pairs, half   # an ExpertStack of 2 * n_expert halves
        self.n_expert, self.out_features = pairs.n_expert // 2, pairs.out_features

    def expert(self, e: int):
        return self.pairs.expert(2 * e + self.half)


def _load_experts(f: GGUFFile, i: int, c: Config) -> moe.Experts:
    """gate/up/down stacks, or the fused gate_up stack (gate rows first in each expert)."""
    from fucina.weights import ExpertStack
    b, NE, M, E = f"blk.{i}.", c.n_expert, c.n_ff_exp, c.n_embd
    down = load_experts(f, b + "ffn_down_exps.weight", (NE, E, M))
    fused = load_experts(f, b + "ffn_gate_up_exps.weight", (NE, 2 * M, E), required=False)
    if fused is not None:
        pairs = ExpertStack(fused.whole, 2 * NE)
        return moe.Experts(_Half(pairs, 0), _Half(pairs, 1), down)
    return moe.Experts(load_experts(f, b + "ffn_gate_exps.weight", (NE, M, E)),
                       load_experts(f, b + "ffn_up_exps.weight", (NE, M, E)), down)


class Layer(llama.Layer):
    def __init__(self, f: GGUFFile, i: int, c: Config, schema):
        s = c.layers[i]
        view = replace(c, n_head_kv=s.n_head_kv, head_dim=s.head_dim, v_dim=s.v_dim, n_ff=c.ffs[i])
        super().__init__(f, i, view, schema)
        self.has_kv = c.kv_source(i) == i
        if self.has_kv and self.wk is None and self.wqkv is None:
            raise GGUFError(f"{f.path}: layer {i} stores K/V but has no attn_k")
        dims = dict(n_embd=c.n_embd, n_ple=c.n_embd_per_layer, one=1)
        t = load_layer_tensors(f, i, OUT_SCALE + (PLE_TENSORS if c.n_embd_per_layer else ()), dims)
        self.out_scale = t["layer_output_scale"]
        self.inp_gate, self.proj, self.ple_norm = t.get("inp_gate"), t.get("proj"), t.get("post_norm")
        self.experts = None
        if f"blk.{i}.ffn_gate_inp.weight" in f.tensors:
            if not c.n_expert:
                raise GGUFError(f"{f.path}: layer {i} has a router but expert_count is missing")
            t = load_layer_tensors(f, i, MOE_TENSORS, dict(n_embd=c.n_embd, n_expert=c.n_expert))
            self.router, self.router_scale = t["ffn_gate_inp"], t["ffn_gate_inp_scale"]
            self.pre_norm_2, self.post_norm_1, self.post_norm_2 = (t["pre_ffw_norm_2"], t["post_ffw_norm_1"],
                                                                   t["post_ffw_norm_2"])
            self.expert_scale = t["ffn_down_exps_scale"]
            if any(f"blk.{i}.{n}.scale" in f.tensors for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps")):
                raise UnsupportedArchitecture(f"{f.path}: layer {i}: gate/up expert scales are not supported")
            self.experts = _load_experts(f, i, c)

    def project(self, x: torch.Tensor):
        """q, k, v of the normed residual (k and v None on a shared-KV layer)."""
        if self.wqkv is not None:
            return self.wqkv(x).split(self.split_qkv, dim=-1)
        q = self.wq(x)
        if not self.has_kv:
            return q, None, None
        k = self.wk(x)
        return q, k, self.wv(x) if self.wv is not None else k


class Model(llama.Model):
    config_class = Config
    tensors = TENSORS
    layer_class = Layer
    act = "gelu_tanh"

    def __init__(self, f: GGUFFile):
        super().__init__(f)
        c = self.config
        self.rope_local = Rope(c.n_rot_swa, c.rope_base_swa, True)
        self.embed_scale = math.sqrt(c.n_embd)
        self.final_softcap = c.final_softcap
        P, E = c.n_embd_per_layer, c.n_embd
        if P:
            self.ple_embd = check_shape(load_linear(f, "per_layer_token_embd.weight"), c.n_vocab, P * c.n_layer)
            self.ple_model_proj = check_shape(load_linear(f, "per_layer_model_proj.weight"), P * c.n_layer, E)
            self.ple_proj_norm = load_vector(f, "per_layer_proj_norm.weight", P)

    def rope_factors(self, f: GGUFFile) -> torch.Tensor | None:
        # the global layers' table: rope.dimension_count over key_length
        return load_vector(f, "rope_freqs.weight", self.config.n_rot // 2, required=False)

    def rope_tables(self, capacity: int = 0) -> list[Rope]:
        return [self.rope, self.rope_local]

    def plan_scale(self) -> float:
        return 1.0   # q and k are RMS-normed; Gemma 4 attends unscaled

    # -- the native step: every geometry (per-layer inputs, shared KV, per-layer FFN widths) --
    def build_plan(self) -> "kernels.DecoderPlan | None":
        c = self.config
        if c.n_expert:
            return None   # the shared-plus-routed ffn has no native form: the torch blocks
        if any(s.head_dim % 16 or (c.n_rot_swa if s.window else c.n_rot) > s.head_dim for s in c.layers):
            return None
        return kernels.DecoderPlan.build(
            n_embd=c.n_embd, n_ff=max(c.ffs), n_rot=c.n_rot, neox=True, act=self.act, eps=c.rms_eps, scale=1.0,
            layers=[self.plan_layer(i, L) for i, L in enumerate(self.layers)], n_ple=c.n_embd_per_layer)

    def plan_layer(self, i: int, L: Layer) -> dict:
        c, s, d = self.config, self.config.layers[i], super().plan_layer(i, L)
        if L.wqkv is None and L.wv is None:
            d["wv"] = L.wk                       # V is K's projection (normed apart)
        d.update(layer_rot=c.n_rot_swa if s.window else 0, v_norm=torch.ones(s.head_dim),
                 out_scale=float(L.out_scale) if L.out_scale is not None else 0.0,
                 layer_ff=c.ffs[i], ple_gate=L.inp_gate, ple_proj=L.proj, ple_norm=L.ple_norm)
        if not L.has_kv:                          # reads its source's rows: q only
            d.update(kv_from=c.kv_source(i) + 1, v_norm=None)
        return d

    # -- the cache: shared-KV layers alias their source ------------------------------
    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16", rewindable: bool = False) -> KVCache:
        cache = super().init_cache(capacity, dtype, cache_type, rewindable)
        c = self.config
        mems = list(cache.memories)
        for i in range(c.first_shared, c.n_layer):
            src = c.kv_source(i)
            mems[i] = AliasKV(mems[src], src)
        return type(cache).of(mems, cache.capacity)

    def kv_bytes(self, capacity: int, cache_type: str = "f16") -> int:
        c, full = self.config, super().kv_bytes(capacity, cache_type)
        per_value = 2.0 if cache_type == "f16" else 34 / 32
        for s in c.layers[c.first_shared:]:
            rows = min(capacity, s.window + self.window_slack) if s.window else capacity
            full -= int(rows * s.n_head_kv * 2 * s.head_dim * per_value)
        return full

    # -- the hooks ---------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The scaled embeddings, then (E-models) every layer's input as trailing columns."""
        c = self.config
        x = self.tok_embd.rows(ids).float() * self.embed_scale
        P = c.n_embd_per_layer
        if not P:
            return x
        m = x.shape[0]
        own = self.ple_embd.rows(ids).float().reshape(m, c.n_layer, P) * math.sqrt(P)
        proj = (self.ple_model_proj(x) * (1.0 / math.sqrt(c.n_embd))).reshape(m, c.n_layer, P)
        ple = (rms_norm(proj, self.ple_proj_norm, c.rms_eps) + own) * (1.0 / math.sqrt(2.0))
        return torch.cat([x, ple.reshape(m, -1)], dim=-1)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return super().head(x[..., :self.config.n_embd])

    def mixer(self, i: int, L: Layer, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        c, s, m = self.config, self.config.layers[i], x.shape[0]
        q, k, v = L.project(x)
        q = rms_norm(q.reshape(m, s.n_head, s.head_dim), L.q_norm, c.rms_eps)
        rope = self.rope_tables()[s.rope]
        if k is None:
            return L.wo(_attend_shared(q, cache, i, pos0, rope, s.window))
        k = rms_norm(k.reshape(m, s.n_head_kv, s.head_dim), L.k_norm, c.rms_eps)
        v = rms_norm(v.reshape(m, s.n_head_kv, s.head_dim), None, c.rms_eps)
        return L.wo(attend(q, k, v, cache, i, pos0, rope, 1.0, s.window))

    def block(self, i: int, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        c, L = self.config, self.layers[i]
        E, P = c.n_embd, c.n_embd_per_layer
        h, ple = x[:, :E], x[:, E:]
        h = super().block(i, h, cache, pos0) if L.experts is None else self._moe_block(i, L, h, cache, pos0)
        if P:
            g = llama.ACTS[self.act](L.inp_gate(h)) * ple[:, i * P:(i + 1) * P]
            h = h + rms_norm(L.proj(g), L.ple_norm, c.rms_eps)
        if L.out_scale is not None:
            h = h * L.out_scale
        return torch.cat([h, ple], dim=-1) if P else h

    def _moe_block(self, i: int, L: Layer, h: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        """llama.Model.block with gemma4's shared-plus-routed ffn (the module docstring)."""
        c, eps, act = self.config, self.config.rms_eps, llama.ACTS[self.act]
        a = self.mixer(i, L, rms_norm(h, L.attn_norm, eps), cache, pos0)
        h = h + rms_norm(a, L.post_attn_norm, eps)
        shared = rms_norm(self.ffn(i, L, rms_norm(h, L.ffn_norm, eps)), L.post_norm_1, eps)
        logits = L.router(rms_norm(h, None, eps) * (L.router_scale / math.sqrt(c.n_embd)))
        ids, weights = c.routing(logits)
        if L.expert_scale is not None:
            weights = weights * L.expert_scale[ids]
        routed = rms_norm(moe.mix(rms_norm(h, L.pre_norm_2, eps), ids, weights, L.experts, act), L.post_norm_2, eps)
        return h + rms_norm(shared + routed, L.post_ffn_norm, eps)


def _attend_shared(q: torch.Tensor, cache, layer: int, pos0: int, rope: Rope, window: int) -> torch.Tensor:
    """Attention of a shared-KV layer: RoPE q and read the source layer's rows (written
    earlier in this same step), appending nothing."""
    if not isinstance(cache, Ragged):
        return attention(rope(q, pos0), cache, layer, pos0, 1.0, window)
    q = rope.at(q, cache.positions)
    return torch.cat([attention(q[r:r + 1], c, layer, p, 1.0, window)
                      for r, (c, p) in enumerate(zip(cache.caches, cache.pos0s))])
