"""Tiny random-weight GGUF models written in-process, for unit and parity tests.

`write_model(path, arch, ...)` writes a llama / qwen3 / gemma3 decoder with seeded
random weights. The vocabulary is either a small synthetic byte-level one or copied
from a vocab-only GGUF (e.g. ../shared/data/vocab/vocab-qwen3.gguf) so llama.cpp can
tokenize with it too.
"""
from __future__ import annotations

import gguf
import numpy as np

ARCHS = ("llama", "qwen3", "gemma3")


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


def _byte_vocab(w: gguf.GGUFWriter, chat_template: bool = True) -> int:
    """A 260-token GPT-2-style vocab: 3 specials, one merged token ("ab"), 256 byte tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_tok = dict(zip(bs, (chr(c) for c in cs)))
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "ab"] + [byte_tok[b] for b in range(256)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3, 1] + [1] * 256)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                            "{% endif %}")
    return len(tokens)


def write_model(path, arch: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, head_dim: int = 16, ffn: int = 128, vocab: str | None = None,
                qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                sliding_window: int = 8, seed: int = 0, tied: bool = True, ctx: int = 2048,
                chat_template: bool = True, extra: dict | None = None) -> str:
    """`chat_template=False` writes a base model (no template); `extra` adds metadata
    (float values as f32, ints as i32), e.g. general.sampling.* recommendations."""
    assert arch in ARCHS
    w = gguf.GGUFWriter(str(path), arch)
    n_vocab = _copy_tokenizer(vocab, w) if vocab else _byte_vocab(w, chat_template)
    for key, v in (extra or {}).items():
        (w.add_float32 if isinstance(v, float) else w.add_int32)(key, v)
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        assert head_dim == hidden // heads
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(10000.0)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(1_000_000.0)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)

    rng = np.random.default_rng(seed)

    def add(name, a, quantize=True):
        a = a.astype(np.float32)
        if not quantize or a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            try:
                q = gguf.quants.quantize(a, qtype)
            except NotImplementedError:  # gguf-py lacks the K-quant encoders: use ours
                from fucina.quant import quantize
                q = quantize(a, int(qtype))
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    def mat(out_f, in_f, scale=None):
        s = scale if scale is not None else 1.0 / np.sqrt(in_f)
        return rng.standard_normal((out_f, in_f), dtype=np.float32) * s

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)

    H, D = hidden, head_dim
    add("token_embd.weight", mat(n_vocab, H, 0.5 if arch != "gemma3" else 0.05))
    add("output_norm.weight", norm(H))
    if not tied:
        add("output.weight", mat(n_vocab, H))
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(H))
        add(p + "attn_q.weight", mat(heads * D, H))
        add(p + "attn_k.weight", mat(kv_heads * D, H))
        add(p + "attn_v.weight", mat(kv_heads * D, H))
        add(p + "attn_output.weight", mat(H, heads * D))
        if arch in ("qwen3", "gemma3"):
            add(p + "attn_q_norm.weight", norm(D))
            add(p + "attn_k_norm.weight", norm(D))
        add(p + "ffn_norm.weight", norm(H))
        add(p + "ffn_gate.weight", mat(ffn, H))
        add(p + "ffn_up.weight", mat(ffn, H))
        add(p + "ffn_down.weight", mat(H, ffn))
        if arch == "gemma3":
            add(p + "post_attention_norm.weight", norm(H))
            add(p + "post_ffw_norm.weight", norm(H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
