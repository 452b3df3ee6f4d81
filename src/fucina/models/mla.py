"""Multi-head latent attention (DeepSeek-V2's MLA), as llama.cpp b11434 computes it.

Per token: q from an optional low-rank path (attn_q_a -> RMSNorm -> attn_q_b) or one
attn_q, [n_head, nope + rope] per head; attn_kv_a_mqa gives a KV latent [rank] (then
RMSNorm'd) and one rope key [rope] shared by all heads. Keys and values of head h are
    k_h = [k_b[h]^T c ; rope(k_pe)]     v_h = v_b[h] c
so attention runs on the latent directly (the absorbed form): the query's nope part
becomes q_abs[h] = k_b[h] q_nope[h] in latent space, scores are q_abs . c + q_pe . k_pe,
the value read is the softmax-weighted latent, mapped to each head's value by v_b[h].
The cache keeps only c and rope(k_pe) per position (a `LatentKV`), llama.cpp's MLA rows.

RoPE is GGML's NORM mode (adjacent pairs) on the last `rope` dims, with YaRN: the
frequencies blend interpolated and extrapolated by a ramp over the correction dims,
cos/sin carry ggml's magnitude, and the score scale is mscale^2 / sqrt(nope + rope)
with llama.cpp's pre-scaling (`yarn_scales`).
"""
from __future__ import annotations

import math

import torch

from fucina import kernels
from fucina.gguf import GGMLType
from fucina.models.base import Ragged, Rope, rms_norm, rowwise
from fucina.models.cache import KVCache
# the geometry and YaRN parameters are plain data (torch-free: deepseek2's config holds them)
from fucina.models.schema.mla import MLAGeometry, YarnParams  # noqa: F401
from fucina.weights import LinearWeight


# -- YaRN ---------------------------------------------------------------------------

def _get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_scales(y: YarnParams, head_k: int) -> tuple[float, float]:
    """(the RoPE attn_factor ggml is called with, the attention's kq_scale)."""
    attn = 1.0
    if y.ext_factor != 0:   # llama_context: the YaRN magnitude, then cancel ggml's own factor
        factor = 1.0 / y.freq_scale
        if y.log_mul != 0:   # deepseek2 takes mscale = mscale_all_dim: the ratio is 1
            attn = _get_mscale(factor, y.log_mul) / _get_mscale(factor, y.log_mul)
        else:
            attn = _get_mscale(factor, 1.0)
        attn *= 1.0 / (1.0 + 0.1 * math.log(factor))
    attn *= y.attn_factor
    # deepseek2.cpp: undo the adjustment to recover the original factor, pre-scale kq_scale
    lg = math.log(1.0 / y.freq_scale)
    mscale = attn * (1.0 + 0.1 * lg) * (1.0 + 0.1 * y.log_mul * lg)
    return attn, mscale * mscale / math.sqrt(head_k)


