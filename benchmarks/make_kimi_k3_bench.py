"""A random-weight kimi-k3 of ~0.5B parameters for paired speed against llama.cpp: the
kimi-linear bench's layout (a 3:1 mix of KDA and MLA layers, KDA heads of 128, MLA without
RoPE over a 256-wide latent, one dense layer then routed experts, 4 used, plus one shared,
sigmoid routing) with K3's parts: residual banks every 4 layers, 64 routed experts in a
512-wide latent space, SiTU, the MLA output gate, the full-rank KDA gate and the
lower-bound decay; every matrix Q8_0, byte vocabulary.
usage: python benchmarks/make_kimi_k3_bench.py OUT.gguf [--layers 8] [--hidden 1024] [--experts 64]
then: python vs_llamacpp.py OUT.gguf (the paired pp/tg script beside the llama.cpp oracle)."""
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synth_common import bench_args  # noqa: E402
from synth_kimi_k3 import write_kimi_k3  # noqa: E402

a = bench_args("kimi-k3-bench.gguf", layers=8, hidden=1024, experts=64)
heads = a.hidden // 128
write_kimi_k3(a.out, layers=a.layers, mla_layers=tuple(range(3, a.layers, 4)), hidden=a.hidden, heads=heads,
              kda_dim=128, kv_lora=256, nope=128, rope=64, v_head=128, ffn=a.hidden * 3, ffn_exp=a.hidden // 2,
              experts=a.experts, used=4, shared=1, dense_lead=1, latent=a.hidden // 2, res_block=4,
              qtype=gguf.GGMLQuantizationType.Q8_0, ctx=4096, seed=1)
