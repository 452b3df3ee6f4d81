"""Qwen3.5-MoE (Qwen3.5-35B-A3B and up): qwen35's hybrid of Gated DeltaNet and gated
attention layers (models/qwen35.py) with every ffn a routed mixture of SwiGLU experts plus
one shared expert, as llama.cpp b11434 builds it (src/models/qwen35moe.cpp):
    ffn(x) = mix(x; softmax top-k, weights renormalised) + sigmoid(x . gate_inp_shexp) * shexp(x)
with the shared expert a dense SwiGLU of `expert_shared_feed_forward_length` rows. The
routed math is models/moe.py (qwen3moe's); the blocks run in torch (the native step's MoE
ffn has no shared expert yet), the DeltaNet decode recurrence natively per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fucina.gguf import GGUFFile
from fucina.models import llama, moe, qwen35
# the config and tensor schemas (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.qwen35moe import MOE_FFN, Config, Schema, layer_schema  # noqa: F401


class Model(qwen35.Model):
    schema = Schema
    ffn_tensors = MOE_FFN

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