def yarn_rope(n_rot: int, base: float, y: YarnParams, attn_factor: float) -> Rope:
    """A NORM-mode Rope with ggml's rope_yarn: per pair i the angle pos * inv_i * (fs (1 -
    mix_i) + mix_i), mix the ramp over the correction dims times ext_factor; cos/sin scaled
    by attn_factor (times 1 + 0.1 ln(1/fs) when ext_factor != 0)."""
    rope = Rope(n_rot, base, False)
    fs, ext = y.freq_scale, y.ext_factor
    mag = attn_factor
    if ext != 0:
        def corr(beta: float) -> float:
            return n_rot * math.log(y.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))
        lo = max(0.0, math.floor(corr(y.beta_fast)))
        hi = min(n_rot - 1.0, math.ceil(corr(y.beta_slow)))
        i = torch.arange(n_rot // 2, dtype=torch.float64)
        ramp = 1 - ((i - lo) / max(0.001, hi - lo)).clamp(0, 1)
        mix = ramp * ext
        rope.inv_freq = rope.inv_freq * (fs * (1 - mix) + mix)
        mag *= 1.0 + 0.1 * math.log(1.0 / fs)
    else:
        rope.inv_freq = rope.inv_freq * fs
    rope.mscale = mag
    return rope


class NoRope:
    """For MLA layers whose key/query "rope" dims are not rotated (llama.cpp: rope type NONE)."""

    mscale = 1.0

    def __call__(self, x: torch.Tensor, pos0: int) -> torch.Tensor:
        return x


# -- the weights --------------------------------------------------------------------

def split_kv_b(kv_b: torch.Tensor, g: MLAGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """The older GGUFs' attn_kv_b [n_head * (nope + v), rank] (per head nope key rows then
    v value rows) as the split the newer ones store: k_b [n_head, rank, nope] (transposed,
    as the converter writes attn_k_b) and v_b [n_head, v, rank]."""
    kv = kv_b.reshape(g.n_head, g.nope + g.v_dim, g.kv_lora)
    k_b, v_b = kv.split([g.nope, g.v_dim], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


class MLAWeights:
    """One layer's attention tensors. k_b/v_b are small (n_head x rank x head dims) and
    are read per head in batched matmuls, so they are kept dequantized (f32)."""

    def __init__(self, t: dict, g: MLAGeometry):
        # the schema (models/schema/deepseek2.py) checked the shapes and that one q path
        # and one k_b/v_b generation are complete
        self.g = g
        self.q_a, self.q_a_norm, self.q_b, self.q = t.get("attn_q_a"), t.get("attn_q_a_norm"), t.get("attn_q_b"), t.get("attn_q")
        self.kv_a, self.kv_a_norm, self.wo = t["attn_kv_a_mqa"], t["attn_kv_a_norm"], t["attn_output"]
        self.gate = t.get("attn_gate")   # kimi-k3: heads * sigmoid(attn_gate x) before attn_output
        if t.get("attn_k_b") is not None and t.get("attn_v_b") is not None:
            self.k_b = t["attn_k_b"].dequantize().reshape(g.n_head, g.kv_lora, g.nope)
            self.v_b = t["attn_v_b"].dequantize().reshape(g.n_head, g.v_dim, g.kv_lora)
        else:
            self.k_b, self.v_b = split_kv_b(t["attn_kv_b"].dequantize(), g)

    def query(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        if self.q is not None:
            return self.q(x)
        return self.q_b(rms_norm(self.q_a(x), self.q_a_norm, eps))


# -- the mixer ----------------------------------------------------------------------

def mla_attention(w: MLAWeights, x: torch.Tensor, cache: KVCache | Ragged, layer: int, pos0: int,
                  rope: Rope, scale: float, eps: float) -> torch.Tensor:
    """Attention of the normed residual x [m, n_embd] -> [m, n_embd]; appends this step's
    latent and rope key to the layer's LatentKV."""
    if isinstance(cache, Ragged):   # each stream's row alone: the same ops as its own decode step
        return torch.cat([mla_attention(w, x[r:r + 1], c, layer, p, rope, scale, eps)
                          for r, (c, p) in enumerate(zip(cache.caches, cache.pos0s))])
    g, m = w.g, x.shape[0]
    q = w.query(x, eps).reshape(m, g.n_head, g.nope + g.rope)
    q_nope, q_pe = q.split([g.nope, g.rope], dim=-1)
    kv = w.kv_a(x)
    latent = rms_norm(kv[:, :g.kv_lora], w.kv_a_norm, eps)[:, None, :]    # [m, 1, rank]
    q_pe, k_pe = rope(q_pe.contiguous(), pos0), rope(kv[:, None, g.kv_lora:].contiguous(), pos0)
    cache.append(layer, latent, k_pe)
    if rowwise(m, cache, q_nope):
        # inference: row by row past the projections, each row the ops of its own decode step
        # (an einsum over m rows picks its GEMM by m, so rows would differ by chunking)
        v = torch.cat([_absorbed(w, q_nope[r:r + 1], q_pe[r:r + 1], cache, layer, pos0 + r, scale)
                       for r in range(m)])
    else:
        v = _absorbed(w, q_nope, q_pe, cache, layer, pos0, scale)
    v = v.reshape(m, g.n_head * g.v_dim)
    if w.gate is not None:
        v = v * torch.sigmoid(w.gate(x).float())
    return w.wo(v)


def _absorbed(w: MLAWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: KVCache, layer: int, pos0: int,
              scale: float) -> torch.Tensor:
    """Rows at pos0.. through the absorbed k_b, the latent attention and v_b -> [m, H, v]."""
    q_abs = torch.einsum("mhd,hrd->mhr", q_nope, w.k_b)                   # [m, H, rank]
    o = _latent_attention(q_abs, q_pe, cache, layer, pos0, scale)
    return torch.einsum("mhr,hvr->mhv", o, w.v_b)                         # [m, H, v]


def _latent_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, cache: KVCache, layer: int, pos0: int,
                      scale: float) -> torch.Tensor:
    """MQA over the cached rows [0, pos0 + m): one latent key/value for every head.
    q_abs [m, H, rank], q_pe [m, H, rope] -> the weighted latent [m, H, rank]."""
    m = q_abs.shape[0]
    n = pos0 + m
    c, k_pe = cache.span(layer, 0, n)
    c, k_pe = c[:, 0].float(), k_pe[:, 0].float()                         # [n, rank], [n, rope]
    s = (q_abs @ c.T + q_pe @ k_pe.T) * scale                             # [m, H, n]
    if m > 1:
        qpos = torch.arange(pos0, n)[:, None, None]
        s = s.masked_fill(torch.arange(n)[None, None, :] > qpos, float("-inf"))
    return torch.softmax(s, dim=-1) @ c


# -- the native step's view of the heads ---------------------------------------------

def stacked_heads(w: LinearWeight | None, t: torch.Tensor, name: str) -> LinearWeight:
    """Stacked heads [H, out, in] as one weight, head h's rows at h * out: the file's (on a
    native route), else the f32 stack the torch mixer holds, over the same memory."""
    if w is not None and isinstance(w.kernel, kernels.QuantKernel):
        return w
    h, n, k = t.shape
    w = LinearWeight(t.contiguous().view(torch.uint8).reshape(h * n, k * 4), GGMLType.F32, h * n, k, name)
    kernels.attach(w)
    return w


def still_rope(n_rot: int) -> Rope:
    """The native plan's table for "rope" dims that are not rotated: cos 1, sin 0 at every
    position (each pair rotated to itself exactly)."""
    rope = Rope(n_rot, 10000.0, False)
    rope.inv_freq = torch.zeros_like(rope.inv_freq)
    return rope


def plan_fields(w: MLAWeights, k_b: LinearWeight | None, v_b: LinearWeight | None) -> dict:
    """An MLA layer's mixer fields of the native plan (kernels.DecoderPlan; csrc mla_impl.inc):
    k_b / v_b the file's attn_k_b / attn_v_b (None: the torch mixer's stacks), the output
    gate (kimi-k3's attn_gate) when the layer has one."""
    g = w.g
    return dict(mixer="mla", n_head=g.n_head, n_kv=1, head_dim=0, mla_rank=g.kv_lora, mla_nope=g.nope,
                mla_rope=g.rope, mla_v=g.v_dim, wq=w.q, q_a=w.q_a, q_a_norm=w.q_a_norm, q_b=w.q_b, kv_a=w.kv_a,
                kv_a_norm=w.kv_a_norm, wo=w.wo, mla_gate=w.gate, k_b=stacked_heads(k_b, w.k_b, "attn_k_b"),
                v_b=stacked_heads(v_b, w.v_b, "attn_v_b"))
