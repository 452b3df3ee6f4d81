"""Tiny random-weight GGUF models written in-process, for unit and parity tests.

`write_model(path, arch, ...)` writes a decoder of any registered family with seeded
random weights; its per-layer tensors are the family's own schema (`Model.schema.tensors`,
the one loading reads), so a new family needs no change here beyond its metadata quirks. The vocabulary is either a small synthetic byte-level one or copied
from a vocab-only GGUF (e.g. a vocab-qwen3.gguf) so llama.cpp can
tokenize with it too.
"""
from __future__ import annotations

import gguf
import numpy as np

from fucina.models.registry import FAMILIES, family

DIFFUSION_ARCHS = ("dream", "llada")   # text diffusion: denoise a canvas, no next-token step
BLOCK_DIFFUSION_ARCHS = ("diffusion-gemma",)   # its own writer: tests/synth_diffusion_gemma.py
ARCHS = tuple(a for a in FAMILIES if a not in DIFFUSION_ARCHS + BLOCK_DIFFUSION_ARCHS)   # the one family list tests parametrize from


def _copy_tokenizer(src: str, w: gguf.GGUFWriter) -> int:
    r = gguf.GGUFReader(src)
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
    return len(r.fields["tokenizer.ggml.tokens"].data)


def byte_tokens() -> dict[int, str]:
    """GPT-2's byte -> token text map (printable bytes as themselves, the rest shifted)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _byte_vocab(w: gguf.GGUFWriter, chat_template: bool = True, mask: bool = False) -> int:
    """A 260-token GPT-2-style vocab: 3 specials, one merged token ("ab"), 256 byte tokens
    (`mask`: a 261st, "<|mask|>", a diffusion model's mask)."""
    byte_tok = byte_tokens()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "ab"] + [byte_tok[b] for b in range(256)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    if mask:
        tokens.append("<|mask|>")
        w.add_mask_token_id(len(tokens) - 1)
    w.add_token_list(tokens)
    special = 4 if mask else 3   # a diffusion vocab's specials are user-defined: detokenized, so compared as text
    w.add_token_types([special] * 3 + [1] * 257 + [special] * mask)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                            "{% endif %}")
    return len(tokens)


def shape_keys(w: gguf.GGUFWriter, arch: str, ctx: int, hidden: int, layers: int, ffn: int, heads: int) -> None:
    """The name and the first shape keys every writer adds, in the order they add them."""
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)


def quantized_adder(w: gguf.GGUFWriter, qtype: gguf.GGMLQuantizationType):
    """add(name, array, quantize=True): matrices in `qtype`, vectors (and quantize=False) F32."""
    def add(name, a, quantize=True):
        a = a.astype(np.float32)
        if not quantize or a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            rows = a.reshape(-1, a.shape[-1])   # an expert stack quantizes as its rows
            try:
                q = gguf.quants.quantize(rows, qtype)
            except NotImplementedError:  # gguf-py lacks the K-quant encoders: use ours
                from fucina.quant import quantize
                q = quantize(rows, int(qtype))
            q = q.reshape(a.shape[:-1] + (-1,))
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    return add


