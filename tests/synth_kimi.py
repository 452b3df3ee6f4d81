"""Random-weight kimi-linear GGUFs, with the tensor names, shapes and keys llama.cpp b11434
reads (src/models/kimi-linear.cpp, conversion/kimi_linear.py).

`mla_layers` (0-based) are MLA layers (attention.head_count_kv 1), the others KDA (0), as
the converter writes Kimi-Linear's full_attn_layers; the first `dense_lead` ffns are dense,
the rest `experts` routed experts (`used` per token, sigmoid gating with the selection
bias, renormalised, times `routed_scale`) plus `shared` shared experts. The KDA convs are
written 4-D as the converter does ([1, d_inner, 1, d_conv] numpy order); ssm_a holds
-exp(A_log) < 0; the router is F32 and scaled so its logits spread widely.
`fused_qkv` writes one attn_qkv for the KDA projections.
"""
from __future__ import annotations

import gguf
import numpy as np

from synth import quantized_adder
from synth_common import (begin, dense_ffn, dropping, expert_stack, mla_tensors, random_makers, router,
                          shared_experts, write_out)


def write_kimi(path, *, layers: int = 4, mla_layers=(1, 3), hidden: int = 64, heads: int = 2, kda_dim: int = 32,
               d_conv: int = 4, kv_lora: int = 32, nope: int = 32, rope: int = 8, v_head: int = 32, ffn: int = 128,
               ffn_exp: int = 32, experts: int = 8, used: int = 2, shared: int = 1, dense_lead: int = 1,
               routed_scale: float = 2.5, gating: int = 2, fused_qkv: bool = False, vocab: str | None = None,
               qtype=gguf.GGMLQuantizationType.F32, seed: int = 0, ctx: int = 2048, router_scale: float = 4.0,
               drop: tuple[str, ...] = (), mla_out_scale: float = 1.0, chat_template: bool = True,
               logit_scale: float = 1.0) -> str:
    """`drop`: tensor names left out (a malformed file for the error tests); `mla_out_scale`
    scales the MLA layers' output projections (0 mutes them: the KDA path alone);
    `logit_scale` the output matrix (> 1: peaked next-token distributions)."""
    arch = "kimi-linear"
    w, n_vocab = begin(path, arch, vocab=vocab, ctx=ctx,
                       hidden=hidden, layers=layers, ffn=ffn, heads=heads, chat_template=chat_template)
    w.add_head_count_kv([0 if i not in mla_layers else 1 for i in range(layers)])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    w.add_ssm_conv_kernel(d_conv)
    w.add_kda_head_dim(kda_dim)
    w.add_kv_lora_rank(kv_lora)
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
    w.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))

    rng = np.random.default_rng(seed)
    add = dropping(quantized_adder(w, qtype), drop)
    mat, norm = random_makers(rng)

    di = heads * kda_dim
    add("token_embd.weight", mat(n_vocab, hidden, scale=0.5))
    add("output_norm.weight", norm(hidden))
    add("output.weight", mat(n_vocab, hidden) * logit_scale)
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", norm(hidden))
        if i in mla_layers:
            mla_tensors(add, mat, norm, b, hidden=hidden, heads=heads, q_lora=0, kv_lora=kv_lora, nope=nope,
                        rope=rope, v_head=v_head)
            add(b + "attn_output.weight", mat(hidden, heads * v_head) * mla_out_scale)
        else:
            if fused_qkv:
                add(b + "attn_qkv.weight", mat(3 * di, hidden))
            else:
                for x in "qkv":
                    add(b + f"attn_{x}.weight", mat(di, hidden))
            for x in "qkv":   # the converter's 4-D conv: ggml ne [d_conv, 1, d_inner, 1]
                add(b + f"ssm_conv1d_{x}.weight", mat(1, di, 1, d_conv, scale=0.5), quantize=False)
            add(b + "ssm_f_a.weight", mat(kda_dim, hidden))
            add(b + "ssm_f_b.weight", mat(di, kda_dim))
            add(b + "ssm_beta.weight", mat(heads, hidden))
            # -exp(A_log) and a dt bias that keeps the decays in (0.3, 1) per step
            add(b + "ssm_a", -np.exp(rng.uniform(-2.5, -0.5, heads)).astype(np.float32).reshape(1, 1, heads, 1), quantize=False)
            add(b + "ssm_dt.bias", rng.uniform(-2.0, 0.5, di).astype(np.float32))
            add(b + "ssm_g_a.weight", mat(kda_dim, hidden))
            add(b + "ssm_g_b.weight", mat(di, kda_dim))
            add(b + "ssm_norm.weight", norm(kda_dim))
            add(b + "attn_output.weight", mat(hidden, di))
        add(b + "ffn_norm.weight", norm(hidden))
        if i < dense_lead:
            dense_ffn(add, mat, b, hidden, ffn)
            continue
        router(add, mat, b, experts, hidden, router_scale)
        add(b + "exp_probs_b.bias", 0.3 * rng.standard_normal(experts, dtype=np.float32))
        expert_stack(add, mat, b, experts, ffn_exp, hidden)
        shared_experts(add, mat, b, hidden, ffn_exp * shared)
    return write_out(w, path)
