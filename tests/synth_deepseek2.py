"""Random-weight deepseek2 GGUFs, with the tensor names, shapes and keys llama.cpp b11434
reads (src/models/deepseek2.cpp, conversion/deepseek.py).

`generation="split"` writes what the current converter writes (attn_k_b / attn_v_b,
key_length = kv_lora_rank + rope, value_length = kv_lora_rank, key/value_length_mla,
head_count_kv 1: llama.cpp runs MLA); `"kv_b"` the older files (one attn_kv_b,
key_length = nope + rope, value_length = v: llama.cpp runs plain multi-head attention).
`q_lora=0` writes one attn_q (V2-Lite's shape) with q_lora_rank 0. The router is F32
(as converters keep it) and scaled so its logits spread widely.
"""
from __future__ import annotations

import gguf
import numpy as np

from synth import quantized_adder
from synth_common import begin, dense_ffn, expert_stack, mla_tensors, random_makers, router, shared_experts, write_out


def write_deepseek2(path, *, layers: int = 3, hidden: int = 64, heads: int = 4, q_lora: int = 64,
                    kv_lora: int = 64, nope: int = 32, rope: int = 16, v_head: int = 32, ffn: int = 128,
                    ffn_exp: int = 64, experts: int = 8, used: int = 2, shared: int = 1, dense_lead: int = 1,
                    generation: str = "split", gating: int = 1, probs_bias: bool = False, groups: int = 0,
                    group_used: int = 0, norm_topk: bool = False, routed_scale: float = 0.0,
                    yarn: tuple[float, float, int] | None = None, fused_gate_up: bool = False,
                    vocab: str | None = None, qtype=gguf.GGMLQuantizationType.F32, seed: int = 0,
                    ctx: int = 2048, router_scale: float = 4.0, **_ignored) -> str:
    """`yarn` = (factor, mscale_all_dim, original context); `gating` 1 softmax, 2 sigmoid."""
    assert generation in ("split", "kv_b")
    arch = "deepseek2"
    w, n_vocab = begin(path, arch, vocab=vocab, ctx=ctx,
                       hidden=hidden, layers=layers, ffn=ffn, heads=heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(rope)
    w.add_leading_dense_block_count(dense_lead)
    w.add_vocab_size(n_vocab)
    w.add_q_lora_rank(q_lora)
    w.add_kv_lora_rank(kv_lora)
    if generation == "split":
        w.add_head_count_kv(1)
        w.add_key_length(kv_lora + rope)
        w.add_value_length(kv_lora)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v_head)
    else:
        w.add_head_count_kv(heads)
        w.add_key_length(nope + rope)
        w.add_value_length(v_head)
    w.add_expert_feed_forward_length(ffn_exp)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_expert_shared_count(shared)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    if groups:
        w.add_expert_group_count(groups)
        w.add_expert_group_used_count(group_used)
    if routed_scale:
        w.add_expert_weights_scale(routed_scale)
    if norm_topk:
        w.add_expert_weights_norm(True)
    if yarn:
        factor, mscale_all, orig = yarn
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all)

    rng = np.random.default_rng(seed)
    add = quantized_adder(w, qtype)
    mat, norm = random_makers(rng)

    add("token_embd.weight", mat(n_vocab, hidden, scale=0.5))
    add("output_norm.weight", norm(hidden))
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", norm(hidden))
        mla_tensors(add, mat, norm, b, hidden=hidden, heads=heads, q_lora=q_lora, kv_lora=kv_lora, nope=nope,
                    rope=rope, v_head=v_head, split=generation == "split")
        add(b + "attn_output.weight", mat(hidden, heads * v_head))
        add(b + "ffn_norm.weight", norm(hidden))
        if i < dense_lead:
            dense_ffn(add, mat, b, hidden, ffn)
            continue
        router(add, mat, b, experts, hidden, router_scale)
        if probs_bias:
            add(b + "exp_probs_b.bias", 0.3 * rng.standard_normal(experts, dtype=np.float32))
        expert_stack(add, mat, b, experts, ffn_exp, hidden, fused_gate_up)
        if shared:
            shared_experts(add, mat, b, hidden, ffn_exp * shared)
    return write_out(w, path)
