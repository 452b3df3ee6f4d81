"""Kimi-K3 (GGUFs on the `kimi-k3` architecture), as llama.cpp b11434 builds it
(src/models/kimi-k3.cpp): kimi-linear's hybrid of KDA layers (models/kda.py) and NoPE MLA
layers (models/mla.py), dense ffns first and routed + shared experts after, with five
changes:

- cross-layer residual attention (`attn_res.block_size` B > 0): every B-th layer banks its
  raw input and restarts the residual stream from its mixer's output alone; before each
  mixer, each ffn and the head the stream is replaced by a softmax-weighted sum of the
  banked rows and the stream itself, the weights softmax(sum(rms_norm(row) * score)) per
  row (the sum reads the raw rows, the scores the normed ones).
- latent MoE: the router scores the full-width input, the routed experts run on
  ffn_routed_down x, their weighted sum is RMSNorm'd (ffn_routed_norm) and mapped back by
  ffn_routed_up; the shared experts read the full-width input.
- SiTU instead of SwiGLU everywhere: beta tanh(g / beta) sigmoid(g) * lb tanh(u / lb)
  (lb <= 0: u as is).
- the MLA output times sigmoid(attn_gate x) before attn_output (models/mla.py).
- KDA: one full-rank output gate sigmoid(ssm_g x); with `kda.gate_lower_bound` the decay is
  lower_bound * sigmoid(exp(A_log) (f_b(f_a x) + dt_bias)) (ssm_a holds -exp(A_log)).

KDA layers keep a `RecurrentState`, MLA layers a `LatentKV`, so prefix reuse, Conversation
and speculation rewind within the snapshots' horizon; steps of up to ROWWISE_MAX rows run
the KDA layers and the routing row by row (kda.mixer), so a verify block is bitwise its
decode steps. The residual bank lives only inside one call's pass over the layers (every
row's own rows of earlier layers: nothing to cache). The native layer step (`plan_layer`)
runs every layer in one call, kimi-linear's with K3's fields: the lower-bound decay and the
full-rank gate on the KDA mixer, the output gate on the MLA mixer, the latent experts,
SiTU, and the bank as a per-call scratch of the step (csrc/generic/step_impl.inc); the
torch blocks stay the reference (FUCINA_NATIVE_STEP=0).
"""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from fucina import kernels
from fucina.gguf import GGUFFile
from fucina.models import delta_net, kda, llama, mla, moe
from fucina.models.base import ROWWISE_MAX, Rope, Tensors, layer_tensors, rms_norm, vector
from fucina.models.cache import KVCache
from fucina.models.mla import MLAWeights, NoRope, mla_attention
from fucina.models.moe import Experts, Routing, mix
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.kimi_k3 import GATING, Config, Schema, layer_schema  # noqa: F401
from fucina.weights import ExpertStack


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU(gate, up) as ggml computes it (scales by the reciprocal, then tanh, then scale)."""
    a = torch.tanh(g * (1.0 / beta)) * beta * torch.sigmoid(g)
    if linear_beta > 0.0:
        u = torch.tanh(u * (1.0 / linear_beta)) * linear_beta
    return a * u


class Layer(kda.InputParts):
    def __init__(self, tensors: Tensors, i: int, c: Config):
        f = tensors.f
        self.kda, self.moe = c.recurrent[i], i >= c.n_dense_lead
        t = layer_tensors(tensors, i, layer_schema(c, i))
        self.attn_norm, self.ffn_norm = t["attn_norm"], t["ffn_norm"]
        self.attn_score, self.ffn_score = t.get("attn_res_score"), t.get("ffn_res_score")
        if self.kda:
            d = c.dims()
            di, dk = d["d_inner"], d["kda_dim"]
            self.set_parts(t, ["attn_q", "attn_k", "attn_v", "ssm_f_a", "ssm_beta", "ssm_g"])
            self.split = [3 * di, dk, c.n_head, di]
            self.w_in = llama.fuse(f, self.parts)     # one matmul for every projection of x (same types)
            self.conv = torch.cat([t[f"ssm_conv1d_{x}"].dequantize().float().reshape(di, c.d_conv)
                                   for x in "qkv"]).contiguous()             # [3 * d_inner, d_conv]
            self.f_b, self.wo = t["ssm_f_b"], t["attn_output"]
            self.a = t["ssm_a"].float().reshape(c.n_head, 1).contiguous()
            self.dt_bias = t["ssm_dt_bias"].float().contiguous()
            self.o_norm = t["ssm_norm"].float().contiguous()
        else:
            self.attn = MLAWeights(t, c.geometry())
            self.k_b, self.v_b = t.get("attn_k_b"), t.get("attn_v_b")   # the native step reads the file's
        if not self.moe:
            self.gate, self.up, self.down = t["ffn_gate"], t["ffn_up"], t["ffn_down"]
            self.gate_up = llama.fuse(f, [self.gate, self.up])
            return
        self.router, self.exp_bias = t["ffn_gate_inp"], t["exp_probs_b_bias"]
        stack = lambda w: ExpertStack(w, c.n_expert)   # noqa: E731
        self.experts = Experts(stack(t["ffn_gate_exps"]), stack(t["ffn_up_exps"]), stack(t["ffn_down_exps"]))
        self.routed_down, self.routed_up = t.get("ffn_routed_down"), t.get("ffn_routed_up")
        self.routed_norm = t.get("ffn_routed_norm")
        self.sh_gate, self.sh_up, self.sh_down = t["ffn_gate_shexp"], t["ffn_up_shexp"], t["ffn_down_shexp"]
        self.sh_gate_up = llama.fuse(f, [self.sh_gate, self.sh_up]) if self.sh_gate is not None else None

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [m, n_embd] -> [q|k|v, f_a x, beta logits, output gate logits]."""
        if self.w_in is not None:
            return list(self.w_in(x).split(self.split, dim=-1))
        out = [w(x) for w in self.parts]
        return [torch.cat(out[:3], dim=-1)] + out[3:]


