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
(moe.mix). The native step runs it (csrc/generic/moe_shared_impl.inc: the shared expert and
the routed half's own norms and router input; a fused gate_up stack as two strided views).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from fucina import kernels
from fucina.gguf import GGUFFile
from fucina.models import llama, moe
from fucina.models.base import Ragged, Rope, Tensors, attend, attention, layer_tensors, linear, rms_norm, vector
from fucina.models.cache import AliasKV, KVCache
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.gemma4 import (MOE_TENSORS, OUT_SCALE, PLE_TENSORS, TENSORS, Config,  # noqa: F401
                                         Schema)
from fucina.weights import ExpertStack
from fucina.weights.row_groups import row_view


class _Half:
    """The gate (half 0) or up (half 1) rows of a fused gate_up expert stack, as moe.mix
    reads a stack: expert e's [n_ff_exp, n_embd] matrix."""

    def __init__(self, pairs, half: int):
        self.pairs, self.half = pairs, half   # an ExpertStack of 2 * n_expert halves
        self.n_expert, self.out_features = pairs.n_expert // 2, pairs.out_features

    def expert(self, e: int):
        return self.pairs.expert(2 * e + self.half)


def _plan_stacks(ex: moe.Experts) -> dict:
    """The plan's gate/up expert stacks (csrc/fk_plan.h): a fused gate_up stack as two row
    views of it, expert e's gate rows at 2e n_ff_exp and its up rows n_ff_exp after (exps_stride)."""
    if not isinstance(ex.gate, _Half):
        return dict(gate_exps=ex.gate.whole, up_exps=ex.up.whole)
    whole, M, n = ex.gate.pairs.whole, ex.gate.out_features, ex.gate.n_expert
    span = (n - 1) * 2 * M + M

    return dict(gate_exps=row_view(whole, 0, span, f"{whole.name}.gate"),
                up_exps=row_view(whole, M, span, f"{whole.name}.up"), exps_stride=2 * M)


def _load_experts(t: Tensors, i: int, c: Config) -> moe.Experts:
    """gate/up/down stacks, or the fused gate_up stack (gate rows first in each expert)."""
    b = f"blk.{i}."
    down = ExpertStack.from_tensor(t[b + "ffn_down_exps.weight"])
    if b + "ffn_gate_up_exps.weight" in t:
        pairs = ExpertStack(ExpertStack.from_tensor(t[b + "ffn_gate_up_exps.weight"]).whole, 2 * c.n_expert)
        return moe.Experts(_Half(pairs, 0), _Half(pairs, 1), down)
    return moe.Experts(ExpertStack.from_tensor(t[b + "ffn_gate_exps.weight"]),
                       ExpertStack.from_tensor(t[b + "ffn_up_exps.weight"]), down)


class Layer(llama.Layer):
    def __init__(self, tensors: Tensors, i: int, c: Config, schema):
        s = c.layers[i]
        view = replace(c, n_head_kv=s.n_head_kv, head_dim=s.head_dim, v_dim=s.v_dim, n_ff=c.ffs[i])
        super().__init__(tensors, i, view, schema)
        self.has_kv = c.kv_source(i) == i       # the schema checked a KV layer has attn_k
        t = layer_tensors(tensors, i, OUT_SCALE + (PLE_TENSORS if c.n_embd_per_layer else ()))
        self.out_scale = t["layer_output_scale"]
        self.inp_gate, self.proj, self.ple_norm = t.get("inp_gate"), t.get("proj"), t.get("post_norm")
        self.experts = None
        if f"blk.{i}.ffn_gate_inp.weight" in tensors:
            t = layer_tensors(tensors, i, MOE_TENSORS)
            self.router, self.router_scale = t["ffn_gate_inp"], t["ffn_gate_inp_scale"]
            self.pre_norm_2, self.post_norm_1, self.post_norm_2 = (t["pre_ffw_norm_2"], t["post_ffw_norm_1"],
                                                                   t["post_ffw_norm_2"])
            self.expert_scale = t["ffn_down_exps_scale"]
            self.experts = _load_experts(tensors, i, c)

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
    schema = Schema
    layer_class = Layer
    act = "gelu_tanh"

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        super().__init__(f, checked)
        c, t = self.config, self.checked
        self.rope_local = Rope(c.n_rot_swa, c.rope_base_swa, True)
        self.embed_scale = math.sqrt(c.n_embd)
        self.final_softcap = c.final_softcap
        P = c.n_embd_per_layer
        if P:
            self.ple_embd = linear(t["per_layer_token_embd.weight"])
            self.ple_model_proj = linear(t["per_layer_model_proj.weight"])
            self.ple_proj_norm = vector(t["per_layer_proj_norm.weight"])

    def rope_factors(self, t: Tensors) -> torch.Tensor | None:
        # the global layers' table: rope.dimension_count over key_length
        return vector(t["rope_freqs.weight"])

    def rope_tables(self, capacity: int = 0) -> list[Rope]:
        return [self.rope, self.rope_local]

    def plan_scale(self) -> float:
        return 1.0   # q and k are RMS-normed; Gemma 4 attends unscaled

    # -- the native step: every geometry (per-layer inputs, shared KV, per-layer FFN widths) --
    def build_plan(self) -> "kernels.DecoderPlan | None":
        c = self.config
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
        if L.experts is not None:                 # the dense FFN is the shared expert (module docstring)
            r, ex = c.routing, L.experts
            d.update(ffn="moe", n_expert=r.n_expert, n_expert_used=r.k, n_ff_exp=ex.gate.out_features,
                     moe_norm=int(r.norm), moe_scale=r.scale, gate_inp=L.router, **_plan_stacks(ex),
                     down_exps=ex.down.whole, shexp_norm=L.post_norm_1,
                     moe_in_norm=L.pre_norm_2, moe_out_norm=L.post_norm_2, exp_scale=L.expert_scale,
                     router_norm=(L.router_scale / math.sqrt(c.n_embd)).contiguous(),
                     **moe.store_fields(self, i))
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
