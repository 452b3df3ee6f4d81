"""Qwen3-MoE's schema (torch-free): Qwen3's attention, the expert count / width keys and
every layer's router and expert stacks."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile
from fucina.models.schema import llama
from fucina.models.schema.base import LayerSpec, meta_field


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    n_expert: int = meta_field("expert_count")
    n_expert_used: int = meta_field("expert_used_count")
    n_ff_exp: int = meta_field("expert_feed_forward_length", derive=lambda v: v["n_ff"] // v["n_expert_used"])

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        if not 0 < self.n_expert_used <= self.n_expert:
            raise GGUFError(f"{f.path}: {self.n_expert_used} experts used of {self.n_expert}")

    @cached_property
    def routing(self):
        """The router's math (models/moe.py, torch: only a compute reads it)."""
        from fucina.models.moe import Routing
        return Routing(self.n_expert, self.n_expert_used, norm=True)

    def layer_spec(self, i: int) -> LayerSpec:
        s = super().layer_spec(i)
        s.ffn = "moe"
        return s

    def extra_dims(self) -> dict[str, int]:
        return dict(n_expert=self.n_expert, n_ff_exp=self.n_ff_exp)


MOE_TENSORS = (
    llama.T("ffn_gate_inp", "n_expert", "n_embd", role="router"),
    llama.T("ffn_gate_exps", "n_expert", "n_ff_exp", "n_embd"),
    llama.T("ffn_up_exps", "n_expert", "n_ff_exp", "n_embd"),
    llama.T("ffn_down_exps", "n_expert", "n_embd", "n_ff_exp"),
)
ATTENTION = tuple(t for t in llama.TENSORS if t.name == "ffn_norm" or not t.name.startswith("ffn_"))
TENSORS = llama.with_qk_norms(ATTENTION) + MOE_TENSORS


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS
