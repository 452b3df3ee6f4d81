"""Qwen3.5-MoE's schema (torch-free): qwen35's hybrid with qwen3moe's experts and routing
keys, plus the shared expert's width and tensors."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.models.schema import llama, qwen3moe, qwen35
from fucina.models.schema.base import meta_field

T = llama.T


@dataclass
class Config(qwen35.Config, qwen3moe.Config):
    """qwen35's hybrid settings and qwen3moe's experts and routing (its finish checks them),
    plus the shared expert's width."""
    n_ff_shexp: int = meta_field("expert_shared_feed_forward_length", derive=lambda v: v["n_ff"])

    def dims(self) -> dict[str, int]:
        return dict(super().dims(), n_expert=self.n_expert, n_ff_exp=self.n_ff_exp, n_ff_sh=self.n_ff_shexp)


# the router stays f32 (llama-quantize keeps ffn_gate_inp); the shared gate is one row [n_embd]
MOE_FFN = (T("ffn_gate_inp", "n_expert", "n_embd", role="router"),
           T("ffn_gate_exps", "n_expert", "n_ff_exp", "n_embd"), T("ffn_up_exps", "n_expert", "n_ff_exp", "n_embd"),
           T("ffn_down_exps", "n_expert", "n_embd", "n_ff_exp"),
           T("ffn_gate_inp_shexp", "n_embd", role="bias"),
           T("ffn_gate_shexp", "n_ff_sh", "n_embd"), T("ffn_up_shexp", "n_ff_sh", "n_embd"),
           T("ffn_down_shexp", "n_embd", "n_ff_sh"))


def layer_schema(recurrent: bool, ffn=MOE_FFN):
    return qwen35.layer_schema(recurrent, ffn)


class Schema(qwen35.Schema):
    config_class = Config
    ffn_tensors = MOE_FFN
    tensors = qwen35.layer_schema(False, MOE_FFN)
