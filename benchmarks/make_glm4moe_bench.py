"""A ~0.6B-class random-weight glm4moe for paired speed against llama.cpp: GLM-4.5-Air's layout
scaled down, F16, Qwen3 vocabulary. 16 trunk layers of n_embd 1024 (the first dense, FFN 2816),
8 query heads over 2 KV heads of 128 with Q/K/V biases and q/k norms, NEOX RoPE on the first
64 of each head, 32 routed experts of 256 rows (8 per token, sigmoid routing with the selection
bias, weights normalised and scaled by 2.5) plus one shared expert, and the NextN block after
the trunk (llama.cpp skips it; plain decoding reads none of it).
usage: python benchmarks/make_glm4moe_bench.py OUT-f16.gguf [--layers 16] [--vocab VOCAB.gguf];
then llama-quantize to Q4_K_M / Q8_0 and run vs_llamacpp.py on them (the paired pp/tg script
beside the llama.cpp oracle)."""
import argparse
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synth_glm4moe import write_glm4moe  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out", nargs="?", default="glm4moe-0.6b-f16.gguf")
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--vocab", default="vocab-qwen3.gguf", help="a GGUF holding the Qwen3 tokenizer")
a = ap.parse_args()
write_glm4moe(a.out, layers=a.layers, hidden=1024, heads=8, kv_heads=2, head_dim=128, rot=64, ffn=2816,
              ffn_exp=256, experts=32, used=8, shared=1, dense_lead=1, nextn=1, routed_scale=2.5,
              vocab=a.vocab, qtype=gguf.GGMLQuantizationType.F16, ctx=4096, seed=1)
