"""gpt-oss's schema (torch-free): OpenAI's open-weight MoE (llama.cpp's `gpt-oss`
architecture). Q/K/V and output projections with biases, one learned attention sink per
head, sliding-window layers (128 tokens) alternating with full ones from layer 0, YaRN
RoPE (NEOX), and every ffn a routed mixture of experts with a biased router and biased
expert projections (the experts in MXFP4 in the published files)."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile, meta_float_opt
from fucina.models.schema import llama
from fucina.models.schema.base import LayerSpec, meta_field
from fucina.models.schema.mla import YarnParams


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    n_expert: int = meta_field("expert_count")
    n_expert_used: int = meta_field("expert_used_count")
    n_ff_exp: int = meta_field("expert_feed_forward_length", derive=lambda v: v["n_ff"])
    sliding_window: int = meta_field("attention.sliding_window", 128)
    rope_base_swa: float = meta_field("rope.freq_base_swa", 0.0, kind=float)   # 0: the global base
    swa_pattern: object = None
    yarn: YarnParams | None = None

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        m, a = f.metadata, self.arch
        if not 0 < self.n_expert_used <= self.n_expert:
            raise GGUFError(f"{f.path}: {self.n_expert_used} experts used of {self.n_expert}")
        self.swa_pattern = m.get(f"{a}.attention.sliding_window_pattern")
        kind = m.get(f"{a}.rope.scaling.type", "none")
        factor = meta_float_opt(m, a, "rope.scaling.factor") or 0.0
        if kind not in ("none", "yarn", "linear"):
            raise GGUFError(f"{f.path}: rope.scaling.type {kind!r} is not supported for gpt-oss (yarn, linear, none)")
        self.rope_scale = 1.0   # the YaRN parameters carry the scaling
        orig = m.get(f"{a}.rope.scaling.original_context_length") or self.n_ctx_train
        self.yarn = YarnParams(freq_scale=1.0 / factor if factor and kind != "none" else 1.0,
                               ext_factor=1.0 if kind == "yarn" else 0.0,
                               attn_factor=meta_float_opt(m, a, "rope.scaling.attn_factor") or 1.0,
                               beta_fast=meta_float_opt(m, a, "rope.scaling.yarn_beta_fast") or 32.0,
                               beta_slow=meta_float_opt(m, a, "rope.scaling.yarn_beta_slow") or 1.0,
                               n_ctx_orig=int(orig))

    def is_local(self, i: int) -> bool:
        """llama.cpp's pattern for this architecture: an array of flags, or every n-th layer
        full (n = 2: layers 0, 2, 4, ... slide)."""
        p = self.swa_pattern
        if self.sliding_window == 0:
            return False
        if isinstance(p, (list, tuple)) or hasattr(p, "tolist"):
            p = list(p.tolist() if hasattr(p, "tolist") else p)
            return i < len(p) and bool(p[i])
        n = int(p) if p else 2
        return n == 0 or i % n < n - 1

    def layer_spec(self, i: int) -> LayerSpec:
        s = super().layer_spec(i)
        s.ffn = "moe"
        if self.is_local(i):
            s.window, s.rope = self.sliding_window, 1
        return s

    def extra_dims(self) -> dict[str, int]:
        return dict(n_expert=self.n_expert, n_ff_exp=self.n_ff_exp, n_head=self.n_head)


def bias(name: str, *shape: str) -> llama.TensorSpec:
    return llama.T(name, *shape, role="bias", suffix="bias")


ATTENTION = (
    llama.norm("attn_norm"),
    llama.T("attn_q", "q_out", "n_embd"), llama.T("attn_k", "kv_out", "n_embd"), llama.T("attn_v", "v_out", "n_embd"),
    bias("attn_q", "q_out"), bias("attn_k", "kv_out"), bias("attn_v", "v_out"),
    llama.T("attn_output", "n_embd", "q_out"), bias("attn_output", "n_embd"),
    llama.T("attn_sinks", "n_head", role="sink"),
)
MOE_TENSORS = (
    llama.norm("post_attention_norm"),
    llama.T("ffn_gate_inp", "n_expert", "n_embd", role="router"), bias("ffn_gate_inp", "n_expert"),
    llama.T("ffn_gate_exps", "n_expert", "n_ff_exp", "n_embd"), bias("ffn_gate_exps", "n_expert", "n_ff_exp"),
    llama.T("ffn_up_exps", "n_expert", "n_ff_exp", "n_embd"), bias("ffn_up_exps", "n_expert", "n_ff_exp"),
    llama.T("ffn_down_exps", "n_expert", "n_embd", "n_ff_exp"), bias("ffn_down_exps", "n_expert", "n_embd"),
)
TENSORS = ATTENTION + MOE_TENSORS


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS

    @classmethod
    def check_globals(cls, t) -> None:
        super().check_globals(t)
        c = t.config
        t.want("output.weight", (c.n_vocab, c.n_embd))   # llama.cpp requires the head (never tied)
