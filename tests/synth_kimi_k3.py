"""Random-weight kimi-k3 GGUFs, with the tensor names, shapes and keys llama.cpp b11434
reads (src/models/kimi-k3.cpp).

Layers as tests/synth_kimi.py's kimi-linear (`mla_layers` MLA, the others KDA, the first
`dense_lead` ffns dense), with what K3 changes: one full-rank KDA output gate `ssm_g`, a
1-D ssm_a, the decay gate's lower bound (`gate_lower_bound`, None: kimi-linear's softplus
form), the MLA output gate `attn_gate` (`mla_gate`), SiTU (`situ_beta`,
`situ_linear_beta`) for every ffn, the routed experts in a `latent`-wide space
(ffn_routed_down / _up / _norm; 0: at n_embd), and the cross-layer residual attention
every `res_block` layers (0: none) with its score vectors. `q_lora` > 0 writes the low-rank
query path (attn_q_a, attn_q_a_norm, attn_q_b) instead of attn_q.
"""
from __future__ import annotations

import gguf
import numpy as np

from synth import quantized_adder
from synth_common import (begin, dense_ffn, dropping, expert_stack, mla_tensors, random_makers, router,
                          shared_experts, write_out)


def write_kimi_k3(path, *, layers: int = 4, mla_layers=(1, 3), hidden: int = 64, heads: int = 2, kda_dim: int = 32,
                  d_conv: int = 4, kv_lora: int = 32, nope: int = 32, rope: int = 8, v_head: int = 32,
                  ffn: int = 128, ffn_exp: int = 32, experts: int = 8, used: int = 2, shared: int = 1,
                  dense_lead: int = 1, latent: int = 32, res_block: int = 2, situ_beta: float = 2.0,
                  situ_linear_beta: float = 3.0, gate_lower_bound: float | None = -5.0, mla_gate: bool = True,
                  q_lora: int = 0, routed_norm: bool = True, weights_norm: bool = True, routed_scale: float = 2.5,
                  gating: int = 2, vocab: str | None = None, qtype=gguf.GGMLQuantizationType.F32, seed: int = 0,
                  ctx: int = 2048, router_scale: float = 4.0, drop: tuple[str, ...] = (), chat_template: bool = True,
                  logit_scale: float = 1.0, mla_out_scale: float = 1.0, score_scale: float = 0.3) -> str:
    """`drop`: tensor names left out (a malformed file for the error tests); `mla_out_scale`
    scales the MLA layers' output projections (0 mutes them: llama.cpp needs one MLA layer);
    `logit_scale` the output matrix (> 1: peaked next-token distributions); `score_scale`
    the residual attention's score vectors (larger: peakier mixes)."""
    arch = "kimi-k3"
    w, n_vocab = begin(path, arch, vocab=vocab, ctx=ctx,
                       hidden=hidden, layers=layers, ffn=ffn, heads=heads, chat_template=chat_template)
    w.add_head_count_kv([0 if i not in mla_layers else 1 for i in range(layers)])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    w.add_ssm_conv_kernel(d_conv)
    w.add_kda_head_dim(kda_dim)
    w.add_kv_lora_rank(kv_lora)
    if q_lora:
        w.add_q_lora_rank(q_lora)
    w.add_rope_dimension_count(rope)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v_head)
    w.add_expert_feed_forward_length(ffn_exp)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_expert_shared_count(shared)
    w.add_leading_dense_block_count(dense_lead)
    w.add_expert_weights_scale(routed_scale)
    w.add_expert_weights_norm(weights_norm)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    if latent:
        w.add_uint32(f"{arch}.expert_latent_length", latent)
    w.add_uint32(f"{arch}.attn_res.block_size", res_block)
    w.add_float32(f"{arch}.activation.situ_beta", situ_beta)
    w.add_float32(f"{arch}.activation.situ_linear_beta", situ_linear_beta)
    if gate_lower_bound is not None:
        w.add_float32(f"{arch}.kda.gate_lower_bound", gate_lower_bound)

    rng = np.random.default_rng(seed)
    add = dropping(quantized_adder(w, qtype), drop)
    mat, norm = random_makers(rng)

    def score():   # the residual attention's scores: rms-normed rows dotted with these
        return score_scale * rng.standard_normal(hidden, dtype=np.float32)

    di, lat = heads * kda_dim, latent or hidden
    add("token_embd.weight", mat(n_vocab, hidden, scale=0.5))
    add("output_norm.weight", norm(hidden))
    add("output.weight", mat(n_vocab, hidden) * logit_scale)
    if res_block:
        add("output_res_score.weight", score())
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", norm(hidden))
        if res_block:
            add(b + "attn_res_score.weight", score())
            add(b + "ffn_res_score.weight", score())
        if i in mla_layers:
            mla_tensors(add, mat, norm, b, hidden=hidden, heads=heads, q_lora=q_lora, kv_lora=kv_lora, nope=nope,
                        rope=rope, v_head=v_head)
            if mla_gate:
                add(b + "attn_gate.weight", mat(heads * v_head, hidden))
            add(b + "attn_output.weight", mat(hidden, heads * v_head) * mla_out_scale)
        else:
            for x in "qkv":
                add(b + f"attn_{x}.weight", mat(di, hidden))
            for x in "qkv":   # the converter's 4-D conv: ggml ne [d_conv, 1, d_inner, 1]
                add(b + f"ssm_conv1d_{x}.weight", mat(1, di, 1, d_conv, scale=0.5), quantize=False)
            add(b + "ssm_f_a.weight", mat(kda_dim, hidden))
            add(b + "ssm_f_b.weight", mat(di, kda_dim))
            add(b + "ssm_beta.weight", mat(heads, hidden))
            # -exp(A_log) and a dt bias that keep most decays per step in (0.3, 1): softplus form as
            # tests/synth_kimi.py; the lower-bound form lb * sigmoid(exp(A_log) (f_b f_a x + dt)) needs
            # a negative argument (a state that forgets in a token or two makes KDA's per-head output
            # norm amplify any rounding)
            lb = gate_lower_bound is not None
            a_log = rng.uniform(-0.3, 0.3, heads) if lb else rng.uniform(-2.5, -0.5, heads)
            add(b + "ssm_a", -np.exp(a_log).astype(np.float32), quantize=False)
            add(b + "ssm_dt.bias", rng.uniform(-4.5, -2.0, di).astype(np.float32) if lb
                else rng.uniform(-2.0, 0.5, di).astype(np.float32))
            add(b + "ssm_g.weight", mat(di, hidden))
            add(b + "ssm_norm.weight", norm(kda_dim))
            add(b + "attn_output.weight", mat(hidden, di))
        add(b + "ffn_norm.weight", norm(hidden))
        if i < dense_lead:
            dense_ffn(add, mat, b, hidden, ffn)
            continue
        router(add, mat, b, experts, hidden, router_scale)
        add(b + "exp_probs_b.bias", 0.3 * rng.standard_normal(experts, dtype=np.float32))
        expert_stack(add, mat, b, experts, ffn_exp, lat)
        if latent:
            add(b + "ffn_routed_down.weight", mat(latent, hidden))
            add(b + "ffn_routed_up.weight", mat(hidden, latent))
            if routed_norm:
                add(b + "ffn_routed_norm.weight", norm(latent))
        shared_experts(add, mat, b, hidden, ffn_exp * shared)
    return write_out(w, path)
