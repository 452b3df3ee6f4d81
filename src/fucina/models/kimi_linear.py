"""Kimi-Linear (Kimi-Linear-48B-A3B and its GGUFs on the `kimi-linear` architecture), as
llama.cpp b11434 builds it (src/models/kimi-linear.cpp): a hybrid of KDA layers (linear
attention, models/kda.py) and MLA layers (models/mla.py) without RoPE, each block
    x = x + mixer(rms_norm(x, attn_norm));  x = x + ffn(rms_norm(x, ffn_norm))
with a dense SwiGLU ffn on the first `leading_dense_block_count` layers and a routed MoE
plus shared experts after (models/moe.py: deepseek2's Routing and mix).

- KDA: q, k, v projections, each through its own causal short conv (window d_conv) and
  SiLU; q, k L2-normed per head; the per-channel log-decay g = ssm_a[head] *
  softplus(f_b(f_a x) + dt_bias); beta = sigmoid(ssm_beta x); the delta rule with that
  vector gate; the output RMSNorm(ssm_norm) per head times sigmoid(g_b(g_a x)) -> attn_output.
- MLA: one attn_q [n_head, nope + rope], attn_kv_a_mqa -> latent (RMSNorm'd) + one shared
  key row; the "rope" parts are plain dims (no rotation), so the score is
  q_abs . c + q_pe . k_pe over the latent cache, scaled by 1 / sqrt(nope + rope).

KDA layers keep a `RecurrentState` (the three conv windows side by side, the [H, d, d]
states, snapshots over `state_horizon` lengths), MLA layers a `LatentKV`, so prefix reuse,
Conversation and speculation rewind within the horizon. A step of up to ROWWISE_MAX rows
(a speculative verify, a short turn) runs its KDA layers row by row with decode's exact
ops, so a row's output does not depend on the step it came in; longer prefills run the
chunked scan. The native layer step (`plan_layer`) runs every layer in one call: KDA layers
on the KDA mixer (csrc/fk_kda.cpp: the decay gate, then Gated DeltaNet's rows with a vector
decay and a sigmoid output gate, sequential over the step's rows, snapshots written as it
goes), MLA layers on deepseek2's MLA mixer over an identity rope table, the MoE with its
sigmoid routing and selection bias; the torch blocks stay the reference (FUCINA_NATIVE_STEP=0).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fucina.gguf import GGUFFile
from fucina import kernels
from fucina.models import delta_net, kda, llama, mla, moe
from fucina.models.base import ROWWISE_MAX, Rope, Tensors, layer_tensors, rms_norm
from fucina.models.cache import KVCache
from fucina.models.mla import MLAWeights, NoRope, mla_attention
from fucina.models.moe import Experts, Routing, mix
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.kimi_linear import GATING, KDA, MLA, Config, Schema, layer_schema  # noqa: F401
from fucina.weights import ExpertStack


class Layer(kda.InputParts):
    def __init__(self, tensors: Tensors, i: int, c: Config):
        f = tensors.f
        self.kda, self.moe = c.recurrent[i], i >= c.n_dense_lead
        t = layer_tensors(tensors, i, layer_schema(c, i))
        self.attn_norm, self.ffn_norm = t["attn_norm"], t["ffn_norm"]
        if self.kda:
            d = c.dims()
            di, dk = d["d_inner"], d["kda_dim"]
            qkv = ["attn_qkv"] if t["attn_qkv"] is not None else ["attn_q", "attn_k", "attn_v"]
            if t["attn_qkv"] is not None:
                self.split_qkv = [di, di, di]    # LoRA's q / k / v slices of the file's attn_qkv
            self.set_parts(t, qkv + ["ssm_f_a", "ssm_g_a", "ssm_beta"])
            self.split = [3 * di, dk, dk, c.n_head]
            self.w_in = llama.fuse(f, self.parts)     # one matmul for every projection of x (same types)
            self.conv = torch.cat([t[f"ssm_conv1d_{x}"].dequantize().float().reshape(di, c.d_conv)
                                   for x in "qkv"]).contiguous()             # [3 * d_inner, d_conv]
            self.f_b, self.g_b, self.wo = t["ssm_f_b"], t["ssm_g_b"], t["attn_output"]
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
        self.sh_gate, self.sh_up, self.sh_down = t["ffn_gate_shexp"], t["ffn_up_shexp"], t["ffn_down_shexp"]
        self.sh_gate_up = llama.fuse(f, [self.sh_gate, self.sh_up])

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [m, n_embd] -> [q|k|v, f_a x, g_a x, beta logits]."""
        if self.w_in is not None:
            return list(self.w_in(x).split(self.split, dim=-1))
        out = [w(x) for w in self.parts]
        return [torch.cat(out[:-3], dim=-1)] + out[-3:]


