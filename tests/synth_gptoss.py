"""Random-weight gpt-oss GGUFs with the tensor names, shapes and keys llama.cpp b11434 reads
(src/models/openai-moe.cpp): biased Q/K/V/output, per-head sinks, the post-attention norm
before the MoE, a biased F32 router, biased expert stacks (MXFP4 by default, as the
published files), alternating 128-token sliding-window and full layers, YaRN RoPE.
"""
from __future__ import annotations

import gguf
import numpy as np

from fucina.models.schema.gpt_oss import TENSORS
from synth import quantized_adder
from synth_common import begin, write_out

MXFP4 = gguf.GGMLQuantizationType.MXFP4


def write_gptoss(path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 16, vocab: str | None = None, qtype=gguf.GGMLQuantizationType.F32,
                 expert_qtype=MXFP4, window: int = 8, seed: int = 0, ctx: int = 2048, experts: int = 8,
                 experts_used: int = 2, moe_ffn: int = 64, router_scale: float = 4.0,
                 yarn: tuple[float, int] | None = (32.0, 256), chat_template: bool = True,
                 swa_pattern: list[bool] | None = None, **_ignored) -> str:
    """`yarn` = (factor, original context) or None (no scaling); `window`: the sliding
    layers' span (128 in the published files; small here so short prompts pass it)."""
    arch = "gpt-oss"
    w, n_vocab = begin(path, arch, vocab=vocab, ctx=ctx,
                       hidden=hidden, layers=layers, ffn=moe_ffn, heads=heads, chat_template=chat_template)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(150000.0)
    w.add_sliding_window(window)
    if swa_pattern is not None:
        w.add_array(f"{arch}.attention.sliding_window_pattern", swa_pattern)
    w.add_expert_count(experts)
    w.add_expert_used_count(experts_used)
    w.add_expert_feed_forward_length(moe_ffn)
    if yarn is not None:
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", yarn[0])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", yarn[1])

    rng = np.random.default_rng(seed)
    add, add_exp = quantized_adder(w, qtype), quantized_adder(w, expert_qtype)
    dims = dict(n_embd=hidden, q_out=heads * head_dim, kv_out=kv_heads * head_dim, v_out=kv_heads * head_dim,
                n_expert=experts, n_ff_exp=moe_ffn, n_head=heads)

    def mat(*shape, scale=None):
        return rng.standard_normal(shape, dtype=np.float32) * (scale if scale is not None else 1.0 / np.sqrt(shape[-1]))

    add("token_embd.weight", mat(n_vocab, hidden, scale=0.5))
    add("output_norm.weight", 1.0 + 0.1 * rng.standard_normal(hidden, dtype=np.float32))
    add("output.weight", mat(n_vocab, hidden))
    for i in range(layers):
        for t in TENSORS:
            shape = [dims[d] for d in t.shape]
            if t.role == "norm":
                add(t.gguf_name(i), 1.0 + 0.1 * rng.standard_normal(shape[0], dtype=np.float32))
            elif t.role in ("bias", "sink"):
                add(t.gguf_name(i), 0.5 * rng.standard_normal(shape, dtype=np.float32), quantize=False)
            elif t.role == "router":   # F32, as the converters keep it; peaked so the top k are clear
                add(t.gguf_name(i), mat(*shape, scale=router_scale / np.sqrt(shape[-1])), quantize=False)
            elif len(shape) == 3:
                add_exp(t.gguf_name(i), mat(*shape))
            else:
                add(t.gguf_name(i), mat(*shape))
    return write_out(w, path)
