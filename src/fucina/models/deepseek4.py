"""DeepSeek-V4 (llama.cpp b11434's `deepseek4`, src/models/deepseek4.cpp and
src/llama-kv-cache-dsv4.cpp) on the torch blocks.

The residual is four streams (hyper-connections): x [m, 4 * n_embd]. Around each mixer
and each ffn, `hc_pre` RMS-normalises the flattened streams and projects them to 24 mixes:
pre = sigmoid(.) + eps weighs the streams into the sublayer's input, post = 2 sigmoid(.)
spreads its output back, and a 4x4 comb (softmax over destinations, then Sinkhorn
normalisation of columns and rows, `sinkhorn_iterations` in all) mixes the old streams:
    out[d] = post[d] * f(sum_s pre[s] x[s]) + sum_s comb[s, d] x[s].
The head collapses the streams with its own pre weights before the output norm. With the
native kernels, each mixer after its projection is one call for all rows (csrc/fk_dsv4.cpp,
in the order of ggml's fused dsv4_hc_* ops); the torch spelling below is the path without.

Attention: a low-rank query (q_a, norm, q_b, then an unweighted RMS norm per head), one
K=V row per position (attn_kv, norm), RoPE (GGML NORM mode) on the last n_rot dims, one
softmax with a sink logit per head over the layer's keys, the output de-rotated, then a
grouped low-rank output (attn_output_a per group of heads, attn_output_b). The keys are
  ratio 0:   the raw rows of the last `sliding_window` positions;
  ratio 128: those plus one compressed key per completed 128-position block (HCA: a
             softmax-weighted pool per feature of the block's compressor rows, RMS-normed,
             RoPE'd at the block's first position with the compress base and YaRN);
  ratio 4:   those plus the compressed keys (CSA: an overlapping compressor over the
             previous and the current block, 8 rows) the lightning indexer chooses: its
             own compressed keys, scored per query as sum_h w_h relu(q_h . k), the top_k
             visible blocks kept.
A block is visible to a query once its last position is at or before the query's.
The ffn: a routed MoE with sqrt(softplus) scores (the first `hash_layer_count` layers take
their experts from a table by token id; the others choose by score plus a selection
bias), normalised and scaled weights, SwiGLU clamped at swiglu_clamp_exp, plus the shared
experts (clamped at swiglu_clamp_shexp).

The cache is models/cache/dsv4.py's memory (per position: raw rows, compressor state,
compressed keys), so turns, prefix reuse and speculation rewind like a plain cache.

With the native kernels the layer stays this Python code, its pieces native calls: each
mixer with its norm and projection (hc_pre_full), every RMS norm and RoPE tail, the routed
ffn of a layer as one call of an ffn-only plan (kernels.DecoderPlan with "none" mixers:
sqrt-softplus or hash routing, the clamped-SwiGLU experts and the shared expert), and on
decode rows the whole attention sublayer as two calls around the compressors and the indexer
(attn_in: the input projections, the query and K=V row, the compressor state rows; attn_out:
the attention row over the raw window and the chosen compressed keys, sinks joining, the
inverse RoPE, attn_output_a on its Q8_0 rows in f32 and attn_output_b), or call by call
(qkv_row, attend_row, q8_0_grouped) where a weight carries an unmerged LoRA.
Not built: the MTP block (a file that carries one runs its trunk; the block is not read,
so it does not draft), the vision routing bias, one native call for the whole layer (the
compressors and the indexer stay torch ops).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from fucina import kernels
from fucina.errors import FucinaError, KVCacheError
from fucina.gguf import GGMLType, GGUFFile
from fucina.kernels import dsv4 as hc_native
from fucina.models import llama, moe
from fucina.models.base import ROWWISE_MAX, FusedParts, Rope, Tensors, layer_tensors, linear, rms_norm, vector
from fucina.models.cache import KVCache, cache_capacity
from fucina.models.cache.dsv4 import DSV4Memory
from fucina.models.mla import yarn_rope
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.deepseek4 import CSA, HCA, TENSORS, Config, Schema, layer_schema  # noqa: F401


class HC:
    """One hyper-connection mixer's weights: fn [24, 4 n_embd], base [24], scale [3] (n = 4 streams)."""

    def __init__(self, t: dict, part: str, n: int):
        self.fn, self.base, self.scale = t[f"hc_{part}_fn"], t[f"hc_{part}_base"], t[f"hc_{part}_scale"]
        self.base, self.scale = self.base.float().contiguous(), self.scale.float().contiguous()
        # the three scales spread over their mixes (pre, post, comb): one product for all 24
        self.scales = torch.cat([self.scale[0].expand(n), self.scale[1].expand(n), self.scale[2].expand(n * n)])

    @property
    def fused(self):
        """fn's native kernel when one call may run norm, projection and mixer (no LoRA on fn)."""
        return kernels.direct_kernel(self.fn)


