"""A ~0.6B-class random-weight Gemma 4 (dense geometry: 28 layers, 5 local : 1 global,
local head_dim 128 / 4 KV heads, global 256 / 2, window 512, Qwen3 vocabulary), F16.
usage: python benchmarks/make_gemma4_bench.py OUT-f16.gguf; then llama-quantize to Q8_0 / Q4_K_M."""
import sys, gguf
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'tests'))
from synth_gemma4 import write_gemma4
n = 28
pattern = [i % 6 != 5 for i in range(n)]          # 5 local : 1 global, the last layer global
kv = [4 if p else 2 for p in pattern]
write_gemma4(sys.argv[1] if len(sys.argv) > 1 else 'gemma4-0.6b-f16.gguf', layers=n, hidden=1024, heads=8, kv_heads=kv, head_dim=256,
             head_dim_swa=128, ffn=3072, window=512, pattern=pattern, shared=0, ple=0,
             vocab='/work/shared/data/vocab/vocab-qwen3.gguf', qtype=gguf.GGMLQuantizationType.F16, seed=1)
