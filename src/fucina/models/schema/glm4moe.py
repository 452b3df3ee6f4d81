"""GLM-4.5's schema (torch-free, llama.cpp b11434 src/models/glm4-moe.cpp): attention with
optional Q/K/V biases and per-head q/k norms, partial NEOX RoPE, `post_attention_norm` as
the ffn's pre-norm, the first `leading_dense_block_count` layers dense, the rest a
sigmoid-routed MoE (selection bias `exp_probs_b`) plus shared experts. The file's
`block_count` includes the `nextn_predict_layers` multi-token-prediction blocks stored
after the trunk (`blk.{n_layer}.nextn.*` beside that block's own layer tensors)."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile
from fucina.models.schema import llama
from fucina.models.schema.base import LayerSpec, Tensors, TensorSpec, meta_field, tensor_dims
from fucina.models.schema import mtp
from fucina.models.schema.mtp import NEXTN  # noqa: F401

GATING = {1: "softmax", 2: "sigmoid"}   # llama_expert_gating_func_type (absent: sigmoid)
T, norm = llama.T, llama.norm


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    n_nextn: int = meta_field("nextn_predict_layers", 0, zero_ok=True)
    n_dense_lead: int = meta_field("leading_dense_block_count", 0, zero_ok=True)
    n_expert: int = meta_field("expert_count")
    n_expert_used: int = meta_field("expert_used_count")
    n_ff_exp: int = meta_field("expert_feed_forward_length", derive=lambda v: v["n_ff"] // v["n_expert_used"])
    n_expert_shared: int = meta_field("expert_shared_count", 0, zero_ok=True)
    expert_weights_scale: float = meta_field("expert_weights_scale", 0.0, kind=float)
    gating_func: int = meta_field("expert_gating_func", 0, zero_ok=True)
    expert_weights_norm: bool = False
    n_block: int = 0          # blocks in the file: the trunk's n_layer plus the NextN blocks

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        self.expert_weights_norm = bool(f.metadata.get(f"{self.arch}.expert_weights_norm", False))
        self.gating_func = self.gating_func or 2
        if self.gating_func not in GATING:
            raise GGUFError(f"{f.path}: expert_gating_func {self.gating_func} is not softmax (1) or sigmoid (2)")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise GGUFError(f"{f.path}: {self.n_expert_used} experts used of {self.n_expert}")
        if not 0 <= self.n_nextn < self.n_layer:
            raise GGUFError(f"{f.path}: nextn_predict_layers {self.n_nextn} leaves no trunk of {self.n_layer} blocks")
        self.n_block, self.n_layer = self.n_layer, self.n_layer - self.n_nextn

    @property
    def routing(self):
        """The router's math (models/moe.py, torch: only a compute reads it)."""
        from fucina.models.moe import Routing
        return Routing(self.n_expert, self.n_expert_used, GATING[self.gating_func], self.expert_weights_norm,
                       self.expert_weights_scale)

    def is_moe(self, i: int) -> bool:
        return i >= self.n_dense_lead

    def layer_spec(self, i: int) -> LayerSpec:
        s = super().layer_spec(i)
        s.ffn = "moe" if self.is_moe(i) else "dense"
        return s

    def extra_dims(self) -> dict[str, int]:
        return dict(n_expert=self.n_expert, n_ff_exp=self.n_ff_exp, n_ff_sh=self.n_ff_exp * self.n_expert_shared)


def bias(name: str, size: str) -> TensorSpec:
    return T(name, size, required=False, role="bias", suffix="bias")


ATTN: tuple[TensorSpec, ...] = (
    norm("attn_norm"),
    T("attn_q", "q_out", "n_embd"), T("attn_k", "kv_out", "n_embd"), T("attn_v", "v_out", "n_embd"),
    bias("attn_q", "q_out"), bias("attn_k", "kv_out"), bias("attn_v", "v_out"),
    T("attn_output", "n_embd", "q_out"),
    norm("attn_q_norm", "head_dim", required=False), norm("attn_k_norm", "head_dim", required=False),
    norm("post_attention_norm"),        # the ffn's pre-norm
)
DENSE = (T("ffn_gate", "n_ff", "n_embd"), T("ffn_up", "n_ff", "n_embd"), T("ffn_down", "n_embd", "n_ff"))
MOE = (
    T("ffn_gate_inp", "n_expert", "n_embd", role="router"),
    TensorSpec("exp_probs_b", ("n_expert",), True, "bias", "bias"),
    T("ffn_gate_exps", "n_expert", "n_ff_exp", "n_embd"), T("ffn_up_exps", "n_expert", "n_ff_exp", "n_embd"),
    T("ffn_down_exps", "n_expert", "n_embd", "n_ff_exp"),
    T("ffn_gate_shexp", "n_ff_sh", "n_embd", required=False), T("ffn_up_shexp", "n_ff_sh", "n_embd", required=False),
    T("ffn_down_shexp", "n_embd", "n_ff_sh", required=False),
)
TENSORS = ATTN + MOE      # a MoE layer's schema (the leading dense layers: ATTN + DENSE)


def layer_schema(c: Config, i: int) -> tuple[TensorSpec, ...]:
    return ATTN + (MOE if c.is_moe(i) else DENSE)


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS

    @classmethod
    def check_layer(cls, t: Tensors, i: int) -> None:
        c = t.config
        got = t.layer(i, layer_schema(c, i), tensor_dims(c))
        shared = [got.get("ffn_gate_shexp"), got.get("ffn_up_shexp"), got.get("ffn_down_shexp")]
        if c.is_moe(i) and c.n_expert_shared and any(s is None for s in shared):
            raise GGUFError(f"{t.f.path}: blk.{i} has {c.n_expert_shared} shared experts but no ffn_*_shexp")

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        """The first NextN block when the file carries it (a trunk-only file may not)."""
        super().check_extras(t)
        c = t.config
        if c.n_nextn and f"blk.{c.n_layer}.nextn.eh_proj.weight" in t.f.tensors:
            cls.check_layer(t, c.n_layer)
            t.layer(c.n_layer, NEXTN, mtp.dims(c))
