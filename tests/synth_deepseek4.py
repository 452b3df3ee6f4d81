"""Random-weight deepseek4 GGUFs with the tensor names, shapes and keys llama.cpp b11434
reads (src/models/deepseek4.cpp load_arch_hparams / load_arch_tensors, conversion/deepseek.py):
four hyper-connection streams (hc_*_fn/base/scale per block, output_hc_* at the head), one
shared K=V row per position (attn_kv) with grouped low-rank output (attn_output_a/b), sinks,
per-layer compress ratios (0: the raw sliding window only; 4: CSA with its overlapping
compressor and the lightning indexer; 128: HCA pooling), sqrt-softplus routing with the
first `hash_layers` layers routed by token id (ffn_gate_tid2eid, I32), shared experts and
the clamped SwiGLU.

The indexer's head size must be a multiple of 64 (llama.cpp rotates its keys with a
Hadamard block of 64 and drops to the raw window without it); `head_dim` differs from it
so the main caches stay unrotated.
"""
from __future__ import annotations

import gguf
import numpy as np

from synth import quantized_adder
from synth_common import begin, dropping, expert_stack, random_makers, router, shared_experts, write_out

MXFP4 = gguf.GGMLQuantizationType.MXFP4


def write_deepseek4(path, *, ratios=(0, 4, 128, 4), hidden: int = 64, heads: int = 4, head_dim: int = 32,
                    rope: int = 16, q_lora: int = 32, o_groups: int = 2, o_lora: int = 16, hc: int = 4,
                    sinkhorn: int = 20, hc_eps: float = 1e-6, window: int = 8, experts: int = 8, used: int = 2,
                    ffn_exp: int = 32, shared: int = 1, hash_layers: int = 1, idx_heads: int = 2,
                    idx_dim: int = 64, top_k: int = 2, clamp: float = 10.0, routed_scale: float = 1.5,
                    norm_topk: bool = True, yarn: tuple[float, int] | None = None, vocab: str | None = None,
                    qtype=gguf.GGMLQuantizationType.F32, expert_qtype=gguf.GGMLQuantizationType.F32,
                    seed: int = 0, ctx: int = 4096, router_scale: float = 4.0, gating: int = 4,
                    extra: dict | None = None, drop: str | tuple = (), chat_template: bool = True) -> str:
    """`ratios`: one compress ratio per layer (its length is the block count); `yarn` =
    (factor, original context) for the compressed layers' RoPE; `drop`: tensor names left out."""
    arch = "deepseek4"
    layers = len(ratios)
    w, n_vocab = begin(path, arch, vocab=vocab, ctx=ctx,
                       hidden=hidden, layers=layers, ffn=ffn_exp, heads=heads, chat_template=chat_template)
    w.add_head_count_kv(1)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(rope)
    w.add_vocab_size(n_vocab)
    w.add_uint32(f"{arch}.attention.q_lora_rank", q_lora)
    w.add_uint32(f"{arch}.attention.sliding_window", window)
    w.add_uint32(f"{arch}.expert_feed_forward_length", ffn_exp)
    w.add_uint32(f"{arch}.expert_count", experts)
    w.add_uint32(f"{arch}.expert_used_count", used)
    w.add_uint32(f"{arch}.expert_shared_count", shared)
    w.add_float32(f"{arch}.expert_weights_scale", routed_scale)
    w.add_bool(f"{arch}.expert_weights_norm", norm_topk)
    w.add_uint32(f"{arch}.expert_gating_func", gating)
    w.add_array(f"{arch}.swiglu_clamp_exp", [float(clamp)] * layers)
    w.add_array(f"{arch}.swiglu_clamp_shexp", [float(clamp)] * layers)
    w.add_uint32(f"{arch}.attention.indexer.head_count", idx_heads)
    w.add_uint32(f"{arch}.attention.indexer.key_length", idx_dim)
    w.add_uint32(f"{arch}.attention.indexer.top_k", top_k)
    w.add_uint32(f"{arch}.attention.output_group_count", o_groups)
    w.add_uint32(f"{arch}.attention.output_lora_rank", o_lora)
    w.add_array(f"{arch}.attention.compress_ratios", [int(r) for r in ratios])
    w.add_float32(f"{arch}.attention.compress_rope_freq_base", 160000.0)
    w.add_uint32(f"{arch}.hyper_connection.count", hc)
    w.add_uint32(f"{arch}.hyper_connection.sinkhorn_iterations", sinkhorn)
    w.add_float32(f"{arch}.hyper_connection.epsilon", hc_eps)
    w.add_uint32(f"{arch}.hash_layer_count", hash_layers)
    w.add_uint32(f"{arch}.embedding_length_out", hidden * hc)
    if yarn is not None:
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", yarn[0])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", yarn[1])
    for k, v in (extra or {}).items():
        w.add_float32(k, v) if isinstance(v, float) else w.add_uint32(k, v)

    rng = np.random.default_rng(seed)
    drop = (drop,) if isinstance(drop, str) else tuple(drop)
    add, add_exp = dropping(quantized_adder(w, qtype), drop), dropping(quantized_adder(w, expert_qtype), drop)
    hc_dim, mix = hc * hidden, (2 + hc) * hc
    mat, norm = random_makers(rng)

    def vec(n, s):
        return s * rng.standard_normal(n, dtype=np.float32)

    add("token_embd.weight", mat(n_vocab, hidden, scale=0.5))
    add("output_norm.weight", norm(hidden))
    add("output.weight", mat(n_vocab, hidden))
    add("output_hc_fn.weight", mat(hc, hc_dim), quantize=False)
    add("output_hc_base.weight", vec(hc, 0.5))
    add("output_hc_scale.weight", vec(1, 0.5) + 1.0)
    for i, ratio in enumerate(ratios):
        b = f"blk.{i}."
        for part in ("attn", "ffn"):
            add(b + f"hc_{part}_fn.weight", mat(mix, hc_dim), quantize=False)
            add(b + f"hc_{part}_base.weight", vec(mix, 0.5))
            add(b + f"hc_{part}_scale.weight", vec(3, 0.3) + 1.0)
        add(b + "attn_norm.weight", norm(hidden))
        add(b + "attn_sinks.weight", vec(heads, 0.5))
        add(b + "attn_q_a.weight", mat(q_lora, hidden))
        add(b + "attn_q_a_norm.weight", norm(q_lora))
        add(b + "attn_q_b.weight", mat(heads * head_dim, q_lora))
        add(b + "attn_kv.weight", mat(head_dim, hidden))
        add(b + "attn_kv_a_norm.weight", norm(head_dim))
        add(b + "attn_output_a.weight", mat(o_lora * o_groups, heads * head_dim // o_groups))
        add(b + "attn_output_b.weight", mat(hidden, o_groups * o_lora))
        if ratio:
            coff = 2 if ratio == 4 else 1
            add(b + "attn_compressor_kv.weight", mat(coff * head_dim, hidden))
            add(b + "attn_compressor_gate.weight", mat(coff * head_dim, hidden))
            add(b + "attn_compressor_ape.weight", mat(ratio, coff * head_dim, scale=0.5), quantize=False)
            add(b + "attn_compressor_norm.weight", norm(head_dim))
            if ratio == 4:
                add(b + "indexer.proj.weight", mat(idx_heads, hidden))
                add(b + "indexer.attn_q_b.weight", mat(idx_heads * idx_dim, q_lora))
                add(b + "indexer_compressor_kv.weight", mat(2 * idx_dim, hidden))
                add(b + "indexer_compressor_gate.weight", mat(2 * idx_dim, hidden))
                add(b + "indexer_compressor_ape.weight", mat(ratio, 2 * idx_dim, scale=0.5), quantize=False)
                add(b + "indexer_compressor_norm.weight", norm(idx_dim))
        add(b + "ffn_norm.weight", norm(hidden))
        router(add, mat, b, experts, hidden, router_scale)
        if i < hash_layers:
            table = np.stack([rng.permutation(experts)[:used] for _ in range(n_vocab)]).astype(np.int32)
            w.add_tensor(b + "ffn_gate_tid2eid.weight", table)
        else:
            add(b + "exp_probs_b.bias", vec(experts, 0.3))
        expert_stack(add_exp, mat, b, experts, ffn_exp, hidden)
        shared_experts(add, mat, b, hidden, ffn_exp * shared)
    return write_out(w, path)
