"""Gemma 4's schema (torch-free): the per-layer geometry keys (arrays in the E-models) and
their checks, shared-KV layers, per-layer embeddings, the MoE variant's router, norms and
expert stacks (module docstring of models/gemma4.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from fucina.errors import GGUFError, UnsupportedArchitecture
from fucina.gguf import GGUFFile
from fucina.models.schema import llama
from fucina.models.schema.base import LayerSpec, Tensors, meta_field, tensor_dims


def _per_layer(f: GGUFFile, key: str, n: int, default=None) -> list[int] | None:
    """An int-or-array key broadcast over the layers (llama.cpp's get_key_or_arr)."""
    v = f.metadata.get(key)
    if v is None:
        return None if default is None else [default] * n
    if isinstance(v, (list, tuple, np.ndarray)):
        if len(v) != n:
            raise GGUFError(f"{f.path}: {key} has {len(v)} entries for {n} layers")
        return [int(x) for x in v]
    return [int(v)] * n


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    # arrays in the E-models: read in finish, not by the generic scalar reader
    n_head_kv: int = 0
    n_ff: int = 0
    sliding_window: int = meta_field("attention.sliding_window")
    head_dim_swa: int = meta_field("attention.key_length_swa", derive=lambda v: v["head_dim"])
    v_dim_swa: int = meta_field("attention.value_length_swa", derive=lambda v: v["head_dim_swa"])
    n_rot_swa: int = meta_field("rope.dimension_count_swa", derive=lambda v: v["n_rot"])
    rope_base_swa: float = meta_field("rope.freq_base_swa", 10000.0, kind=float)
    n_kv_shared: int = meta_field("attention.shared_kv_layers", 0, zero_ok=True)
    n_embd_per_layer: int = meta_field("embedding_length_per_layer_input", 0, zero_ok=True)
    final_softcap: float = meta_field("final_logit_softcapping", 0.0, kind=float)
    n_expert: int = meta_field("expert_count", 0, zero_ok=True)
    n_expert_used: int = meta_field("expert_used_count", 0, zero_ok=True)
    n_ff_exp: int = 0
    swa: tuple = ()
    kv_heads: tuple = ()
    ffs: tuple = ()

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        a, n = self.arch, self.n_layer
        pattern = f.metadata.get(f"{a}.attention.sliding_window_pattern")
        if pattern is None:
            raise GGUFError(f"{f.path}: missing metadata key {a}.attention.sliding_window_pattern")
        self.swa = tuple(bool(p) for p in pattern) if isinstance(pattern, (list, tuple, np.ndarray)) \
            else tuple(i % int(pattern) < int(pattern) - 1 for i in range(n))
        if len(self.swa) != n:
            raise GGUFError(f"{f.path}: sliding_window_pattern has {len(self.swa)} entries for {n} layers")
        self.kv_heads = tuple(_per_layer(f, f"{a}.attention.head_count_kv", n, self.n_head))
        self.ffs = tuple(_per_layer(f, f"{a}.feed_forward_length", n) or [])
        if not self.ffs or min(self.kv_heads) <= 0 or min(self.ffs) <= 0:
            raise GGUFError(f"{f.path}: feed_forward_length and head_count_kv must be positive")
        self.n_head_kv, self.n_ff = self.kv_heads[0], self.ffs[0]
        if self.n_kv_shared and n - self.n_kv_shared < 2:
            raise GGUFError(f"{f.path}: shared_kv_layers {self.n_kv_shared} leaves fewer than 2 KV layers")
        for i in range(self.first_shared, n):
            if self.swa[self.kv_source(i)] != self.swa[i] or self.kv_heads[self.kv_source(i)] != self.kv_heads[i]:
                raise GGUFError(f"{f.path}: shared-KV layer {i} reads layer {self.kv_source(i)} of another geometry")
        if self.head_dim != self.v_dim or self.head_dim_swa != self.v_dim_swa:
            raise GGUFError(f"{f.path}: gemma4 needs key and value head sizes equal")
        if self.n_expert:
            widths = set(_per_layer(f, f"{a}.expert_feed_forward_length", n) or [0])
            if len(widths) != 1 or min(widths) <= 0 or not 0 < self.n_expert_used <= self.n_expert:
                raise GGUFError(f"{f.path}: MoE needs one positive expert_feed_forward_length and "
                                f"0 < expert_used_count <= expert_count")
            self.n_ff_exp = widths.pop()

    @cached_property
    def routing(self):
        """The router's math when the model has experts (models/moe.py, torch: only a compute reads it)."""
        from fucina.models.moe import Routing
        return Routing(self.n_expert, self.n_expert_used, norm=True) if self.n_expert else None

    @property
    def first_shared(self) -> int:
        return self.n_layer - self.n_kv_shared

    def kv_source(self, i: int) -> int:
        """The layer whose K/V layer i reads (itself unless it is a shared-KV layer):
        the last KV layer of the same type, as llama.cpp's layer_reuse_cb picks it."""
        if i < self.first_shared:
            return i
        return self.first_shared - (2 if self.swa[i] else 1)

    def layer_spec(self, i: int) -> LayerSpec:
        local = self.swa[i]
        d = self.head_dim_swa if local else self.head_dim
        return LayerSpec(n_head=self.n_head, n_head_kv=self.kv_heads[i], head_dim=d, v_dim=d,
                         window=self.sliding_window if local else 0, rope=1 if local else 0)


# attn_k/attn_k_norm are absent on shared-KV layers, attn_v on "K = V" layers
TENSORS = (
    llama.norm("attn_norm"),
    llama.T("attn_q", "q_out", "n_embd"), llama.T("attn_k", "kv_out", "n_embd", required=False),
    llama.T("attn_v", "v_out", "n_embd", required=False),
    llama.T("attn_output", "n_embd", "q_out"),
    llama.norm("attn_q_norm", "head_dim"), llama.norm("attn_k_norm", "head_dim", required=False),
    llama.norm("ffn_norm"),
    llama.T("ffn_gate", "n_ff", "n_embd"), llama.T("ffn_up", "n_ff", "n_embd"), llama.T("ffn_down", "n_embd", "n_ff"),
    llama.norm("post_attention_norm"), llama.norm("post_ffw_norm"),
)
# per-layer embeddings (when embedding_length_per_layer_input > 0)
PLE_TENSORS = (llama.T("inp_gate", "n_ple", "n_embd"), llama.T("proj", "n_embd", "n_ple"), llama.norm("post_norm"))
OUT_SCALE = (llama.norm("layer_output_scale", "one", required=False),)
# a MoE layer's router and norms (its ffn_gate/up/down are the shared expert)
MOE_TENSORS = (llama.T("ffn_gate_inp", "n_expert", "n_embd"), llama.T("ffn_gate_inp", "n_embd", suffix="scale"),
               llama.norm("pre_ffw_norm_2"), llama.norm("post_ffw_norm_1"), llama.norm("post_ffw_norm_2"),
               llama.T("ffn_down_exps", "n_expert", suffix="scale", required=False))


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS

    @classmethod
    def check_layer(cls, t: Tensors, i: int) -> None:
        c, f = t.config, t.f
        s = c.layers[i]
        view = replace(c, n_head_kv=s.n_head_kv, head_dim=s.head_dim, v_dim=s.v_dim, n_ff=c.ffs[i])
        got = t.layer(i, cls.tensors, tensor_dims(view))
        if c.kv_source(i) == i and got["attn_k"] is None:
            raise GGUFError(f"{f.path}: layer {i} stores K/V but has no attn_k")
        t.layer(i, OUT_SCALE + (PLE_TENSORS if c.n_embd_per_layer else ()),
                dict(n_embd=c.n_embd, n_ple=c.n_embd_per_layer, one=1))
        if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors:
            return
        if not c.n_expert:
            raise GGUFError(f"{f.path}: layer {i} has a router but expert_count is missing")
        t.layer(i, MOE_TENSORS, dict(n_embd=c.n_embd, n_expert=c.n_expert))
        if any(f"blk.{i}.{n}.scale" in f.tensors for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps")):
            raise UnsupportedArchitecture(f"{f.path}: layer {i}: gate/up expert scales are not supported")
        b, NE, M, E = f"blk.{i}.", c.n_expert, c.n_ff_exp, c.n_embd
        t.want(b + "ffn_down_exps.weight", (NE, E, M))
        if t.want(b + "ffn_gate_up_exps.weight", (NE, 2 * M, E), required=False) is None:
            t.want(b + "ffn_gate_exps.weight", (NE, M, E))
            t.want(b + "ffn_up_exps.weight", (NE, M, E))

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        super().check_extras(t)     # rope_freqs: the global layers' table
        c = t.config
        P = c.n_embd_per_layer
        if P:
            t.want("per_layer_token_embd.weight", (c.n_vocab, P * c.n_layer))
            t.want("per_layer_model_proj.weight", (P * c.n_layer, c.n_embd))
            t.want("per_layer_proj_norm.weight", (P,))
