"""BitNet b1.58 (llama.cpp's `bitnet`): the llama block with a sub-norm on the attention
output before its projection and one on act(gate) * up before the down projection,
optional per-matrix output scales, NEOX RoPE, the head tied to the embeddings. The
matrices are usually TQ1_0 / TQ2_0 (ternary, the native kernels' canonical route).

The ffn activation follows the model (`Config.ffn_act`, see schema.bitnet.pick_act):
SiLU, llama.cpp's choice for every bitnet file, unless the file is BitNet-b1.58-2B-4T,
whose config says squared ReLU (llama.cpp runs it with SiLU: FUCINA_BITNET_ACT=silu
reproduces that for parity). The block's math differs from the skeleton's, so the layer
step runs on the torch blocks (each matmul still a native kernel)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fucina.models import llama
from fucina.models.base import layer_tensors, rms_norm
# the config and tensor schema (torch-free: fucina.load() checks a file with them)
from fucina.models.schema.bitnet import ACTS, TENSORS, Config, Schema  # noqa: F401


SCALED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class Layer(llama.Layer):
    """llama's layer plus the sub-norms and the matrices' output scales (1.0 when absent:
    an exact no-op), applied after each part, so fused matrices stay fused."""

    def __init__(self, tensors, i, c, schema):
        super().__init__(tensors, i, c, schema)
        t = layer_tensors(tensors, i, schema)
        self.attn_sub_norm, self.ffn_sub_norm = t["attn_sub_norm"], t["ffn_sub_norm"]
        self.scale = {n: 1.0 if t.get(f"{n}_scale") is None else float(t[f"{n}_scale"].reshape(-1)[0])
                      for n in SCALED}

    def qkv(self, x: torch.Tensor):
        q, k, v = super().qkv(x)
        s = self.scale
        return q * s["attn_q"], k * s["attn_k"], v * s["attn_v"]

    def gate_up(self, x: torch.Tensor):
        g, u = super().gate_up(x)
        return g * self.scale["ffn_gate"], u * self.scale["ffn_up"]


def relu2(g: torch.Tensor) -> torch.Tensor:
    r = F.relu(g)
    return r * r


class Model(llama.Model):
    schema = Schema
    layer_class = Layer

    def __init__(self, f, checked=None):
        super().__init__(f, checked)
        self.act = self.config.ffn_act

    def build_plan(self):
        return None   # the sub-norms are not in the native plan: the torch blocks run the layer

    def attn_out(self, L: Layer, a: torch.Tensor) -> torch.Tensor:
        return L.wo(rms_norm(a, L.attn_sub_norm, self.config.rms_eps)) * L.scale["attn_output"]

    def ffn(self, i: int, L: Layer, x: torch.Tensor) -> torch.Tensor:
        g, u = L.gate_up(x)
        h = (relu2(g) if self.act == "relu2" else F.silu(g)) * u
        return L.down(rms_norm(h, L.ffn_sub_norm, self.config.rms_eps)) * L.scale["ffn_down"]