class Model(llama.Model):
    supports_batch = True
    schema = Schema
    state_horizon = 18           # lengths a recurrent state can rewind to: a 16-token draft + carried + base

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        t = self.check_and_embed(f, checked)
        c = self.config
        self.layers = [Layer(t, i, c) for i in range(c.n_layer)]
        self.output_score = vector(t["output_res_score.weight"]) if c.res_block else None
        self.routing = (Routing(c.n_expert, c.n_expert_used, GATING[c.gating_func], c.expert_weights_norm,
                                c.expert_weights_scale) if c.n_dense_lead < c.n_layer else None)
        self.rope = NoRope()
        self.scale = 1.0 / math.sqrt(c.head_k_mla)
        self._local = threading.local()   # the residual bank of the pass a thread is running
        self._local.bank = []
        self.native_plan = self.build_plan()

    # -- the block ---------------------------------------------------------------------
    def res_mix(self, cur: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """The residual attention: cur [m, n_embd] replaced by the softmax-weighted sum of
        the banked rows and itself (llama.cpp's res_mix: the current row scored apart)."""
        bank = self._local.bank
        if not bank:
            return cur
        eps = self.config.rms_eps
        src = torch.stack(bank, dim=1)                                          # [m, n_ckpt, n_embd]
        s_src = rms_norm(src, score, eps).sum(-1)                              # [m, n_ckpt]
        s_cur = rms_norm(cur, score, eps).sum(-1, keepdim=True)                # [m, 1]
        p = torch.softmax(torch.cat([s_src, s_cur], dim=-1), dim=-1)
        return (src * p[:, :-1, None]).sum(1) + cur * p[:, -1:]

    def block(self, i: int, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        c, L = self.config, self.layers[i]
        eps, res = c.rms_eps, c.res_block > 0
        if i == 0:
            self._local.bank = []
        h = self.res_mix(x, L.attn_score) if res else x
        banked = res and i % c.res_block == 0
        if banked:
            self._local.bank.append(x)       # the raw layer input, not the mix
        h = rms_norm(h, L.attn_norm, eps)
        a = (kda.mixer(lambda *s: self._kda(L, *s), h, cache, i, pos0, c.d_conv) if L.kda else
             mla_attention(L.attn, h, cache, i, pos0, self.rope, self.scale, eps))
        x = a if banked else x + a
        h = self.res_mix(x, L.ffn_score) if res else x
        x = x + self.ffn(i, L, rms_norm(h, L.ffn_norm, eps))
        if i == c.n_layer - 1 and res:
            x = self.res_mix(x, self.output_score)
            self._local.bank = []
        return x

    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return situ(g, u, self.config.situ_beta, self.config.situ_linear_beta)

    def ffn(self, i: int, L: Layer, x: torch.Tensor) -> torch.Tensor:
        if not L.moe:
            g, u = L.gate_up(x).chunk(2, dim=-1) if L.gate_up is not None else (L.gate(x), L.up(x))
            return L.down(self.act(g, u))
        logits = L.router(x)
        if 1 < x.shape[0] <= ROWWISE_MAX:   # each row alone: a sigmoid over m rows rounds its tail apart
            ids, w = (torch.cat(t) for t in zip(*(self.routing(row, L.exp_bias) for row in logits.split(1))))
        else:
            ids, w = self.routing(logits, L.exp_bias)
        xl = L.routed_down(x) if L.routed_down is not None else x

        def run(e, ws, rows):
            return ws[-1](self.act(ws[0](rows), ws[1](rows)))

        out = mix(xl, ids, w, L.experts, None, run)
        if L.routed_norm is not None:
            out = rms_norm(out, L.routed_norm, self.config.rms_eps)
        if L.routed_up is not None:
            out = L.routed_up(out)
        if L.sh_down is None:
            return out
        g, u = L.sh_gate_up(x).chunk(2, dim=-1) if L.sh_gate_up is not None else (L.sh_gate(x), L.sh_up(x))
        return out + L.sh_down(self.act(g, u))

    def _kda(self, L: Layer, x: torch.Tensor, window: torch.Tensor, state: torch.Tensor, keep: int):
        """m rows through K3's KDA from (window, state): (out [m, n_embd], the padded conv
        input [d_conv - 1 + m, 3 * d_inner], the final state, the last `keep` states)."""
        c, m = self.config, x.shape[0]
        H, dk, eps = c.n_head, c.kda_head_dim, c.rms_eps
        di = H * dk
        qkv, fa, b, gl = L.project(x)
        conv, full = delta_net.causal_conv(qkv.float(), window, L.conv)
        conv = F.silu(conv)
        q = delta_net.l2_norm(conv[:, :di].reshape(m, H, dk), eps)
        k = delta_net.l2_norm(conv[:, di:2 * di].reshape(m, H, dk), eps)
        v = conv[:, 2 * di:].reshape(m, H, dk)
        pre = (L.f_b(fa).float() + L.dt_bias).reshape(m, H, dk)
        if c.gate_lower_bound > -math.inf:   # lower_bound * sigmoid(exp(A_log) * pre), ssm_a = -exp(A_log)
            g = torch.sigmoid(-(pre * L.a)) * c.gate_lower_bound
        else:
            g = F.softplus(pre) * L.a
        beta = torch.sigmoid(b.float())
        o, final, kept = kda.scan(q, k, v, g, beta, state, keep)
        o = rms_norm(o, L.o_norm, eps) * torch.sigmoid(gl.float()).reshape(m, H, dk)
        return L.wo(o.reshape(m, di)), full, final, kept

    # -- the cache ---------------------------------------------------------------------
    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16", rewindable: bool = False) -> KVCache:
        """kda.hybrid_cache: RecurrentStates with `state_horizon` snapshots on the KDA layers,
        LatentKVs on the MLA layers (`rewindable` changes nothing here); decode snapshots
        every length on the torch blocks, every 4th on the native step (kimi-linear's)."""
        stride = 4 if self.native_plan is not None and self.use_native_step and cache_type == "f16" else 1
        return kda.hybrid_cache(self.config, capacity, dtype, cache_type, self.state_horizon, stride)

    def kv_bytes(self, capacity: int, cache_type: str = "f16") -> int:
        return kda.hybrid_cache_bytes(self.config, capacity, cache_type, self.state_horizon)

    def kv_geometry(self) -> tuple[list[int], list[int]]:
        # callers estimate 2 * heads * dim values per position: the latent row and the key row
        c = self.config
        return ([0 if r else 1 for r in c.recurrent],
                [0 if r else (c.kv_lora_rank + c.n_rot) // 2 for r in c.recurrent])

    # -- the native layer step: KDA, MLA, the ffns and the residual bank in one call ---------
    def rope_tables(self, capacity: int = 0) -> list[Rope]:
        """The MLA layers' "rope" dims are not rotated: the plan's table is the identity."""
        if getattr(self, "_still", None) is None:
            self._still = mla.still_rope(self.config.n_rot)
        return [self._still]

    def build_plan(self) -> "kernels.DecoderPlan | None":
        """kimi-linear's plan (kimi_linear.Model.build_plan) with K3's fields (csrc/fk_plan.h
        FK_K3_FIELDS): the lower-bound decay and the full-rank KDA gate, the MLA output gate,
        the latent experts, SiTU, and the residual bank inside the step. None when a layer's
        weights have no native route (the torch blocks serve the model)."""
        c = self.config
        layers = kda.plan_layers(self)
        if layers is None:
            return None
        if c.res_block:
            layers[-1]["out_res_score"] = self.output_score
        return kernels.DecoderPlan.build(
            n_embd=c.n_embd, n_ff=max(c.n_ff, c.n_ff_exp * c.n_expert_shared), n_rot=c.n_rot, neox=False,
            act="situ", eps=c.rms_eps, scale=self.scale, layers=layers)

    def plan_layer(self, i: int, L: Layer) -> dict | None:
        """Layer i's plan fields; None when its KDA projections are not one fused weight or
        the decay's lower bound is not negative (the torch blocks serve the model)."""
        c = self.config
        res = dict(situ_beta=c.situ_beta, situ_lbeta=c.situ_linear_beta, attn_norm=L.attn_norm, ffn_norm=L.ffn_norm)
        if c.res_block:
            res.update(res_bank=int(i % c.res_block == 0), attn_res_score=L.attn_score, ffn_res_score=L.ffn_score)
        if L.kda:
            bounded = c.gate_lower_bound > -math.inf
            if L.w_in is None or (bounded and not c.gate_lower_bound < 0.0):   # the kernel's bound is negative
                return None
            d = dict(mixer="kda", kda_gate=int(bounded), kda_bound=c.gate_lower_bound if bounded else 0.0,
                     n_head=0, n_kv=0, head_dim=0, ssm_hk=c.n_head, ssm_hv=c.n_head, ssm_dk=c.kda_head_dim,
                     ssm_dv=c.kda_head_dim, d_conv=c.d_conv, conv_w=L.conv.reshape(-1), dt_bias=L.dt_bias.reshape(-1),
                     ssm_a=L.a.reshape(-1), ssm_norm=L.o_norm, ssm_f_b=L.f_b, ssm_out=L.wo, ssm_in=L.w_in, **res)
        else:
            d = dict(mla.plan_fields(L.attn, L.k_b, L.v_b), **res)
        if not L.moe:
            ffn = dict(gate_up=L.gate_up) if L.gate_up is not None else dict(gate=L.gate, up=L.up)
            return dict(d, ffn="dense", down=L.down, layer_ff=c.n_ff, **ffn)
        r, ex, store = self.routing, L.experts, moe.store_fields(self, i)
        if store and L.routed_down is not None:   # the step's expert store reads n_embd-wide experts only
            return None
        if L.sh_down is None:
            shared = dict(layer_ff=c.n_ff)
        else:
            shared = dict(gate_up=L.sh_gate_up) if L.sh_gate_up is not None else dict(gate=L.sh_gate, up=L.sh_up)
            shared.update(down=L.sh_down, layer_ff=L.sh_down.in_features)
        return dict(d, ffn="moe", n_expert=r.n_expert, n_expert_used=r.k, n_ff_exp=c.n_ff_exp, moe_norm=int(r.norm),
                    moe_scale=r.scale, moe_sigmoid=int(r.gating == "sigmoid"), exp_probs_b=L.exp_bias,
                    gate_inp=L.router, gate_exps=ex.gate.whole, up_exps=ex.up.whole, down_exps=ex.down.whole,
                    routed_down=L.routed_down, routed_up=L.routed_up, routed_norm=L.routed_norm,
                    **shared, **store)
