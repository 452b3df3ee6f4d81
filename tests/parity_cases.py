"""The parity cases shared by the golden maker and the parity tests."""
from __future__ import annotations

import gguf

from synth import write_model

TEXT = ("The history of the city goes back more than two thousand years. In the Middle Ages "
        "it was a busy market town on the river, and merchants came from far away to trade "
        "wool, salt and wine. Today it is known for its old bridges, its university and its ")

LONG_TEXT = " ".join(
    f"Chapter {i}. The traveller walked along the road to the {w} village, counting the "
    f"stones and the trees, and wrote down what each person said about the weather."
    for i, w in zip(range(1, 40), ["northern", "southern", "eastern", "western", "old", "new"] * 7))

TOPK = 10
GREEDY = 32


def qwen3_synth(path, vocab):
    """The small random-weight Qwen3 the project writes itself (Qwen3 vocabulary)."""
    return write_model(path, "qwen3", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64,
                       ffn=256, vocab=str(vocab), qtype=gguf.GGMLQuantizationType.Q8_0, seed=7)


def qwen2_synth(path, vocab, qtype=gguf.GGMLQuantizationType.F32):
    """A random-weight Qwen2 (QKV biases), GQA 2:1 (llama.cpp wants n_embd = heads * head_dim)."""
    return write_model(path, "qwen2", layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64,
                       ffn=256, vocab=str(vocab), qtype=qtype, seed=11)


def phi3_synth(path, vocab, qtype=gguf.GGMLQuantizationType.F32):
    """A random-weight Phi-3 (fused QKV and gate/up) with LongRoPE short/long factors
    (original context 1024 of 2048) and a RoPE attention factor."""
    return write_model(path, "phi3", layers=3, hidden=128, heads=4, kv_heads=4, head_dim=32,
                       ffn=256, vocab=str(vocab), qtype=qtype, seed=13, rope_factors=True,
                       attn_factor=1.19)


def qwen3moe_synth(path, vocab, qtype=gguf.GGMLQuantizationType.F32):
    """A random-weight Qwen3-MoE at Qwen3-30B-A3B's proportions scaled down (16 experts per
    expert used: 32 of which 2; GQA 2:1). Seed 30's routing is well separated on TEXT: the
    k-th and (k+1)-th router logits differ by >= 5e-3 of the logits' spread at every
    position and layer (the spread of reassociation noise is ~1e-6 of it), so both sides
    choose the same experts; test_parity checks that margin on the exact model."""
    return write_model(path, "qwen3moe", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64,
                       ffn=256, experts=32, experts_used=2, moe_ffn=64, vocab=str(vocab), qtype=qtype,
                       seed=30)


# F32 by default: the same arithmetic on both sides, so the goldens' top-1 bound holds on
# random weights (their near-ties flip under int8 activation rounding); the quantized
# files are checked against the exact model instead (test_parity: closer than llama.cpp)
SYNTH = {"qwen3-synth": qwen3_synth, "qwen2-synth": qwen2_synth, "phi3-synth": phi3_synth,
         "qwen3moe-synth": qwen3moe_synth}


# name -> (model source, prompt text, positions scored: "all" or last N)
CASES = {
    "smollm2": ("smollm2", TEXT + LONG_TEXT[:2500], "all"),  # ~590 positions: top-1 needs a sample
    "gemma3": ("gemma3", LONG_TEXT, 96),     # > 512 tokens: crosses the sliding window
    "qwen3-synth": ("qwen3-synth", TEXT, "all"),
    "qwen2-synth": ("qwen2-synth", TEXT, "all"),
    "phi3-synth": ("phi3-synth", TEXT, "all"),
    "qwen3moe-synth": ("qwen3moe-synth", TEXT, "all"),
    "qwen2.5-coder": ("qwen2.5-coder", TEXT + LONG_TEXT[:1500], "all"),
}
