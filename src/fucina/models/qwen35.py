"""Qwen3.5 (dense): a hybrid of Gated DeltaNet layers and gated full-attention layers.

Layer i is full attention when (i + 1) % full_attention_interval == 0 (or as the
`attention.recurrent_layers` array says), a DeltaNet layer otherwise. Every block is
    x = x + mixer(rms_norm(x, attn_norm));  x = x + ffn(rms_norm(x, post_attention_norm))
with the dense SiLU ffn. The mixers, as llama.cpp b11434 builds them (src/models/qwen35.cpp):

- gated attention: attn_q gives per head [q | gate]; q/k RMSNorm, multi-section RoPE
  (IMROPE over the first n_rot dims; text positions are (p, p, p, 0), so a pair of the
  fourth section does not rotate), attention, then out * sigmoid(gate) -> attn_output.
- DeltaNet: attn_qkv -> causal conv (ssm_conv1d, window d_conv) -> SiLU -> q, k, v;
  q, k L2-normed; beta = sigmoid(ssm_beta x), g = softplus(ssm_alpha x + ssm_dt) * ssm_a;
  the gated delta rule (models/delta_net.py) over per-head state matrices; the output
  RMSNorm(ssm_norm) * SiLU(attn_gate x) -> ssm_out.

The recurrent layers keep a `RecurrentState` (conv window + state matrices, snapshots
over `state_horizon` positions, inside a multi-row step too), the attention layers a
`KVMemory`; so prefix reuse, Conversation and speculation rewind within the horizon and
fall back to a re-prefill past it (the cache says which through can_truncate).
The native layer plan (kernels.DecoderPlan, csrc/generic/step_impl.inc) runs every layer of a
step in one call: a DeltaNet layer is the mixer kind "delta_net" (csrc/fk_delta.cpp: the
conv, norms and the recurrence over the step's rows, heads in parallel, each head's state
hot over all rows; it writes the kept snapshots as it goes), a gated attention layer the
attention mixer with q_gate. The torch blocks stay the reference (FUCINA_NATIVE_STEP=0):
prefill runs the chunked scan and the last `state_horizon` rows sequentially (their
states are the snapshots), decode one native call per DeltaNet layer.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from fucina import kernels
from fucina.gguf import GGUFFile
from fucina.models import delta_net, llama
from fucina.models.base import Ragged, Rope, Tensors, attend, attn_scale, layer_tensors, rms_norm, rowwise
from fucina.models.cache import KVCache, KVMemory, Q8Cache, RecurrentState, cache_capacity
# the config and tensor schemas (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.qwen35 import (ATTENTION, ATTENTION_MIXER, DELTA_MIXER, DELTA_NET, DENSE_FFN,  # noqa: F401
                                         NORMS, BareSpec, Config, Schema, layer_schema)


def imrope(n_rot: int, base: float, sections: list[int]) -> Rope:
    """NEOX RoPE over n_rot dims with ggml's interleaved multi-section frequencies at text
    positions (p, p, p, 0): pair i is in sector i % sum(sections); sectors of the t/h/w
    sections rotate by p, the others by position 0 (not at all)."""
    rope = Rope(n_rot, base, True)
    total = sum(sections)
    if total:
        s0, s1, s2 = sections[:3]
        keep = []
        for i in range(n_rot // 2):
            s = i % total
            keep.append((s % 3 == 0 and s < 3 * s0) or (s % 3 == 1 and s < 3 * s1) or (s % 3 == 2 and s < 3 * s2))
        rope.inv_freq = rope.inv_freq * torch.tensor(keep, dtype=torch.float64)
    return rope


class Model(llama.Model):
    supports_batch = True
    schema = Schema
    state_horizon = 18           # lengths a recurrent state can rewind to: a 16-token draft + carried + base
    ffn_tensors = DENSE_FFN      # qwen35moe: the routed and shared experts

    def __init__(self, f: GGUFFile, checked: Tensors | None = None):
        t = self.check_and_embed(f, checked)
        c = self.config
        dims = c.dims()
        self.layers = [self._layer(t, i, dims) for i in range(c.n_layer)]
        self.rope = imrope(c.n_rot, c.rope_base, c.rope_sections)
        self.scale = attn_scale(c.head_dim)
        self.native_plan = self.build_plan()

    def _layer(self, t: Tensors, i: int, dims: dict) -> SimpleNamespace:
        f = t.f
        L = SimpleNamespace(**layer_tensors(t, i, layer_schema(self.config.recurrent[i], self.ffn_tensors)))
        self._load_ffn(f, L)
        if self.config.recurrent[i]:
            L.conv = L.ssm_conv1d.dequantize().float().reshape(dims["conv_dim"], dims["d_conv"]).contiguous()
            L.ssm_a, L.ssm_dt_bias, L.ssm_norm = (t.float().contiguous() for t in (L.ssm_a, L.ssm_dt_bias, L.ssm_norm))
            L.split = [dims["conv_dim"], dims["d_inner"], dims["v_heads"], dims["v_heads"]]
            L.w_in = llama.fuse(f, [L.attn_qkv, L.attn_gate, L.ssm_beta, L.ssm_alpha])
        else:
            L.split = [dims["qg_out"], dims["kv_out"], dims["kv_out"]]
            L.w_in = llama.fuse(f, [L.attn_q, L.attn_k, L.attn_v])
        return L

    def _load_ffn(self, f: GGUFFile, L) -> None:
        L.w_gate_up = llama.fuse(f, [L.ffn_gate, L.ffn_up])

    @staticmethod
    def _project(L, x: torch.Tensor, parts: list) -> list[torch.Tensor]:
        if L.w_in is not None:
            return list(L.w_in(x).split(L.split, dim=-1))
        return [w(x) for w in parts]

    # -- the block -------------------------------------------------------------------
    def block(self, i: int, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        L, eps = self.layers[i], self.config.rms_eps
        h = rms_norm(x, L.attn_norm, eps)
        x = x + (self.delta_mixer(i, L, h, cache, pos0) if self.config.recurrent[i]
                 else self.mixer(i, L, h, cache, pos0))
        return x + self.ffn(i, L, rms_norm(x, L.post_attention_norm, eps))

    def ffn(self, i: int, L, x: torch.Tensor) -> torch.Tensor:
        g, u = L.w_gate_up(x).chunk(2, dim=-1) if L.w_gate_up is not None else (L.ffn_gate(x), L.ffn_up(x))
        return L.ffn_down(F.silu(g) * u)

    def mixer(self, i: int, L, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        """Gated full attention of the normed residual x [m, n_embd]."""
        c, m = self.config, x.shape[0]
        qg, k, v = self._project(L, x, [L.attn_q, L.attn_k, L.attn_v])
        qg = qg.reshape(m, c.n_head, 2, c.head_dim)
        q = rms_norm(qg[:, :, 0], L.attn_q_norm, c.rms_eps)
        gate = qg[:, :, 1].reshape(m, c.n_head * c.head_dim)
        k = rms_norm(k.reshape(m, c.n_head_kv, c.head_dim), L.attn_k_norm, c.rms_eps)
        v = v.reshape(m, c.n_head_kv, c.head_dim)
        out = attend(q, k, v, cache, i, pos0, self.rope, self.scale)
        return L.attn_output(out * torch.sigmoid(gate))

    def delta_mixer(self, i: int, L, x: torch.Tensor, cache, pos0: int) -> torch.Tensor:
        """The Gated DeltaNet mixer of x [m, n_embd]; a ragged batch runs row by row (each
        row advances its own state)."""
        if isinstance(cache, Ragged):
            return torch.cat([self.delta_mixer(i, L, x[r:r + 1], c, p)
                              for r, (c, p) in enumerate(zip(cache.caches, cache.pos0s))])
        c, m = self.config, x.shape[0]
        mem = cache.memories[i]
        window, state = mem.span(pos0, pos0)
        qkv, z, b, a = self._project(L, x, [L.attn_qkv, L.attn_gate, L.ssm_beta, L.ssm_alpha])
        if m == 1 and not cache.training and kernels.delta_step_ok():   # decode: one native call, in place
            o = kernels.delta_step(*(t.float().contiguous() for t in (qkv, z, b, a)), window, L.conv,
                                   L.ssm_dt_bias, L.ssm_a, state, L.ssm_norm, c.n_k_heads, c.d_state, c.rms_eps)
            mem.write(pos0, window, state)
            return L.ssm_out(o.view(1, -1))
        if rowwise(m, cache, qkv) and kernels.delta_step_ok():
            # inference: row by row through decode's native call, so a row's output does not
            # depend on the step it came in (the chunked scan's reduction order does: 1.6e-5)
            keep, outs, inner = min(m, mem.horizon), [], []
            qkv, z, b, a = (t.float().contiguous() for t in (qkv, z, b, a))
            for r in range(m):
                outs.append(kernels.delta_step(qkv[r], z[r], b[r], a[r], window, L.conv, L.ssm_dt_bias, L.ssm_a,
                                               state, L.ssm_norm, c.n_k_heads, c.d_state, c.rms_eps))
                if r >= m - keep:
                    inner.append((pos0 + r + 1, window.clone(), state.clone()))
            mem.write(pos0, window, state, inner)
            return L.ssm_out(torch.stack(outs))
        conv, full = delta_net.causal_conv(qkv.float(), window, L.conv)
        conv = F.silu(conv)
        kd = c.n_k_heads * c.d_state
        dv = c.d_inner // c.n_v_heads
        q = delta_net.l2_norm(conv[:, :kd].reshape(m, c.n_k_heads, c.d_state), c.rms_eps)
        k = delta_net.l2_norm(conv[:, kd:2 * kd].reshape(m, c.n_k_heads, c.d_state), c.rms_eps)
        v = conv[:, 2 * kd:].reshape(m, c.n_v_heads, dv)
        q, k = delta_net.expand_heads(q, c.n_v_heads), delta_net.expand_heads(k, c.n_v_heads)
        beta = torch.sigmoid(b.float())
        g = F.softplus(a.float() + L.ssm_dt_bias) * L.ssm_a
        o, final, inner = self.scan(q, k, v, g, beta, state, min(m, mem.horizon))
        tail = m - len(inner)
        d = c.d_conv - 1
        mem.write(pos0, full[m:], final,
                  [(pos0 + t + 1, full[t + 1:t + 1 + d], s) for t, s in zip(range(tail, m), inner)])
        o = rms_norm(o, L.ssm_norm, c.rms_eps) * F.silu(z.float().reshape(m, c.n_v_heads, dv))
        return L.ssm_out(o.reshape(m, c.d_inner))

    @staticmethod
    def scan(q, k, v, g, beta, state, keep: int):
        """The delta rule over m rows: the first m - keep chunked, the last `keep`
        sequentially (their states become snapshots). Returns (o, final state, kept states)."""
        m = q.shape[0]
        head = m - keep
        if head < delta_net.CHUNK // 4:   # a short step: the chunked form would not pay
            return delta_net.sequential(q, k, v, g, beta, state, keep)
        o1, s = delta_net.chunked(q[:head], k[:head], v[:head], g[:head], beta[:head], state)
        if not keep:
            return o1, s, []
        o2, s, kept = delta_net.sequential(q[head:], k[head:], v[head:], g[head:], beta[head:], s, keep)
        return torch.cat([o1, o2]), s, kept

    # -- the cache -------------------------------------------------------------------
    def init_cache(self, capacity: int | None = None, dtype: torch.dtype = torch.float16,
                   cache_type: str = "f16", rewindable: bool = False) -> KVCache:
        """Attention layers keep every position (f16 or q8_0 rows); DeltaNet layers a
        RecurrentState with `state_horizon` snapshots (`rewindable` changes nothing here:
        a state rewinds only within its horizon)."""
        c = self.config
        cap = cache_capacity(capacity, c.n_ctx_train, cache_type)
        mems = [RecurrentState(c.d_conv - 1, c.dims()["conv_dim"], c.n_v_heads, c.d_state,
                               c.d_inner // c.n_v_heads, horizon=self.state_horizon) if r
                else KVMemory(cap, c.n_head_kv, c.head_dim, c.head_dim, cache_type, dtype)
                for r in c.recurrent]
        return (Q8Cache if cache_type == "q8_0" else KVCache).of(mems, cap)

    def kv_bytes(self, capacity: int, cache_type: str = "f16") -> int:
        c = self.config
        per_value = 2.0 if cache_type == "f16" else 34 / 32
        attn = sum(not r for r in c.recurrent) * capacity * c.n_head_kv * 2 * c.head_dim * per_value
        state = (c.d_conv - 1) * c.dims()["conv_dim"] + c.d_inner * c.d_state
        return int(attn + sum(c.recurrent) * state * 4 * (1 + self.state_horizon))

    def kv_geometry(self) -> tuple[list[int], list[int]]:
        c = self.config
        return [0 if r else c.n_head_kv for r in c.recurrent], [0 if r else c.head_dim for r in c.recurrent]

    # -- the native layer step: DeltaNet and gated attention layers in one call ------
    def build_plan(self) -> "kernels.DecoderPlan | None":
        c = self.config
        if c.n_rot % 2 or c.head_dim % 16 or c.n_rot > c.head_dim:
            return None
        return kernels.DecoderPlan.build(
            n_embd=c.n_embd, n_ff=self.plan_ff(), n_rot=c.n_rot, neox=True, act="silu", eps=c.rms_eps,
            scale=self.scale, layers=[self.plan_layer(i, L) for i, L in enumerate(self.layers)])

    def plan_ff(self) -> int:
        """The dense ffn's width in the plan (qwen35moe: its shared expert's)."""
        return self.config.n_ff

    def plan_ffn(self, i: int, L) -> dict:
        """Layer i's ffn fields of the plan (qwen35moe: the routed and shared experts)."""
        return dict(down=L.ffn_down,
                    **(dict(gate_up=L.w_gate_up) if L.w_gate_up is not None else dict(gate=L.ffn_gate, up=L.ffn_up)))

    def plan_layer(self, i: int, L) -> dict:
        c = self.config
        common = dict(attn_norm=L.attn_norm, ffn_norm=L.post_attention_norm, **self.plan_ffn(i, L))
        if not c.recurrent[i]:
            qkv = dict(wqkv=L.w_in) if L.w_in is not None else dict(wq=L.attn_q, wk=L.attn_k, wv=L.attn_v)
            return dict(common, mixer="attention", q_gate=1, n_head=c.n_head, n_kv=c.n_head_kv, head_dim=c.head_dim,
                        q_norm=L.attn_q_norm, k_norm=L.attn_k_norm, wo=L.attn_output, **qkv)
        proj = (dict(ssm_in=L.w_in) if L.w_in is not None else
                dict(ssm_qkv=L.attn_qkv, ssm_z=L.attn_gate, ssm_beta=L.ssm_beta, ssm_alpha=L.ssm_alpha))
        return dict(common, mixer="delta_net", n_head=0, n_kv=0, head_dim=0, ssm_hk=c.n_k_heads, ssm_hv=c.n_v_heads,
                    ssm_dk=c.d_state, ssm_dv=c.d_inner // c.n_v_heads, d_conv=c.d_conv, conv_w=L.conv.reshape(-1),
                    dt_bias=L.ssm_dt_bias, ssm_a=L.ssm_a, ssm_norm=L.ssm_norm, ssm_out=L.ssm_out, **proj)
