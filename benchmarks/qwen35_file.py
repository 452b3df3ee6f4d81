#!/usr/bin/env python3
"""Write a random-weight, Qwen3.5-0.8B-shaped qwen35 GGUF (F16) for paired speed runs
(--moe: the qwen35moe twin, Qwen3.5-35B-A3B's ffn in miniature: 32 routed experts of 128
rows, 8 per token, and a gated shared expert of 512 rows in place of the dense ffn).

The shape of Qwen3.5-0.8B: 24 layers (every 4th gated full attention: 8 heads x 256,
2 KV heads, RoPE on 64 dims in sections 11/11/10), DeltaNet layers with 16 key and 16
value heads of 128, conv 4, ffn 3584, n_embd 1024; the Qwen3 vocabulary (151k) from a
vocabulary GGUF. Quantize it with llama-quantize (Q8_0, Q4_K_M) and run
benchmarks/vs_llamacpp.py on the results.

usage: python benchmarks/qwen35_file.py OUT.gguf [--moe] [--vocab vocab-qwen3.gguf]
"""
import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fucina.models import qwen35moe  # noqa: E402
from fucina.models.qwen35 import layer_schema  # noqa: E402
from synth import _copy_tokenizer  # noqa: E402

SHAPE = dict(n_embd=1024, layers=24, interval=4, heads=8, kv_heads=2, head_dim=256, n_rot=64,
             sections=[11, 11, 10, 0], ffn=3584, k_heads=16, v_heads=16, d_state=128, d_conv=4)
MOE = dict(n_expert=32, n_expert_used=8, n_ff_exp=128, n_ff_sh=512)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vocab", default=str(Path(__file__).resolve().parents[2] / "shared/data/vocab/vocab-qwen3.gguf"))
    ap.add_argument("--moe", action="store_true")
    a = ap.parse_args()
    s, arch = SHAPE, "qwen35moe" if a.moe else "qwen35"
    w = gguf.GGUFWriter(a.out, arch)
    n_vocab = _copy_tokenizer(a.vocab, w)
    w.add_name("random-qwen35-0.8b-shape")
    w.add_context_length(4096)
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10_000_000.0)
    w.add_rope_dimension_count(s["n_rot"])
    w.add_array(f"{arch}.rope.dimension_sections", s["sections"])
    d_inner = s["v_heads"] * s["d_state"]
    for key, v in (("full_attention_interval", s["interval"]), ("ssm.conv_kernel", s["d_conv"]),
                   ("ssm.inner_size", d_inner), ("ssm.state_size", s["d_state"]),
                   ("ssm.time_step_rank", s["v_heads"]), ("ssm.group_count", s["k_heads"])):
        w.add_uint32(f"{arch}.{key}", v)
    if a.moe:
        w.add_expert_count(MOE["n_expert"])
        w.add_expert_used_count(MOE["n_expert_used"])
        w.add_expert_feed_forward_length(MOE["n_ff_exp"])
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", MOE["n_ff_sh"])
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    dims = dict(n_embd=s["n_embd"], q_out=q, qg_out=2 * q, kv_out=kv, head_dim=s["head_dim"], n_ff=s["ffn"],
                conv_dim=2 * s["k_heads"] * s["d_state"] + d_inner, d_inner=d_inner, v_heads=s["v_heads"],
                ssm_v_dim=s["d_state"], d_conv=s["d_conv"], n_expert=MOE["n_expert"], n_ff_exp=MOE["n_ff_exp"],
                n_ff_sh=MOE["n_ff_sh"])
    rng = np.random.default_rng(0)

    def mat(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float16)

    w.add_tensor("token_embd.weight", (rng.standard_normal((n_vocab, s["n_embd"]), dtype=np.float32) * 0.5).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(s["n_embd"], np.float32))
    for i in range(s["layers"]):
        recurrent = (i + 1) % s["interval"] != 0
        for t in (qwen35moe.layer_schema(recurrent) if a.moe else layer_schema(recurrent)):
            shape = [dims[d] for d in t.shape]
            if t.role == "norm":
                v = 1.0 + 0.1 * rng.standard_normal(shape[0], dtype=np.float32)
            elif t.role == "bias":
                v = 0.5 * rng.standard_normal(shape[0], dtype=np.float32)
            elif t.role == "decay":
                v = -np.exp(0.5 * rng.standard_normal(shape[0], dtype=np.float32))
            elif t.role == "conv":
                v = 0.5 * rng.standard_normal(shape, dtype=np.float32)
            else:
                v = mat(*shape)
            w.add_tensor(t.gguf_name(i), v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(a.out)


if __name__ == "__main__":
    main()