class Layer(FusedParts):
    def __init__(self, tensors: Tensors, i: int, c: Config):
        self.ratio = c.ratios[i]
        schema = tuple(s for s in layer_schema(c, i) if s.name != "ffn_gate_tid2eid")
        t = layer_tensors(tensors, i, schema)
        self.hc_attn, self.hc_ffn = HC(t, "attn", c.hc), HC(t, "ffn", c.hc)
        self.attn_norm, self.ffn_norm, self.sinks = t["attn_norm"], t["ffn_norm"], t["attn_sinks"]
        self.q_a, self.q_a_norm, self.q_b = t["attn_q_a"], t["attn_q_a_norm"], t["attn_q_b"]
        self.wkv, self.kv_norm = t["attn_kv"], t["attn_kv_a_norm"]
        g = c.o_groups
        self.wo_a = t["attn_output_a"].dequantize().reshape(g, c.o_lora, -1).contiguous()   # [groups, rank, in]
        k = getattr(t["attn_output_a"], "kernel", None)   # Q8_0 rows: the native grouped projection reads them
        self.wo_a_q8 = k.raw if k is not None and k.qtype == GGMLType.Q8_0 else None
        self.wo_b = t["attn_output_b"]
        if self.ratio:
            self.comp_kv, self.comp_gate = t["attn_compressor_kv"], t["attn_compressor_gate"]
            self.comp_ape = t["attn_compressor_ape"].dequantize().contiguous()          # [ratio, coff * hd]
            self.comp_norm = t["attn_compressor_norm"]
        if self.ratio == CSA:
            self.idx_proj, self.idx_q_b = t["indexer.proj"], t["indexer.attn_q_b"]
            self.idx_kv, self.idx_gate = t["indexer_compressor_kv"], t["indexer_compressor_gate"]
            self.idx_ape = t["indexer_compressor_ape"].dequantize().contiguous()
            self.idx_norm = t["indexer_compressor_norm"]
        # every projection of the normed input in one matmul when their types agree
        self.part_attrs = ["q_a", "wkv"] + (["comp_kv", "comp_gate"] if self.ratio else [])
        self.part_attrs += ["idx_kv", "idx_gate", "idx_proj"] if self.ratio == CSA else []
        self.split = [p.out_features for p in self.parts]
        self.w_in = llama.fuse(tensors.f, self.parts)
        self.sh_gate_up = llama.fuse(tensors.f, [t["ffn_gate_shexp"], t["ffn_up_shexp"]])
        self.router = t["ffn_gate_inp"]
        self.experts = moe.Experts(t["ffn_gate_exps"], t["ffn_up_exps"], t["ffn_down_exps"])
        self.sh_gate, self.sh_up, self.sh_down = t["ffn_gate_shexp"], t["ffn_up_shexp"], t["ffn_down_shexp"]
        self.exp_bias = t.get("exp_probs_b_bias")
        self.tid2eid = None
        if i < c.n_hash:
            info = tensors[f"blk.{i}.ffn_gate_tid2eid.weight"]
            table = np.frombuffer(info.data, dtype=np.int32).reshape(c.n_vocab, c.n_expert_used)
            self.tid2eid = torch.from_numpy(table.copy())   # int32, as the native ffn reads it
            if int(self.tid2eid.min()) < 0 or int(self.tid2eid.max()) >= c.n_expert:
                raise FucinaError(f"blk.{i}.ffn_gate_tid2eid holds expert ids outside [0, {c.n_expert})")


