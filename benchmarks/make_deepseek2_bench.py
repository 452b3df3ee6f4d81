"""A ~0.6B-class random-weight deepseek2 for paired speed against llama.cpp: DeepSeek-V2-Lite's
layout scaled down, F16, Qwen3 vocabulary. 12 layers of n_embd 1024 (the first dense, FFN 2816),
MLA with 8 heads (one attn_q, V2-Lite's shape), a KV latent of 512 and a rope key of 64, nope
128, value 128 (the current converter's attn_k_b / attn_v_b), YaRN; 32 routed experts of 256
rows, 6 per token, softmax routing, plus 2 shared experts.
usage: python benchmarks/make_deepseek2_bench.py OUT-f16.gguf [--layers 12] [--vocab VOCAB.gguf];
then llama-quantize to Q4_K_M / Q8_0 and run vs_llamacpp.py on them."""
import argparse
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synth_deepseek2 import write_deepseek2  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out", nargs="?", default="deepseek2-0.6b-f16.gguf")
ap.add_argument("--layers", type=int, default=12)
ap.add_argument("--vocab", default="vocab-qwen3.gguf", help="a GGUF holding the Qwen3 tokenizer")
a = ap.parse_args()
write_deepseek2(a.out, layers=a.layers, hidden=1024, heads=8, q_lora=0, kv_lora=512, nope=128, rope=64, v_head=128,
                ffn=2816, ffn_exp=256, experts=32, used=6, shared=2, dense_lead=1, yarn=(40.0, 1.0, 4096),
                vocab=a.vocab, qtype=gguf.GGMLQuantizationType.F16, ctx=16384, seed=1)