def write_model(path, arch: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, head_dim: int = 16, ffn: int = 128, vocab: str | None = None,
                qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                sliding_window: int = 8, seed: int = 0, tied: bool = True, ctx: int = 2048,
                rope_factors: bool = False, attn_factor: float = 0.0,
                chat_template: bool = True, extra: dict | None = None, experts: int = 8,
                experts_used: int = 2, moe_ffn: int = 32, router_scale: float = 4.0) -> str:
    """`rope_factors` (phi3): LongRoPE short/long factor tensors (original context ctx/2);
    `attn_factor` (phi3): rope.scaling.attn_factor; `chat_template=False` writes a base
    model (no template); `extra` adds metadata (float values as f32, ints as i32), e.g.
    general.sampling.* recommendations. MoE families (a schema with expert stacks):
    `experts` of `moe_ffn` rows, `experts_used` per token, router weights `router_scale`
    times the usual (peaked routing: well-separated top-k choices)."""
    assert arch in ARCHS or arch in DIFFUSION_ARCHS
    if arch == "deepseek2":   # MLA + MoE tensors: its own writer (tests/synth_deepseek2.py)
        from synth_deepseek2 import write_deepseek2
        return write_deepseek2(path, layers=layers, hidden=hidden, heads=heads, vocab=vocab, qtype=qtype,
                               seed=seed, ctx=ctx)
    if arch == "kimi-linear":   # KDA + MLA layers, MoE: its own writer (tests/synth_kimi.py)
        from synth_kimi import write_kimi
        return write_kimi(path, layers=layers, hidden=hidden, vocab=vocab, qtype=qtype, seed=seed, ctx=ctx,
                          chat_template=chat_template)
    if arch == "kimi-k3":   # kimi-linear's layers plus K3's parts: its own writer (tests/synth_kimi_k3.py)
        from synth_kimi_k3 import write_kimi_k3
        return write_kimi_k3(path, layers=layers, hidden=hidden, vocab=vocab, qtype=qtype, seed=seed, ctx=ctx,
                             chat_template=chat_template)
    if arch == "glm4moe":   # dense lead, NextN blocks after the trunk: its own writer
        from synth_glm4moe import write_glm4moe
        return write_glm4moe(path, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                             ffn=ffn, vocab=vocab, qtype=qtype, seed=seed, ctx=ctx, chat_template=chat_template,
                             tied=tied, experts=experts, used=experts_used, ffn_exp=moe_ffn)
    if arch == "gemma4":   # per-layer geometry: its own writer (defaults exercise every feature)
        from synth_gemma4 import write_gemma4
        return write_gemma4(path, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim, ffn=ffn, vocab=vocab, qtype=qtype, window=sliding_window,
                            seed=seed, ctx=ctx, chat_template=chat_template, extra=extra)
    if arch == "deepseek4":   # hyper-connections, compressed KV: its own writer (tests/synth_deepseek4.py)
        from synth_deepseek4 import write_deepseek4
        ratios = tuple(([0, 4, 128, 4] * layers)[:layers]) if layers > 1 else (4,)   # llama.cpp needs a CSA layer
        return write_deepseek4(path, ratios=ratios, hidden=hidden, vocab=vocab, qtype=qtype, seed=seed, ctx=ctx,
                               chat_template=chat_template, experts=experts, used=experts_used)
    if arch == "gpt-oss":   # sinks, biased experts, YaRN: its own writer (tests/synth_gptoss.py)
        from synth_gptoss import write_gptoss
        return write_gptoss(path, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            vocab=vocab, qtype=qtype, window=sliding_window, seed=seed, ctx=ctx,
                            chat_template=chat_template, experts=experts, experts_used=experts_used)
    w = gguf.GGUFWriter(str(path), arch)
    diffusion = arch in DIFFUSION_ARCHS   # text diffusion: a mask token, llama.cpp's logits shift
    n_vocab = _copy_tokenizer(vocab, w) if vocab else _byte_vocab(w, chat_template, mask=diffusion)
    if diffusion:
        w.add_bool("diffusion.shift_logits", arch == "dream")
        w.add_causal_attention(False)
    for key, v in (extra or {}).items():
        (w.add_float32 if isinstance(v, float) else w.add_int32)(key, v)
    shape_keys(w, arch, ctx, hidden, layers, ffn, heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    if arch in ("llama", "phi3", "llada"):
        assert head_dim == hidden // heads
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(10000.0)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(1_000_000.0)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)
    if arch in ("qwen35", "qwen35moe"):    # DeltaNet layers, gated full attention every 2nd; RoPE on half the head
        for key, v in (("full_attention_interval", 2), ("ssm.conv_kernel", 4), ("ssm.inner_size", heads * head_dim),
                       ("ssm.state_size", head_dim), ("ssm.time_step_rank", heads), ("ssm.group_count", kv_heads)):
            w.add_uint32(f"{arch}.{key}", v)
        w.add_rope_dimension_count(head_dim // 2)
        w.add_array(f"{arch}.rope.dimension_sections", [3, 1, 1, 1] if head_dim == 32 else [head_dim // 4 - 2 * (head_dim // 12), head_dim // 12, head_dim // 12, 0])
    if any("n_expert" in t.shape for t in family(arch).Model.schema.tensors):
        w.add_expert_count(experts)
        w.add_expert_used_count(experts_used)
        w.add_expert_feed_forward_length(moe_ffn)
        if arch == "qwen35moe":   # the shared expert: as wide as two routed ones
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", 2 * moe_ffn)
    if rope_factors:
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", ctx // 2)
    if attn_factor:
        w.add_float32(f"{arch}.rope.scaling.attn_factor", attn_factor)

    rng = np.random.default_rng(seed)
    add = quantized_adder(w, qtype)

    def mat(*shape, scale=None):
        s = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return rng.standard_normal(shape, dtype=np.float32) * s

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)

    H, D = hidden, head_dim
    q, kv = heads * D, kv_heads * D
    dims = dict(n_embd=H, q_out=q, kv_out=kv, v_out=kv, qkv_out=q + 2 * kv, n_ff=ffn, gu_out=2 * ffn, head_dim=D,
                qg_out=2 * q, conv_dim=2 * kv + q, d_inner=q, v_heads=heads, ssm_v_dim=D, d_conv=4,
                n_expert=experts, n_ff_exp=moe_ffn, n_ff_sh=2 * moe_ffn, one=1)
    add("token_embd.weight", mat(n_vocab, H, scale=0.5 if arch != "gemma3" else 0.05))
    add("output_norm.weight", norm(H))
    if not tied:
        add("output.weight", mat(n_vocab, H))
    if rope_factors:
        add("rope_factors_short.weight", 1.0 + rng.random(D // 2, dtype=np.float32))
        add("rope_factors_long.weight", 1.0 + 4.0 * rng.random(D // 2, dtype=np.float32))
    for i in range(layers):
        fam = family(arch)
        schema = (fam.layer_schema((i + 1) % 2 != 0, fam.Model.ffn_tensors) if arch in ("qwen35", "qwen35moe")
                  else fam.Model.schema.tensors)
        for t in schema:
            shape = [dims[d] for d in t.shape]
            if t.role == "norm":
                value = norm(shape[0])
            elif t.role == "bias":
                value = 0.5 * rng.standard_normal(shape[0], dtype=np.float32)
            elif t.role == "decay":   # a negative log-decay rate (-exp(A_log))
                value = -np.exp(0.5 * rng.standard_normal(shape[0], dtype=np.float32))
            elif t.role == "conv":    # small f32 conv taps, never quantized (as llama-quantize keeps them)
                value = 0.5 * rng.standard_normal(shape, dtype=np.float32)
            elif t.role == "router":   # kept f32, as llama-quantize keeps ffn_gate_inp
                add(t.gguf_name(i), mat(*shape, scale=router_scale / np.sqrt(shape[-1])), quantize=False)
                continue
            else:
                value = mat(*shape)
            add(t.gguf_name(i), value, quantize=t.role != "conv")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def chunked_logits(model, ids, chunks, native: bool = True, capacity: int = 64):
    """Every position's logits of `ids` fed in chunks of the given sizes (a prefill split
    as a server or a verify step would), on the native step or the torch blocks."""
    import torch
    before = model.use_native_step
    model.use_native_step = native
    try:
        cache, out, pos = model.init_cache(capacity), [], 0
        for n in chunks:
            out.append(model.forward_step_all_logits(cache, ids[pos:pos + n], pos))
            pos += n
        return torch.cat(out)
    finally:
        model.use_native_step = before
