"""A ~0.6B-class random-weight Gemma 4, F16, Qwen3 vocabulary.
Dense geometry (default): 28 layers, 5 local : 1 global, local head_dim 128 / 4 KV heads,
global 256 / 2, window 512. --e-model: the E2B/E4B shape on the same trunk: per-layer
embeddings of 64 per layer, the last 10 layers sharing KV with double-wide FFNs.
--moe: the 26B-A4B shape on the same trunk: every layer a dense FFN of 768 as shared expert
beside 32 routed experts of 128 rows, 8 per token.
usage: python benchmarks/make_gemma4_bench.py OUT-f16.gguf [--e-model | --moe] [--vocab VOCAB.gguf]; then llama-quantize to Q8_0 / Q4_K_M."""
import argparse, sys, gguf
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'tests'))
from synth_gemma4 import write_gemma4
ap = argparse.ArgumentParser()
ap.add_argument("out", nargs="?", default="gemma4-0.6b-f16.gguf")
ap.add_argument("--e-model", action="store_true")
ap.add_argument("--moe", action="store_true")
ap.add_argument("--vocab", default="vocab-qwen3.gguf", help="a GGUF holding the Qwen3 tokenizer")
a = ap.parse_args()
n, shared = 28, (10 if a.e_model else 0)
pattern = [i % 6 != 5 for i in range(n)]          # 5 local : 1 global, the last layer global
if shared:   # the last KV layer global, the one before it local (the shared layers' sources)
    pattern[n - shared - 1], pattern[n - shared - 2] = False, True
kv = [4 if p else 2 for p in pattern]
ffn = [3072 if i < n - shared else 6144 for i in range(n)]
moe = dict(experts=32, experts_used=8, moe_ffn=128) if a.moe else {}
if a.moe:
    ffn = [768] * n
write_gemma4(a.out, layers=n, hidden=1024, heads=8, kv_heads=kv, head_dim=256,
             head_dim_swa=128, ffn=ffn, window=512, pattern=pattern, shared=shared, ple=64 if a.e_model else 0,
             vocab=a.vocab, qtype=gguf.GGMLQuantizationType.F16, seed=1, **moe)
