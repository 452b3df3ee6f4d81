"""Qwen3.5-MoE (Qwen3.5-35B-A3B and up): qwen35's hybrid of Gated DeltaNet and gated
attention layers (models/qwen35.py) with every ffn a routed mixture of SwiGLU experts plus
one shared expert, as llama.cpp b11434 builds it (src/models/qwen35moe.cpp):
    ffn(x) = mix(x; softmax top-k, weights renormalised) + sigmoid(x . gate_inp_shexp) * shexp(x)
with the shared expert a dense SwiGLU of `expert_shared_feed_forward_length` rows. The
routed math is models/moe.py (qwen3moe's); the blocks run in torch (the native step's MoE
ffn has no shared expert yet), the DeltaNet decode recurrence natively per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fucina.gguf import GGUFFile
from fucina.models import llama, moe, qwen3moe, qwen35
from fucina.models.base import meta_field

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


class Model(qwen35.Model):
    config_class = Config
    ffn_tensors = MOE_FFN
    tensors = qwen35.layer_schema(False, MOE_FFN)

    def _load_ffn(self, f: GGUFFile, L) -> None:
        L.experts = moe.Experts(L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps)
        L.w_shared = llama.fuse(f, [L.ffn_gate_shexp, L.ffn_up_shexp])

    def ffn(self, i: int, L, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.config.routing(L.ffn_gate_inp(x))
        routed = moe.mix(x, ids, weights, L.experts, F.silu)
        g, u = (L.w_shared(x).chunk(2, dim=-1) if L.w_shared is not None
                else (L.ffn_gate_shexp(x), L.ffn_up_shexp(x)))
        shared = L.ffn_down_shexp(F.silu(g) * u)
        return routed + shared * torch.sigmoid(x.float() @ L.ffn_gate_inp_shexp)[..., None]

    def build_plan(self) -> None:
        return None   # the native MoE ffn (csrc/generic/moe_impl.inc) has no shared expert yet


def layer_schema(recurrent: bool, ffn=MOE_FFN):
    return qwen35.layer_schema(recurrent, ffn)