def swiglu_clamp(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """ggml_swiglu_clamp: silu(min(g, limit)) * clamp(u, -limit, limit); plain SwiGLU when
    the limit is 0 (llama.cpp's build_ffn / build_moe_ffn for deepseek4)."""
    if limit <= 1e-6:
        return F.silu(g) * u
    g = g.clamp(max=limit)
    return F.silu(g) * u.clamp(-limit, limit)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [m, src, dst]: softmax over dst, + eps, columns (over src) normalised, then
    (iters - 1) times rows then columns (llama.cpp build_hc_sinkhorn)."""
    if comb.shape[0] == 1:   # decode: the same steps on one small array (a torch op costs ~4x more here),
        e = np.float32(eps)  # as bare ufunc calls in place (the sums in the order ndarray.sum adds them)
        c = torch.softmax(comb, dim=-1).numpy()[0] + e
        add, div = np.add, np.divide
        div(c, add(add.reduce(c, 0), e), out=c)
        for _ in range(iters - 1):
            div(c, add(add.reduce(c, 1, keepdims=True), e), out=c)
            div(c, add(add.reduce(c, 0), e), out=c)
        return torch.from_numpy(c[None])
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(1, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(1, keepdim=True) + eps)
    return comb


def weigh_streams(streams: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_s w[:, s] * streams[:, s] added in stream order (ggml's build_hc_pre; a row's
    value does not depend on the rows beside it, as a reduction over dim 1 may)."""
    p = (streams * w[..., None]).unbind(1)      # every product in one op, then the sums in order
    y = p[0] + p[1]
    for s in range(2, len(p)):
        y = y + p[s]
    return y


def rotate_tail(rope: Rope, x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE on the last n_rot dims of x [m, heads, d] (ggml_rope_set_offset(d - n_rot)), row r
    by cis[r] [1, n_rot / 2] (cos + i sin); `inverse`: the rotation back (ggml_rope_ext_back)."""
    if inverse:
        cis = cis.conj()
    return torch.cat([x[..., :-rope.n_rot], rope._rotate(x[..., -rope.n_rot:], cis)], dim=-1)


def sylvester(n: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of order n (a power of 2; symmetric, its own
    inverse), as llama.cpp's ggml_gen_hadamard builds it."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / math.sqrt(n)).float()


def hadamard(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated in consecutive blocks of rot's order (llama_mul_mat_hadamard): the
    indexer's dot products are unchanged, its keys' f16 rounding is llama.cpp's."""
    n = rot.shape[0]
    return (x.reshape(-1, n) @ rot).reshape(x.shape)


def top_k_set(s: torch.Tensor, k: int) -> torch.Tensor:
    """The k indices of s [n > k] ggml's CPU top_k keeps, ascending: the k largest; on a tie
    at the boundary (scores of exactly 0 are common: every head's relu can be 0) the ones
    its std::partial_sort keeps (libstdc++'s heap select, emulated by `_heap_select`)."""
    top = s.topk(k)
    kth = top.values[-1]
    if int((s == kth).sum()) == int((top.values == kth).sum()):
        return top.indices.sort().values   # no tie crosses the boundary: the set is unique
    return torch.tensor(sorted(_heap_select(s.tolist(), k)), dtype=torch.long)


def _heap_select(v: list[float], k: int) -> list[int]:
    """libstdc++'s std::__heap_select(first, first + k, last, comp) over indices 0..n-1 with
    comp(a, b) = v[a] > v[b] (ggml's cmp_top_k): the heap's members after the scan."""
    def less(a: int, b: int) -> bool:
        return v[a] > v[b]

    def adjust(h: list[int], hole: int, n: int, value: int) -> None:   # std::__adjust_heap
        top = second = hole
        while second < (n - 1) // 2:
            second = 2 * (second + 1)
            if less(h[second], h[second - 1]):
                second -= 1
            h[hole] = h[second]
            hole = second
        if n % 2 == 0 and second == (n - 2) // 2:
            second = 2 * (second + 1)
            h[hole] = h[second - 1]
            hole = second - 1
        parent = (hole - 1) // 2                                            # std::__push_heap
        while hole > top and less(h[parent], value):
            h[hole] = h[parent]
            hole = parent
            parent = (hole - 1) // 2
        h[hole] = value

    h = list(range(k))
    if k >= 2:                                                              # std::__make_heap
        for parent in range((k - 2) // 2, -1, -1):
            adjust(h, parent, k, h[parent])
    for i in range(k, len(v)):
        if less(i, h[0]):                                                   # std::__pop_heap
            adjust(h, 0, k, i)
    return h


class Model(llama.Model):
    schema = Schema
    supports_batch = False
    cache_types = ("f16",)   # the dsv4 memory keeps f16 rows (and f32 compressor state) only

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        t = self.check_and_embed(f, checked)
        c = self.config
        self.hc_head = (linear(t["output_hc_fn.weight"]), vector(t["output_hc_base.weight"]),
                        vector(t["output_hc_scale.weight"]))
        self.layers = [Layer(t, i, c) for i in range(c.n_layer)]
        y = c.yarn
        attn = 1.0 / (1.0 + 0.1 * math.log(1.0 / y.freq_scale)) if y.ext_factor != 0 else 1.0
        self.rope = Rope(c.n_rot, c.rope_base, False)                       # the raw-only layers
        self.rope_comp = yarn_rope(c.n_rot, c.compress_rope_base, y, attn)  # compressed layers, indexer, blocks
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.native_plan = None
        n = 64   # llama.cpp's indexer keys: rotated in Hadamard blocks of n before their f16 rows
        while c.idx_dim % (2 * n) == 0:
            n *= 2
        self.lid_rot = sylvester(n)
        self._ids: tuple[int, torch.Tensor] = (0, torch.zeros(0, dtype=torch.long))
        self.hc_native = hc_native.available()   # mixers, norms, SwiGLU as native calls (csrc/fk_dsv4.cpp)
        self.fused_attention = True   # a decode row's attention as two native calls (False: call by call)
        self.ffn_plan = self.build_ffn_plan()

    # -- the native ffn ------------------------------------------------------------------
    def build_ffn_plan(self) -> "kernels.DecoderPlan | None":
        """Every layer's routed ffn as one native call per layer (an ffn-only plan: the
        hyper-connection mixers around it stay here). None without native kernels or when
        a weight has no native route (the torch ffn below serves)."""
        if not self.hc_native:
            return None
        c = self.config
        layers = []
        for i, L in enumerate(self.layers):
            ex = L.experts
            shared = (dict(gate_up=L.sh_gate_up) if L.sh_gate_up is not None else dict(gate=L.sh_gate, up=L.sh_up))
            hashed = dict(tid2eid=L.tid2eid) if L.tid2eid is not None else dict(exp_probs_b=L.exp_bias)
            store = moe.store_fields(self, i) if ex.on_use is not None else {}
            layers.append(dict(mixer="none", ffn="moe", n_expert=c.n_expert, n_expert_used=c.n_expert_used,
                               n_ff_exp=ex.gate.out_features, moe_norm=int(c.expert_weights_norm),
                               moe_scale=c.expert_weights_scale, moe_sqrt_softplus=1, gate_inp=L.router,
                               gate_exps=ex.gate.whole, up_exps=ex.up.whole, down_exps=ex.down.whole,
                               down=L.sh_down, layer_ff=L.sh_down.in_features, clamp_exp=c.clamp_exp[i],
                               clamp_shexp=c.clamp_shexp[i], **shared, **hashed, **store))
        return kernels.DecoderPlan.build(
            n_embd=c.n_embd, n_ff=max(L["layer_ff"] for L in layers), n_rot=c.n_rot, neox=False,
            act="swiglu_clamp", eps=c.rms_eps, scale=self.scale, layers=layers)

    def refresh_plans(self) -> None:
        super().refresh_plans()
        self.ffn_plan = self.build_ffn_plan()

    # -- the cache -----------------------------------------------------------------------
    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16", rewindable: bool = False) -> KVCache:
        c = self.config
        if cache_type != "f16":
            raise KVCacheError(f"deepseek4 keeps an f16 cache only (asked for {cache_type!r})")
        cap = cache_capacity(capacity, c.n_ctx_train)
        return KVCache.of([DSV4Memory(cap, L.ratio, c.head_dim, c.idx_dim) for L in self.layers], cap)

    def kv_geometry(self) -> tuple[list[int], list[int]]:
        n = self.config.n_layer
        return [1] * n, [self.config.head_dim] * n

    def kv_bytes(self, capacity: int, cache_type: str = "f16") -> int:
        c = self.config
        return capacity * sum(DSV4Memory(1, L.ratio, c.head_dim, c.idx_dim).bytes_per_position() for L in self.layers)

    # -- the streams ---------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embd.rows(ids)
        return x.repeat(1, self.config.hc)                 # [m, hc * n_embd]: every stream the embedding

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if 1 < x.shape[0] <= ROWWISE_MAX:   # as the blocks: a short step's rows are its decode steps
            return torch.cat([self.head(x[r:r + 1]) for r in range(x.shape[0])])
        c = self.config
        fn, base, scale = self.hc_head
        mixes = fn(self.norm(x, None, c.rms_eps))
        pre = torch.sigmoid(mixes * scale + base) + c.hc_eps
        y = weigh_streams(x.view(-1, c.hc, c.n_embd), pre)
        return self.output.linear(self.norm(y, self.output_norm, c.rms_eps))

    def _native(self, *xs: torch.Tensor) -> bool:
        """The native calls have no backward: torch's ops where a gradient flows (training)."""
        return self.hc_native and not (torch.is_grad_enabled() and any(x.requires_grad for x in xs))

    def norm(self, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        """The RMS norm: ggml's arithmetic in one native call, or torch's without kernels."""
        return hc_native.rms_norm(x, w, eps) if self._native(x) else rms_norm(x, w, eps)

    def swiglu(self, g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
        return hc_native.swiglu_clamp(g, u, limit) if self._native(g, u) else swiglu_clamp(g, u, limit)

    def hc_pre(self, hc: HC, x: torch.Tensor):
        c, n = self.config, self.config.hc
        if self._native(x):   # one call for all rows, in ggml's order
            if hc.fused is not None and x.is_contiguous():   # the norm and the projection in it too
                return hc_native.pre_full(x, hc.fused, hc.scale, hc.base, c.sinkhorn_iters, c.rms_eps, c.hc_eps)
            return hc_native.pre(hc.fn(self.norm(x, None, c.rms_eps)), x, hc.scale, hc.base, c.sinkhorn_iters,
                                 c.hc_eps)
        z = hc.fn(self.norm(x, None, c.rms_eps)) * hc.scales + hc.base     # [m, 24]: pre, post, comb
        # each part contiguous on its own: a vectorised sigmoid rounds apart from the scalar one
        pre = torch.sigmoid(z[:, :n].contiguous()) + c.hc_eps
        post = 2.0 * torch.sigmoid(z[:, n:2 * n].contiguous())
        comb = sinkhorn(z[:, 2 * n:].contiguous().view(-1, n, n), c.sinkhorn_iters, c.hc_eps)
        return weigh_streams(x.view(-1, n, c.n_embd), pre), post, comb

    def hc_post(self, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        if self._native(y, x, post, comb):
            return hc_native.post(y, x, post, comb)
        c = self.config
        streams = x.view(-1, c.hc, c.n_embd)
        out = y[:, None, :] * post[..., None] + torch.bmm(comb.transpose(1, 2), streams)
        return out.reshape(x.shape[0], -1)

    # -- the block -----------------------------------------------------------------------
    def run_layers(self, cache: KVCache, x: torch.Tensor, pos0: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        if ids is None and self.config.n_hash:
            raise FucinaError("deepseek4 routes its first layers by token id: run_layers needs the rows' ids")
        self.bind_ids(pos0, ids if ids is not None else torch.zeros(x.shape[0], dtype=torch.long))
        return super().run_layers(cache, x, pos0, ids)

    def bind_ids(self, pos0: int, ids: torch.Tensor) -> None:
        self._ids = (pos0, ids)

    def block(self, i: int, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        if 1 < x.shape[0] <= ROWWISE_MAX:   # a short step (a speculative verify) is its decode steps, bit for bit
            return torch.cat([self.block(i, x[r:r + 1], cache, pos0 + r) for r in range(x.shape[0])])
        L, eps = self.layers[i], self.config.rms_eps
        h, post, comb = self.hc_pre(L.hc_attn, x)
        x = self.hc_post(self.attention(i, L, self.norm(h, L.attn_norm, eps), cache, pos0), x, post, comb)
        h, post, comb = self.hc_pre(L.hc_ffn, x)
        start, ids = self._ids
        if not 0 <= pos0 - start <= ids.numel() - x.shape[0]:
            raise FucinaError(f"deepseek4 layer {i}: no token ids for positions {pos0}..{pos0 + x.shape[0] - 1}")
        rows = ids[pos0 - start:pos0 - start + x.shape[0]]
        return self.hc_post(self.ffn(i, L, self.norm(h, L.ffn_norm, eps), rows), x, post, comb)

    def ffn(self, i: int, L: Layer, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        if self.ffn_plan is not None and self.use_native_step and self._native(x):
            if L.tid2eid is not None and (ids is None or ids.numel() != x.shape[0]):
                raise FucinaError(f"deepseek4 layer {i} routes by token id: the rows' ids are needed")
            return self.ffn_plan.ffn(i, x.contiguous(), None if L.tid2eid is None else ids.contiguous())
        probs = torch.sqrt(F.softplus(L.router(x).float()))
        if L.tid2eid is not None:
            if ids is None or ids.numel() != x.shape[0]:
                raise FucinaError(f"deepseek4 layer {i} routes by token id: the rows' ids are needed")
            chosen = L.tid2eid[ids].long()
        else:
            chosen = (probs + L.exp_bias).topk(c.n_expert_used, dim=-1).indices
        w = probs.gather(1, chosen)
        if c.expert_weights_norm:
            w = w / w.sum(-1, keepdim=True).clamp(min=moe.NORM_MIN)
        if c.expert_weights_scale not in (0.0, 1.0):
            w = w * c.expert_weights_scale
        limit = c.clamp_exp[i]

        def run(e: int, ws: tuple, xs: torch.Tensor) -> torch.Tensor:
            gate, up, down = ws
            return down(self.swiglu(gate(xs), up(xs), limit))
        if x.shape[0] == 1 and L.experts.on_use is None:   # decode: mix's sum (ascending experts), no regrouping
            out = torch.zeros(1, c.n_embd)
            ids, ws = chosen[0].tolist(), w[0].tolist()      # (an f32 weight as a Python float: the same product)
            for j in sorted(range(len(ids)), key=ids.__getitem__):
                out = out + run(ids[j], L.experts.expert(ids[j]), x) * ws[j]
        else:
            out = moe.mix(x, chosen, w, L.experts, None, run)
        g, u = L.sh_gate_up(x).chunk(2, dim=-1) if L.sh_gate_up is not None else (L.sh_gate(x), L.sh_up(x))
        return out + L.sh_down(self.swiglu(g, u, c.clamp_shexp[i]))

    # -- attention -----------------------------------------------------------------------
    def attention(self, i: int, L: Layer, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        c, m = self.config, x.shape[0]
        mem: DSV4Memory = cache.memories[i]
        if m == 1 and self.fused_attention and self._native(x) and mem.raw.dtype is torch.float16:
            ks = self._row_kernels(L)
            if ks is not None:
                return self._attention_row(L, x, mem, pos0, *ks)
        rope = self.rope_comp if L.ratio else self.rope
        pos = torch.arange(pos0, pos0 + m) if m > 1 else None
        cis = rope._table(pos0 + m)[pos0:pos0 + m, None, :]                  # the rows' rotations
        ys = L.w_in(x).split(L.split, dim=-1) if L.w_in is not None else [w(x) for w in L.parts]
        q_b = kernels.direct_kernel(L.q_b)
        if m == 1 and q_b is not None and self._native(x) and mem.raw.dtype is torch.float16:
            # the query and the K=V row in one call, the row written into the cache
            qr, q = hc_native.qkv_row(ys[0], ys[1], L.q_a_norm, L.kv_norm, q_b, torch.view_as_real(cis[0, 0]),
                                      c.n_head, rope.n_rot, c.rms_eps, mem.row("raw", pos0))
        else:
            qr = self.norm(ys[0], L.q_a_norm, c.rms_eps)
            q = self.norm(L.q_b(qr).view(m, c.n_head, c.head_dim), None, c.rms_eps)
            q = self.rope_tail(rope, q, cis)
            kv = self.rope_tail(rope, self.norm(ys[1], L.kv_norm, c.rms_eps).view(m, 1, c.head_dim), cis)
            mem.put("raw", pos0, kv)
        if L.ratio:
            mem.put("st_kv", pos0, ys[2])
            mem.put("st_sc", pos0, ys[3] + (L.comp_ape[pos0 % L.ratio] if m == 1 else L.comp_ape[pos % L.ratio]))
            self._compress(mem, L, pos0, m, "st_kv", "st_sc", "comp", c.head_dim, L.comp_norm)
        if L.ratio == CSA:
            mem.put("lid_kv", pos0, ys[4])
            mem.put("lid_sc", pos0, ys[5] + (L.idx_ape[pos0 % CSA] if m == 1 else L.idx_ape[pos % CSA]))
            self._compress(mem, L, pos0, m, "lid_kv", "lid_sc", "lid", c.idx_dim, L.idx_norm, self.lid_rot)
        chosen = self._indexer(L, ys[6], qr, mem, pos0) if L.ratio == CSA else None
        if m == 1:
            out = self._attend_row(L, q[0], mem, pos0, None if chosen is None else chosen[0])[None]
        else:
            out = self._attend_rows(L, q, mem, pos0, chosen)
        out = self.rope_tail(rope, out, cis, inverse=True)
        g = c.o_groups
        if L.wo_a_q8 is not None and m <= ROWWISE_MAX and self._native(out):   # the decode route: 4x fewer bytes
            return L.wo_b(hc_native.q8_0_grouped(L.wo_a_q8, g, c.o_lora, out.reshape(m, -1)))
        oa = torch.bmm(out.reshape(m, g, -1).transpose(0, 1), L.wo_a.transpose(1, 2))   # [groups, m, rank]
        return L.wo_b(oa.transpose(0, 1).reshape(m, -1))

    def _row_kernels(self, L: Layer):
        """(w_in, q_b, wo_b) kernels when a decode row's attention may run as two native calls
        (every weight read directly, no LoRA beside it; attn_output_a on its Q8_0 rows), else None."""
        if L.w_in is None or L.wo_a_q8 is None or not hc_native.attend_row_ok(self.config.n_head, self.config.head_dim):
            return None
        ks = (kernels.direct_kernel(L.w_in), kernels.direct_kernel(L.q_b), kernels.direct_kernel(L.wo_b))
        return None if None in ks else ks

    def _attention_row(self, L: Layer, x: torch.Tensor, mem: DSV4Memory, p: int, w_in, q_b, wo_b) -> torch.Tensor:
        """One decode row's attention as `attention` computes it, in two native calls around the
        compressors and the indexer (hc_native.attn_in / attn_out): bit for bit the same."""
        c = self.config
        rope = self.rope_comp if L.ratio else self.rope
        cs = torch.view_as_real(rope._table(p + 1)[p])   # the row's (cos, sin) pairs
        st = (mem.row("st_kv", p), mem.row("st_sc", p), L.comp_ape[p % L.ratio]) if L.ratio else None
        lid = (mem.row("lid_kv", p), mem.row("lid_sc", p), L.idx_ape[p % CSA]) if L.ratio == CSA else None
        qr, q, proj = hc_native.attn_in(x, w_in, L.split, L.q_a_norm, L.kv_norm, q_b, cs, c.n_head, rope.n_rot,
                                        c.rms_eps, mem.row("raw", p), st, lid)
        blocks = None
        if L.ratio:
            self._compress(mem, L, p, 1, "st_kv", "st_sc", "comp", c.head_dim, L.comp_norm)
        if L.ratio == CSA:
            self._compress(mem, L, p, 1, "lid_kv", "lid_sc", "lid", c.idx_dim, L.idx_norm, self.lid_rot)
            blocks = self._indexer(L, proj, qr, mem, p)[0]
        return hc_native.attn_out(q, mem.raw[max(0, p - c.window + 1):p + 1], mem.comp if L.ratio else None, L.ratio,
                                  (p + 1) // L.ratio if L.ratio else 0, blocks, L.sinks, cs, rope.n_rot, L.wo_a_q8,
                                  c.o_groups, c.o_lora, wo_b, self.scale)

    def rope_tail(self, rope: Rope, x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """rotate_tail; with the native kernels in place on x (a fresh [m, heads, d] here)."""
        if self._native(x) and x.is_contiguous():
            return hc_native.rope_tail_(x, torch.view_as_real(cis[:, 0]), rope.n_rot, inverse)
        return rotate_tail(rope, x, cis, inverse)

    def _attend_row(self, L: Layer, q: torch.Tensor, mem: DSV4Memory, p: int,
                    blocks: torch.Tensor | None) -> torch.Tensor:
        """One query row q [H, hd] at position p: softmax with the sinks over the raw window
        and the layer's compressed keys (one native call with the kernels)."""
        c = self.config
        if self._native(q) and mem.raw.dtype is torch.float16 and hc_native.attend_row_ok(c.n_head, c.head_dim):
            rows = None
            if L.ratio:   # block b's key sits at row (b + 1) ratio - 1
                rows = (torch.arange((p + 1) // L.ratio) if blocks is None else blocks) * L.ratio + L.ratio - 1
            return hc_native.attend_row(q.contiguous(), mem.raw[max(0, p - c.window + 1):p + 1],
                                        mem.comp if L.ratio else None, rows, L.sinks, self.scale)
        keys = [mem.raw[max(0, p - c.window + 1):p + 1]]
        if L.ratio:
            n_vis = (p + 1) // L.ratio
            if blocks is None:   # every visible block: block b's key sits at row (b + 1) ratio - 1
                keys.append(mem.comp[L.ratio - 1:n_vis * L.ratio:L.ratio])
            elif blocks.numel():
                keys.append(mem.comp[blocks * L.ratio + L.ratio - 1])
        k = torch.cat(keys).float()                                          # [n, hd]; V = K
        s = (q @ k.T) * self.scale                                           # [H, n]
        s = torch.cat([s, L.sinks[:, None]], dim=1)
        return torch.softmax(s, dim=-1)[:, :-1] @ k

    def _attend_rows(self, L: Layer, q: torch.Tensor, mem: DSV4Memory, pos0: int, chosen: list | None) -> torch.Tensor:
        """A long step's rows at once: the same keys per row as `_attend_row`, as a mask over
        the step's raw span and every compressed key visible to its last row."""
        c, m = self.config, q.shape[0]
        start = max(0, pos0 - c.window + 1)
        pos = torch.arange(pos0, pos0 + m)[:, None]
        kpos = torch.arange(start, pos0 + m)[None, :]
        keys, allow = [mem.raw[start:pos0 + m]], [(kpos <= pos) & (pos - kpos < c.window)]
        if L.ratio:
            nb = (pos0 + m) // L.ratio
            keys.append(mem.comp[torch.arange(nb) * L.ratio + L.ratio - 1])
            sel = torch.arange(nb)[None, :] < (pos + 1) // L.ratio     # every visible block
            for r, b in enumerate(chosen or ()):   # the indexer's choice where it made one
                if b is not None:
                    sel[r] = False
                    sel[r, b] = True
            allow.append(sel)
        k = torch.cat(keys).float()
        s = torch.einsum("mhd,nd->hmn", q, k) * self.scale
        s = s.masked_fill(~torch.cat(allow, dim=1)[None], float("-inf"))
        s = torch.cat([s, L.sinks[:, None, None].expand(-1, m, 1)], dim=-1)
        return torch.einsum("hmn,nd->mhd", torch.softmax(s, dim=-1)[..., :-1], k)

    def _indexer(self, L: Layer, proj: torch.Tensor, qr: torch.Tensor, mem: DSV4Memory, pos0: int) -> list:
        """Per row, the visible CSA blocks the lightning indexer keeps (top_k by
        sum_h w_h relu(q_h . k_b), w = indexer.proj(x) = proj), ascending."""
        c, m = self.config, proj.shape[0]
        n_vis_last = (pos0 + m) // CSA
        if n_vis_last <= c.idx_top_k:   # every row keeps all its visible blocks: nothing to score
            return [None] * m
        iq = L.idx_q_b(qr).view(m, c.idx_heads, c.idx_dim)
        iq = hadamard(self.rope_tail(self.rope_comp, iq, self.rope_comp._table(pos0 + m)[pos0:pos0 + m, None, :]),
                      self.lid_rot)
        w = proj * (1.0 / math.sqrt(c.idx_dim * c.idx_heads))             # [m, heads]
        k = mem.lid[torch.arange(n_vis_last) * CSA + CSA - 1].float()      # [nb, idx_dim]
        score = (torch.relu(torch.einsum("mhd,bd->mhb", iq, k)) * w[..., None]).sum(1)   # [m, nb]
        out = []
        for r in range(m):
            n_vis = (pos0 + r + 1) // CSA
            if n_vis <= c.idx_top_k:
                out.append(None)
            else:
                out.append(top_k_set(score[r, :n_vis], c.idx_top_k))
        return out

    def _compress(self, mem: DSV4Memory, L: Layer, pos0: int, m: int, kv_name: str, sc_name: str,
                  out_name: str, dim: int, norm: torch.Tensor, rot: torch.Tensor | None = None) -> None:
        """The blocks whose last position is in [pos0, pos0 + m): pooled from the state rows,
        RMS-normed, RoPE'd at the block's first position; stored at their last position."""
        r = L.ratio
        if (pos0 + m) // r == pos0 // r:   # no block ends in this step (most decode steps)
            return
        blocks = list(range(pos0 // r, (pos0 + m) // r))
        kv_all, sc_all = getattr(mem, kv_name), getattr(mem, sc_name)
        bs = torch.tensor(blocks)
        cur = (bs[:, None] * r + torch.arange(r)[None, :])                  # [nb, r]
        if r == CSA:   # overlapping: the previous block's first half, this block's second half
            prev = cur - r
            kv_p = kv_all[prev.clamp(min=0), :dim]
            sc_p = sc_all[prev.clamp(min=0), :dim].masked_fill((prev < 0)[..., None], float("-inf"))
            kv_p = kv_p.masked_fill((prev < 0)[..., None], 0.0)
            kv = torch.cat([kv_p, kv_all[cur, dim:]], dim=1)
            sc = torch.cat([sc_p, sc_all[cur, dim:]], dim=1)
        else:
            kv, sc = kv_all[cur], sc_all[cur]
        comp = (kv * torch.softmax(sc, dim=1)).sum(1)                       # [nb, dim]
        comp = self.norm(comp, norm, self.config.rms_eps)
        starts = bs * r   # each block rotated at its first position
        comp = self.rope_tail(self.rope_comp, comp[:, None, :],
                              self.rope_comp._table(int(starts.max()) + 1)[starts, None, :])[:, 0]
        if rot is not None:
            comp = hadamard(comp, rot)
        for b, row in zip(blocks, comp):
            mem.put(out_name, (b + 1) * r - 1, row[None])

    @torch.inference_mode()
    def forward_step_batch(self, caches, tokens) -> torch.Tensor:
        """N caches one token each: each row its own step (no batched route yet)."""
        if len(caches) != len(tokens) or not caches:
            raise FucinaError(f"forward_step_batch: {len(caches)} caches for {len(tokens)} tokens")
        if len({id(c) for c in caches}) != len(caches):
            raise KVCacheError("forward_step_batch: the same cache appears twice")
        return torch.stack([self.forward_step(c, [t], c.len) for c, t in zip(caches, tokens)])

