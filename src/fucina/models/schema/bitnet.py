"""BitNet b1.58's schema (torch-free): llama's layer plus two sub-norms (on the attention
output before its projection, and on act(gate) * up before the down projection), optional
per-matrix output scales, NEOX RoPE, the head tied to the embeddings."""
from __future__ import annotations

import os
from dataclasses import dataclass

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile
from fucina.models.schema import llama

#: the ffn activations the family knows: SiLU (llama.cpp's graph for every bitnet file) and
#: squared ReLU (BitNet-b1.58-2B-4T's config: hidden_act = relu2)
ACTS = ("silu", "relu2")


def pick_act(name: str) -> str:
    """The ffn activation: FUCINA_BITNET_ACT when set; else relu2 for a file that names
    BitNet-b1.58-2B-4T (its config says relu2; the GGUF carries no activation key), silu
    for the rest (the 1bitLLM b1.58 models the architecture was written for use SiLU, and
    so does llama.cpp's graph for every bitnet file)."""
    env = os.environ.get("FUCINA_BITNET_ACT", "").strip().lower()
    if env:
        if env not in ACTS:
            raise GGUFError(f"FUCINA_BITNET_ACT={env!r}: expected one of {', '.join(ACTS)}")
        return env
    flat = name.lower().replace("_", "-").replace(" ", "-")
    return "relu2" if "2b-4t" in flat else "silu"


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    ffn_act: str = "silu"

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        names = [str(f.metadata.get(k, "")) for k in ("general.name", "general.basename", "general.finetune")]
        self.ffn_act = pick_act(" ".join(names))

    def extra_dims(self) -> dict[str, int]:
        return {**super().extra_dims(), "one": 1}


def scale(name: str) -> llama.TensorSpec:
    """`blk.N.<name>.scale`: one f32 multiplying the matrix's output (optional)."""
    return llama.T(name, "one", required=False, role="norm", suffix="scale")


TENSORS = (
    llama.norm("attn_norm"),
    llama.T("attn_q", "q_out", "n_embd"), llama.T("attn_k", "kv_out", "n_embd"), llama.T("attn_v", "v_out", "n_embd"),
    llama.norm("attn_sub_norm", "q_out"),
    llama.T("attn_output", "n_embd", "q_out"),
    llama.norm("ffn_norm"),
    llama.T("ffn_gate", "n_ff", "n_embd"), llama.T("ffn_up", "n_ff", "n_embd"),
    llama.norm("ffn_sub_norm", "n_ff"),
    llama.T("ffn_down", "n_embd", "n_ff"),
    *(scale(n) for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")),
)


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS
