"""Random-weight glm4moe GGUFs with the tensor names, shapes and keys llama.cpp b11434
reads (src/models/glm4-moe.cpp): `layers` trunk blocks (the first `dense_lead` dense),
then `nextn` NextN blocks (a MoE layer plus blk.{i}.nextn.*), block_count counting both.
Partial NEOX RoPE (`rot` of head_dim), Q/K/V biases, optional q/k norms, sigmoid routing
with the selection bias, shared experts; the router is F32 (as converters keep it)."""
from __future__ import annotations

import gguf
import numpy as np

from synth import _byte_vocab, _copy_tokenizer, quantized_adder


def write_glm4moe(path, *, layers: int = 3, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                  head_dim: int = 16, rot: int | None = None, ffn: int = 128, ffn_exp: int = 32,
                  experts: int = 8, used: int = 2, shared: int = 1, dense_lead: int = 1, nextn: int = 1,
                  qk_norm: bool = True, biases: bool = True, norm_topk: bool = True, routed_scale: float = 2.5,
                  vocab: str | None = None, qtype=gguf.GGMLQuantizationType.F32, seed: int = 0, ctx: int = 2048,
                  router_scale: float = 4.0, chat_template: bool = True, tied: bool = True,
                  nextn_extras: bool = False, **_ignored) -> str:
    arch = "glm4moe"
    rot = rot if rot is not None else head_dim // 2
    w = gguf.GGUFWriter(str(path), arch)
    n_vocab = _copy_tokenizer(vocab, w) if vocab else _byte_vocab(w, chat_template)
    w.add_name("synthetic-glm4moe")
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(layers + nextn)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_dimension_count(rot)
    w.add_leading_dense_block_count(dense_lead)
    w.add_vocab_size(n_vocab)
    w.add_expert_feed_forward_length(ffn_exp)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_expert_shared_count(shared)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_norm(norm_topk)
    if routed_scale:
        w.add_expert_weights_scale(routed_scale)
    if nextn:
        w.add_uint32(f"{arch}.nextn_predict_layers", nextn)

    rng = np.random.default_rng(seed)
    add = quantized_adder(w, qtype)

    def mat(*shape, scale=None):
        return rng.standard_normal(shape, dtype=np.float32) * (scale if scale is not None else 1.0 / np.sqrt(shape[-1]))

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)

    q, kv = heads * head_dim, kv_heads * head_dim
    add("token_embd.weight", mat(n_vocab, hidden, scale=0.5))
    add("output_norm.weight", norm(hidden))
    if not tied:
        add("output.weight", mat(n_vocab, hidden))
    for i in range(layers + nextn):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", norm(hidden))
        add(b + "attn_q.weight", mat(q, hidden))
        add(b + "attn_k.weight", mat(kv, hidden))
        add(b + "attn_v.weight", mat(kv, hidden))
        if biases:
            for n, size in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                add(b + n + ".bias", 0.5 * rng.standard_normal(size, dtype=np.float32))
        add(b + "attn_output.weight", mat(hidden, q))
        if qk_norm:
            add(b + "attn_q_norm.weight", norm(head_dim))
            add(b + "attn_k_norm.weight", norm(head_dim))
        add(b + "post_attention_norm.weight", norm(hidden))
        if i < dense_lead:
            add(b + "ffn_gate.weight", mat(ffn, hidden))
            add(b + "ffn_up.weight", mat(ffn, hidden))
            add(b + "ffn_down.weight", mat(hidden, ffn))
        else:
            add(b + "ffn_gate_inp.weight", mat(experts, hidden, scale=router_scale / np.sqrt(hidden)), quantize=False)
            add(b + "exp_probs_b.bias", 0.3 * rng.standard_normal(experts, dtype=np.float32))
            add(b + "ffn_gate_exps.weight", mat(experts, ffn_exp, hidden))
            add(b + "ffn_up_exps.weight", mat(experts, ffn_exp, hidden))
            add(b + "ffn_down_exps.weight", mat(experts, hidden, ffn_exp))
            if shared:
                add(b + "ffn_gate_shexp.weight", mat(ffn_exp * shared, hidden))
                add(b + "ffn_up_shexp.weight", mat(ffn_exp * shared, hidden))
                add(b + "ffn_down_shexp.weight", mat(hidden, ffn_exp * shared))
        if i >= layers:
            add(b + "nextn.eh_proj.weight", mat(hidden, 2 * hidden))
            add(b + "nextn.enorm.weight", norm(hidden))
            add(b + "nextn.hnorm.weight", norm(hidden))
            if nextn_extras:
                add(b + "nextn.shared_head_norm.weight", norm(hidden))
                add(b + "nextn.shared_head_head.weight", mat(n_vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
