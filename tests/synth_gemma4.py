"""Random-weight Gemma 4 GGUFs with the tensor names and keys llama.cpp b11434 reads.

Layer i is global when `pattern[i]` is False (default: every other layer, the last
KV-storing one global); global layers have head_dim, local ones head_dim_swa and
their own rotary width and base (default: half the global head dim from 64 up); the last `shared` layers store no K/V; `ple` > 0 adds
per-layer embeddings; `kv_heads` and `ffn` may be per-layer lists (the E-models).
`experts` > 0 makes every layer a MoE layer (26B-A4B's shape: the dense FFN as shared
expert, `experts` routed ones of `moe_ffn` rows, `experts_used` per token, the fused
gate_up stack when `fused_experts`); router weights of std `router_std` keep a row's
top-k well clear of the rest, so quantization noise does not flip the choice.
The global layers' rope_freqs factors leave the upper half of each head unrotated
(proportional partial rotary, as the converted checkpoints do with 1e30 factors).
Q/K norms are ~0.5: Gemma 4 attends unscaled, and unit norms would make every score
~head_dim-sized, so llama.cpp's f16 rounding of Q in its flash attention alone would
flip near-tied random-weight argmaxes.
"""
from __future__ import annotations

import gguf
import numpy as np

from synth import _byte_vocab, _copy_tokenizer, quantized_adder


def _list(x, n):
    return list(x) if isinstance(x, (list, tuple)) else [x] * n


def write_gemma4(path, *, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads=2, head_dim: int = 32,
                 head_dim_swa: int | None = None, ffn=128, vocab: str | None = None,
                 qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32, window: int = 8,
                 pattern: list[bool] | None = None, shared: int | None = None, ple: int = 32,
                 softcap: float = 30.0, out_scale: bool = True, v_proj: bool = True, seed: int = 0,
                 ctx: int = 2048, chat_template: bool = True, extra: dict | None = None,
                 extra_tensors: dict | None = None, experts: int = 0, experts_used: int = 2, moe_ffn: int = 64,
                 fused_experts: bool = False, router_std: float = 8.0, arch: str = "gemma4") -> str:
    n = layers
    shared = shared if shared is not None else (1 if n >= 3 else 0)
    # alternate, the last KV layer global (llama.cpp's shared layers read the last two)
    pattern = pattern if pattern is not None else [(n - shared - 1 - i) % 2 == 1 for i in range(n)]
    dswa = head_dim_swa or (head_dim // 2 if head_dim >= 64 else head_dim)   # q8_0 rows need 32
    kvh, ffs = _list(kv_heads, n), _list(ffn, n)
    w = gguf.GGUFWriter(str(path), arch)
    n_vocab = _copy_tokenizer(vocab, w) if vocab else _byte_vocab(w, chat_template)
    for key, v in (extra or {}).items():
        (w.add_float32 if isinstance(v, float) else w.add_int32)(key, v)
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(n)
    w.add_feed_forward_length(ffs if len(set(ffs)) > 1 else ffs[0])
    w.add_head_count(heads)
    w.add_head_count_kv(kvh if len(set(kvh)) > 1 else kvh[0])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_key_length_swa(dswa)
    w.add_value_length_swa(dswa)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_dimension_count_swa(dswa)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_freq_base_swa(10_000.0)
    w.add_sliding_window(window)
    w.add_sliding_window_pattern(pattern)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(ple)
    if softcap:
        w.add_final_logit_softcapping(softcap)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(experts_used)
        w.add_expert_feed_forward_length(moe_ffn)

    rng = np.random.default_rng(seed)
    add = quantized_adder(w, qtype)

    def mat(out_f, in_f, scale=None):
        return rng.standard_normal((out_f, in_f), dtype=np.float32) * (scale or 1.0 / np.sqrt(in_f))

    def norm(size):
        return 1.0 + 0.1 * rng.standard_normal(size, dtype=np.float32)

    H = hidden
    add("token_embd.weight", mat(n_vocab, H, 0.05))
    add("output_norm.weight", norm(H))
    rot = head_dim // 4
    add("rope_freqs.weight", np.array([1.0] * rot + [1e30] * (head_dim // 2 - rot), dtype=np.float32))
    if ple:
        add("per_layer_token_embd.weight", mat(n_vocab, ple * n, 0.1))
        add("per_layer_model_proj.weight", mat(ple * n, H))
        add("per_layer_proj_norm.weight", norm(ple))
    first_shared = n - shared
    for i in range(n):
        d = dswa if pattern[i] else head_dim
        q, kv = heads * d, kvh[i] * d
        b = f"blk.{i}."
        add(b + "attn_norm.weight", norm(H))
        add(b + "attn_q.weight", mat(q, H))
        if i < first_shared:
            add(b + "attn_k.weight", mat(kv, H))
            if v_proj:
                add(b + "attn_v.weight", mat(kv, H))
            add(b + "attn_k_norm.weight", 0.5 * norm(d))
        add(b + "attn_q_norm.weight", 0.5 * norm(d))
        add(b + "attn_output.weight", mat(H, q))
        add(b + "post_attention_norm.weight", norm(H))
        add(b + "ffn_norm.weight", norm(H))
        add(b + "ffn_gate.weight", mat(ffs[i], H))
        add(b + "ffn_up.weight", mat(ffs[i], H))
        add(b + "ffn_down.weight", mat(H, ffs[i]))
        add(b + "post_ffw_norm.weight", norm(H))
        if experts:
            add(b + "ffn_gate_inp.weight", mat(experts, H, router_std))
            add(b + "ffn_gate_inp.scale", norm(H))
            for nm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                add(b + nm + ".weight", norm(H))
            gate, up = (np.stack([mat(moe_ffn, H) for _ in range(experts)]) for _ in range(2))
            if fused_experts:
                add(b + "ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1))
            else:
                add(b + "ffn_gate_exps.weight", gate)
                add(b + "ffn_up_exps.weight", up)
            add(b + "ffn_down_exps.weight", np.stack([mat(H, moe_ffn) for _ in range(experts)]))
            add(b + "ffn_down_exps.scale", (0.5 + rng.random(experts)).astype(np.float32))
        if out_scale:
            add(b + "layer_output_scale.weight", np.array([0.5 + rng.random()], dtype=np.float32))
        if ple:
            add(b + "inp_gate.weight", mat(ple, H))
            add(b + "proj.weight", mat(H, ple))
            add(b + "post_norm.weight", norm(H))
    for name, a in (extra_tensors or {}).items():
        add(name, np.asarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
