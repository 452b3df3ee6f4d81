"""A ~0.5B random-weight deepseek4 for paired speed against llama.cpp: DeepSeek-V4's layout
scaled down (MXFP4 experts, the rest Q8_0; 16 layers: two raw sliding-window layers, then
CSA and HCA alternating; 16 experts of which 4 used plus one shared, the first 3 layers
hash-routed; 8 heads of 128 with 64 RoPE dims, q rank 256, 4 output groups of rank 256;
an indexer of 4 heads of 64 keeping 512 blocks (llama.cpp b11434 stops with SIGFPE when the
indexer key length equals the head size, or without a CSA layer); a 128-token window), byte vocabulary.
usage: python benchmarks/make_deepseek4_bench.py OUT.gguf [--layers 16] [--hidden 1024] [--experts 16]
then: python vs_llamacpp.py OUT.gguf (the paired pp/tg script beside the llama.cpp oracle)."""
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synth_common import bench_args  # noqa: E402
from synth_deepseek4 import write_deepseek4  # noqa: E402

a = bench_args("deepseek4-bench.gguf", layers=16, hidden=1024, experts=16)
ratios = ([0, 0] + [4, 128] * a.layers)[:a.layers]
write_deepseek4(a.out, ratios=ratios, hidden=a.hidden, heads=8, head_dim=128, rope=64, q_lora=256, o_groups=4,
                o_lora=256, window=128, experts=a.experts, used=4, ffn_exp=a.hidden // 2, shared=1, hash_layers=3,
                idx_heads=4, idx_dim=64, top_k=512, qtype=gguf.GGMLQuantizationType.Q8_0,
                expert_qtype=gguf.GGMLQuantizationType.MXFP4, seed=1)
