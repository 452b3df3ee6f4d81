"""A small random-weight gpt-oss for paired speed against llama.cpp: gpt-oss-20b's layout
scaled down (MXFP4 experts, the rest Q8_0, 16 experts of which 4 used, 8 query heads over
2 KV heads of 64, alternating 128-token windows, YaRN), byte vocabulary.
usage: python benchmarks/make_gptoss_bench.py OUT.gguf [--layers 8] [--hidden 512] [--experts 16]
then: python vs_llamacpp.py OUT.gguf (the paired pp/tg script beside the llama.cpp oracle)."""
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synth_common import bench_args  # noqa: E402
from synth_gptoss import write_gptoss  # noqa: E402

a = bench_args("gpt-oss-bench.gguf", layers=8, hidden=512, experts=16)
write_gptoss(a.out, layers=a.layers, hidden=a.hidden, heads=8, kv_heads=2, head_dim=64, window=128,
             experts=a.experts, experts_used=4, moe_ffn=a.hidden, qtype=gguf.GGMLQuantizationType.Q8_0,
             ctx=4096, yarn=(32.0, 4096), seed=1)
