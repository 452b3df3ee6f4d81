"""Qwen3.5-MoE (Qwen3.5-35B-A3B and up): qwen35's hybrid of Gated DeltaNet and gated
attention layers (models/qwen35.py) with every ffn a routed mixture of SwiGLU experts plus
one shared expert, as llama.cpp b11434 builds it (src/models/qwen35moe.cpp):
    ffn(x) = mix(x; softmax top-k, weights renormalised) + sigmoid(x . gate_inp_shexp) * shexp(x)
with the shared expert a dense SwiGLU of `expert_shared_feed_forward_length` rows. The
routed math is models/moe.py (qwen3moe's). The native layer step runs it: qwen35's mixers
and the MoE ffn with the gated shared expert (csrc/generic/moe_shared_impl.inc); the torch
blocks stay the reference (FUCINA_NATIVE_STEP=0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fucina.gguf import GGUFFile
from fucina.models import llama, moe, qwen35
# the config and tensor schemas (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.qwen35moe import MOE_FFN, Config, Schema, layer_schema  # noqa: F401


def shared_gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sigmoid(x . w) per row, [m, 1], computed the same way whatever m is (batch invariance):
    one dot per row (`x @ w` over m rows picks its kernel by m), and the sigmoid over 32
    copies of each value, so every value takes the vector loop's main path (over m values
    the last m % 8 take the scalar tail on AVX2, whose rounding differs; torch's AVX-512
    loop takes two 16-lane vectors a step, so with 16 copies an odd m's last row took its
    tail, 1.5e-11 off)."""
    gate = torch.stack([torch.dot(row, w) for row in x.float()])
    return torch.sigmoid(gate[:, None].repeat(1, 32))[:, :1]


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
        return routed + shared * shared_gate(x, L.ffn_gate_inp_shexp)

    # -- the native step: qwen35's mixers, the MoE ffn with its gated shared expert --------
    def plan_ff(self) -> int:
        return self.config.n_ff_shexp

    def plan_ffn(self, i: int, L) -> dict:
        r, ex = self.config.routing, L.experts
        shared = dict(gate_up=L.w_shared) if L.w_shared is not None else dict(gate=L.ffn_gate_shexp,
                                                                                up=L.ffn_up_shexp)
        return dict(ffn="moe", n_expert=r.n_expert, n_expert_used=r.k, n_ff_exp=ex.gate.out_features,
                    moe_norm=int(r.norm), moe_scale=r.scale, gate_inp=L.ffn_gate_inp, gate_exps=ex.gate.whole,
                    up_exps=ex.up.whole, down_exps=ex.down.whole, down=L.ffn_down_shexp,
                    shexp_gate=L.ffn_gate_inp_shexp.float().contiguous(), **shared,
                    **moe.store_fields(self, i))