class Model(llama.Model):
    supports_batch = True
    schema = Schema
    state_horizon = 18           # lengths a recurrent state can rewind to: a 16-token draft + carried + base

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        t = self.check_and_embed(f, checked)
        c = self.config
        self.layers = [Layer(t, i, c) for i in range(c.n_layer)]
        self.routing = (Routing(c.n_expert, c.n_expert_used, GATING[c.gating_func], True, c.expert_weights_scale)
                        if c.n_dense_lead < c.n_layer else None)
        self.rope = NoRope()
        self.scale = 1.0 / math.sqrt(c.head_k_mla)
        self.native_plan = self.build_plan()

    # -- the block ---------------------------------------------------------------------
    def block(self, i: int, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        L, eps = self.layers[i], self.config.rms_eps
        h = rms_norm(x, L.attn_norm, eps)
        x = x + (kda.mixer(lambda *a: self._kda(L, *a), h, cache, i, pos0, self.config.d_conv) if L.kda else
                 mla_attention(L.attn, h, cache, i, pos0, self.rope, self.scale, eps))
        return x + self.ffn(i, L, rms_norm(x, L.ffn_norm, eps))

    def ffn(self, i: int, L: Layer, x: torch.Tensor) -> torch.Tensor:
        if not L.moe:
            g, u = L.gate_up(x).chunk(2, dim=-1) if L.gate_up is not None else (L.gate(x), L.up(x))
            return L.down(F.silu(g) * u)
        logits = L.router(x)
        if 1 < x.shape[0] <= ROWWISE_MAX:   # each row alone: a sigmoid over m rows rounds its tail apart
            ids, w = (torch.cat(t) for t in zip(*(self.routing(row, L.exp_bias) for row in logits.split(1))))
        else:
            ids, w = self.routing(logits, L.exp_bias)
        out = mix(x, ids, w, L.experts, F.silu)
        g, u = L.sh_gate_up(x).chunk(2, dim=-1) if L.sh_gate_up is not None else (L.sh_gate(x), L.sh_up(x))
        return out + L.sh_down(F.silu(g) * u)

    def _kda(self, L: Layer, x: torch.Tensor, window: torch.Tensor, state: torch.Tensor, keep: int):
        """m rows through KDA from (window, state): (out [m, n_embd], the padded conv input
        [d_conv - 1 + m, 3 * d_inner], the final state, the last `keep` states)."""
        c, m = self.config, x.shape[0]
        H, dk, eps = c.n_head, c.kda_head_dim, c.rms_eps
        di = H * dk
        qkv, fa, ga, b = L.project(x)
        conv, full = delta_net.causal_conv(qkv.float(), window, L.conv)
        conv = F.silu(conv)
        q = delta_net.l2_norm(conv[:, :di].reshape(m, H, dk), eps)
        k = delta_net.l2_norm(conv[:, di:2 * di].reshape(m, H, dk), eps)
        v = conv[:, 2 * di:].reshape(m, H, dk)
        g = F.softplus(L.f_b(fa).float() + L.dt_bias).reshape(m, H, dk) * L.a
        beta = torch.sigmoid(b.float())
        o, final, kept = kda.scan(q, k, v, g, beta, state, keep)
        gate = torch.sigmoid(L.g_b(ga).float()).reshape(m, H, dk)
        o = rms_norm(o, L.o_norm, eps) * gate
        return L.wo(o.reshape(m, di)), full, final, kept

    # -- the cache ---------------------------------------------------------------------
    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16", rewindable: bool = False) -> KVCache:
        """MLA layers keep every position's latent and key row (f16 or q8_0); KDA layers a
        RecurrentState with `state_horizon` snapshots (`rewindable` changes nothing here),
        one at every length decode reaches too (decode_stride 1): without a native step a
        speculative verify runs one row a step, and any of its lengths may be the rewind.
        On the native step (an f16 cache) every 4th, as qwen35's: a verify's rows all keep
        theirs, and a rewind between two decode lengths re-runs from the one below."""
        stride = 4 if self.native_plan is not None and self.use_native_step and cache_type == "f16" else 1
        return kda.hybrid_cache(self.config, capacity, dtype, cache_type, self.state_horizon, stride)

    def kv_bytes(self, capacity: int, cache_type: str = "f16") -> int:
        return kda.hybrid_cache_bytes(self.config, capacity, cache_type, self.state_horizon)

    def kv_geometry(self) -> tuple[list[int], list[int]]:
        # callers estimate 2 * heads * dim values per position: the latent row and the key row
        c = self.config
        return ([0 if r else 1 for r in c.recurrent],
                [0 if r else (c.kv_lora_rank + c.n_rot) // 2 for r in c.recurrent])

    # -- the native layer step: KDA, MLA and the dense or MoE ffn in one call ----------------
    def rope_tables(self, capacity: int = 0) -> list[Rope]:
        """The MLA layers' "rope" dims are not rotated: the plan's table is the identity
        (cos 1, sin 0 at every position, which rotates each pair to itself exactly)."""
        if getattr(self, "_still", None) is None:
            self._still = mla.still_rope(self.config.n_rot)
        return [self._still]

    def build_plan(self) -> "kernels.DecoderPlan | None":
        c = self.config
        layers = kda.plan_layers(self)
        if layers is None:
            return None
        return kernels.DecoderPlan.build(
            n_embd=c.n_embd, n_ff=max(c.n_ff, c.n_ff_exp * c.n_expert_shared), n_rot=c.n_rot, neox=False,
            act="silu", eps=c.rms_eps, scale=self.scale, layers=layers)

    def plan_layer(self, i: int, L: Layer) -> dict | None:
        """Layer i's plan fields (kernels.DecoderPlan): None when its KDA projections are not
        one fused weight or [attn_qkv, f_a, g_a, beta] (the torch blocks serve the model)."""
        c = self.config
        if L.kda:
            if L.w_in is not None:
                proj = dict(ssm_in=L.w_in)
            elif len(L.parts) == 4:
                proj = dict(ssm_qkv=L.parts[0], ssm_f_a=L.parts[1], ssm_g_a=L.parts[2], ssm_beta=L.parts[3])
            else:
                return None
            d = dict(mixer="kda", kda_gate=0, n_head=0, n_kv=0, head_dim=0, ssm_hk=c.n_head, ssm_hv=c.n_head,
                     ssm_dk=c.kda_head_dim, ssm_dv=c.kda_head_dim, d_conv=c.d_conv, conv_w=L.conv.reshape(-1),
                     dt_bias=L.dt_bias.reshape(-1), ssm_a=L.a.reshape(-1), ssm_norm=L.o_norm, ssm_f_b=L.f_b,
                     ssm_g_b=L.g_b, ssm_out=L.wo, attn_norm=L.attn_norm, ffn_norm=L.ffn_norm, **proj)
        else:
            d = dict(mla.plan_fields(L.attn, L.k_b, L.v_b), attn_norm=L.attn_norm, ffn_norm=L.ffn_norm)
        if not L.moe:
            ffn = dict(gate_up=L.gate_up) if L.gate_up is not None else dict(gate=L.gate, up=L.up)
            return dict(d, ffn="dense", down=L.down, layer_ff=c.n_ff, **ffn)
        r, ex = self.routing, L.experts
        shared = dict(gate_up=L.sh_gate_up) if L.sh_gate_up is not None else dict(gate=L.sh_gate, up=L.sh_up)
        return dict(d, ffn="moe", n_expert=r.n_expert, n_expert_used=r.k, n_ff_exp=c.n_ff_exp, moe_norm=int(r.norm),
                    moe_scale=r.scale, moe_sigmoid=int(r.gating == "sigmoid"), exp_probs_b=L.exp_bias,
                    gate_inp=L.router, gate_exps=ex.gate.whole, up_exps=ex.up.whole, down_exps=ex.down.whole,
                    down=L.sh_down, layer_ff=L.sh_down.in_features, **shared, **moe.store_fields(self, i))
