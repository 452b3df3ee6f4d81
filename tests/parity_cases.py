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


def qwen35_synth(path, vocab, qtype=gguf.GGMLQuantizationType.F32):
    """A random-weight Qwen3.5 hybrid: DeltaNet layers 0 and 2, gated attention layers 1 and
    3; 4 value heads over 2 key heads; RoPE on half of each head with multi-section
    frequencies (sections 3, 1, 1, 1: two pairs of the fourth section do not rotate)."""
    return write_model(path, "qwen35", layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32,
                       ffn=256, vocab=str(vocab), qtype=qtype, seed=17)


def qwen35moe_synth(path, vocab, qtype=gguf.GGMLQuantizationType.F32):
    """qwen35-synth's hybrid with every ffn 16 routed experts (2 used) of 64 rows plus the
    sigmoid-gated shared expert of 128 rows (peaked routing: the top-k well separated)."""
    return write_model(path, "qwen35moe", layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32,
                       ffn=256, experts=16, experts_used=2, moe_ffn=64, vocab=str(vocab), qtype=qtype, seed=17)


def deepseek2_synth(generation, q_lora, **kw):
    """A random-weight deepseek2 (MLA + MoE: 1 dense layer, then 8 experts, 2 used, 1 shared)
    in one GGUF generation, with (q_lora > 0) or without q-LoRA (tests/synth_deepseek2.py)."""
    def write(path, vocab, qtype=gguf.GGMLQuantizationType.F32):
        from synth_deepseek2 import write_deepseek2
        return write_deepseek2(path, generation=generation, q_lora=q_lora, vocab=str(vocab), qtype=qtype,
                               seed=17, **kw)
    return write


DEEPSEEK2 = {
    "deepseek2-mla-qlora": deepseek2_synth("split", 64),
    "deepseek2-mla-lite": deepseek2_synth("split", 0, gating=2, probs_bias=True, groups=4, group_used=2,
                                          norm_topk=True, routed_scale=2.5),
    "deepseek2-kvb-qlora": deepseek2_synth("kv_b", 64, yarn=(4.0, 0.707, 512)),
    "deepseek2-kvb-lite": deepseek2_synth("kv_b", 0, fused_gate_up=True, router_scale=12.0),
}


def gemma4_synth(path, vocab, qtype=gguf.GGMLQuantizationType.F32):
    """A random-weight Gemma 4 (tests/synth_gemma4.py): per-layer head dims, KV heads and
    FFN widths, two shared-KV layers, per-layer embeddings, a 32-token window."""
    from synth_gemma4 import write_gemma4
    return write_gemma4(path, layers=6, hidden=128, heads=4, kv_heads=[2, 1, 2, 1, 2, 1], head_dim=64,
                        head_dim_swa=32, ffn=[128, 128, 128, 256, 256, 256], window=32, shared=2,
                        vocab=str(vocab), qtype=qtype, seed=17)


def qwen3moe_synth(path, vocab, qtype=gguf.GGMLQuantizationType.F32):
    """A random-weight Qwen3-MoE at Qwen3-30B-A3B's proportions scaled down (16 experts per
    expert used: 32 of which 2; GQA 2:1). Seed 30's routing is well separated on TEXT: the
    k-th and (k+1)-th router logits differ by >= 5e-3 of the logits' spread at every
    position and layer (the spread of reassociation noise is ~1e-6 of it), so both sides
    choose the same experts; test_parity checks that margin on the exact model."""
    return write_model(path, "qwen3moe", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64,
                       ffn=256, experts=32, experts_used=2, moe_ffn=64, vocab=str(vocab), qtype=qtype,
                       seed=30)


def gptoss_synth(path, vocab, qtype=gguf.GGMLQuantizationType.F32, expert_qtype=None):
    """A random-weight gpt-oss (tests/synth_gptoss.py) at gpt-oss-20b's proportions scaled
    down: 8 query heads over 2 KV heads, 16 experts of which 4 used, sinks, biases, YaRN
    (factor 32 over an original 256 positions), the even layers on a 32-token window.
    The experts take `expert_qtype` (the published files: MXFP4), else `qtype`."""
    from synth_gptoss import write_gptoss
    return write_gptoss(path, layers=4, hidden=128, heads=8, kv_heads=2, head_dim=32, window=32, experts=16,
                        experts_used=4, moe_ffn=64, vocab=str(vocab), qtype=qtype,
                        expert_qtype=expert_qtype or qtype, seed=23)


def gptoss_mxfp4_synth(path, vocab, qtype=None):
    """gpt-oss-synth in the published layout: MXFP4 experts (`qtype` is not used: the rest
    stays F32, as quantized attention would flip near-tied random routes on either side)."""
    return gptoss_synth(path, vocab, gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.MXFP4)


# F32 by default: the same arithmetic on both sides, so the goldens' top-1 bound holds on
# random weights (their near-ties flip under int8 activation rounding); the quantized
# files are checked against the exact model instead (test_parity: closer than llama.cpp)
SYNTH = {"qwen3-synth": qwen3_synth, "qwen2-synth": qwen2_synth, "phi3-synth": phi3_synth,
         "qwen35-synth": qwen35_synth, "gemma4-synth": gemma4_synth, "qwen3moe-synth": qwen3moe_synth,
         "qwen35moe-synth": qwen35moe_synth, "gpt-oss-synth": gptoss_synth,
         "gpt-oss-mxfp4-synth": gptoss_mxfp4_synth,
         **DEEPSEEK2}


# name -> (model source, prompt text, positions scored: "all" or last N)
CASES = {
    "smollm2": ("smollm2", TEXT + LONG_TEXT[:2500], "all"),  # ~590 positions: top-1 needs a sample
    "gemma3": ("gemma3", LONG_TEXT, 96),     # > 512 tokens: crosses the sliding window
    "qwen3-synth": ("qwen3-synth", TEXT, "all"),
    "qwen2-synth": ("qwen2-synth", TEXT, "all"),
    "phi3-synth": ("phi3-synth", TEXT, "all"),
    "qwen35-synth": ("qwen35-synth", TEXT + LONG_TEXT[:600], "all"),   # > 64 tokens: chunked scan
    "gemma4-synth": ("gemma4-synth", TEXT + LONG_TEXT[:400], "all"),   # past the 32-token window
    "qwen3moe-synth": ("qwen3moe-synth", TEXT, "all"),
    "qwen35moe-synth": ("qwen35moe-synth", TEXT + LONG_TEXT[:600], "all"),   # > 64 tokens: chunked scan
    "qwen2.5-coder": ("qwen2.5-coder", TEXT + LONG_TEXT[:1500], "all"),
    "gpt-oss-synth": ("gpt-oss-synth", TEXT + LONG_TEXT[:400], "all"),   # past the 32-token window
    **{name: (name, TEXT, "all") for name in DEEPSEEK2},
}
