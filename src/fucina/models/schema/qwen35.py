"""Qwen3.5's schema (torch-free): the DeltaNet geometry keys and their checks, which
layers are recurrent, and the two layer schemas (DeltaNet or gated attention)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile
from fucina.models.schema import llama
from fucina.models.schema.base import LayerSpec, Tensors, TensorSpec, meta_field


@dataclass
class Config(llama.Config):
    rope_neox: bool = True
    d_conv: int = meta_field("ssm.conv_kernel")
    d_inner: int = meta_field("ssm.inner_size")
    d_state: int = meta_field("ssm.state_size")
    n_v_heads: int = meta_field("ssm.time_step_rank")
    n_k_heads: int = meta_field("ssm.group_count")
    attn_interval: int = meta_field("full_attention_interval", 4)
    rope_sections: list[int] = field(default_factory=list)
    recurrent: list[bool] = field(default_factory=list)

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        m, a = f.metadata, self.arch
        secs = m.get(f"{a}.rope.dimension_sections")
        self.rope_sections = [int(s) for s in secs][:4] if secs is not None else []
        self.rope_sections += [0] * (4 - len(self.rope_sections))
        flags = m.get(f"{a}.attention.recurrent_layers")
        if flags is not None and len(flags) >= self.n_layer:
            self.recurrent = [bool(x) for x in list(flags)[:self.n_layer]]
        else:
            self.recurrent = [(i + 1) % self.attn_interval != 0 for i in range(self.n_layer)]
        if self.d_conv < 2 or self.d_inner % self.n_v_heads or self.n_v_heads % self.n_k_heads:
            raise GGUFError(f"{f.path}: qwen35 ssm geometry (conv {self.d_conv}, inner {self.d_inner}, "
                            f"{self.n_v_heads} v heads, {self.n_k_heads} k heads) is not a valid DeltaNet")
        if self.d_inner // self.n_v_heads != self.d_state:
            raise GGUFError(f"{f.path}: qwen35 needs the value head dim ({self.d_inner // self.n_v_heads}) "
                            f"equal to ssm.state_size ({self.d_state})")
        if sum(self.rope_sections) * 2 > self.n_rot and any(self.rope_sections):
            raise GGUFError(f"{f.path}: rope.dimension_sections {self.rope_sections} exceed n_rot {self.n_rot}")

    def layer_spec(self, i: int) -> LayerSpec:
        if self.recurrent[i]:
            return LayerSpec(mixer="delta_net")
        return super().layer_spec(i)

    def dims(self) -> dict[str, int]:
        q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        return dict(n_embd=self.n_embd, q_out=q, qg_out=2 * q, kv_out=kv, head_dim=self.head_dim,
                    n_ff=self.n_ff, conv_dim=2 * self.n_k_heads * self.d_state + self.d_inner,
                    d_inner=self.d_inner, v_heads=self.n_v_heads, ssm_v_dim=self.d_inner // self.n_v_heads,
                    d_conv=self.d_conv)


@dataclass(frozen=True)
class BareSpec(TensorSpec):
    """A tensor named without a .weight/.bias suffix (llama.cpp's `blk.N.ssm_a`)."""

    def gguf_name(self, i: int) -> str:
        return f"blk.{i}.{self.name}"


T, norm = llama.T, llama.norm
NORMS = (norm("attn_norm"), norm("post_attention_norm"))
DENSE_FFN = (T("ffn_gate", "n_ff", "n_embd"), T("ffn_up", "n_ff", "n_embd"), T("ffn_down", "n_embd", "n_ff"))
ATTENTION_MIXER = (T("attn_q", "qg_out", "n_embd"), T("attn_k", "kv_out", "n_embd"),
                   T("attn_v", "kv_out", "n_embd"), T("attn_output", "n_embd", "q_out"),
                   norm("attn_q_norm", "head_dim"), norm("attn_k_norm", "head_dim"))
# role "conv": a small f32 matrix llama-quantize never quantizes; "decay": -exp(A_log) < 0
DELTA_MIXER = (T("attn_qkv", "conv_dim", "n_embd"), T("attn_gate", "d_inner", "n_embd"),
               T("ssm_conv1d", "conv_dim", "d_conv", role="conv"),
               T("ssm_dt", "v_heads", role="bias", suffix="bias"), BareSpec("ssm_a", ("v_heads",), role="decay"),
               T("ssm_beta", "v_heads", "n_embd"), T("ssm_alpha", "v_heads", "n_embd"),
               norm("ssm_norm", "ssm_v_dim"), T("ssm_out", "n_embd", "d_inner"))
ATTENTION = NORMS + DENSE_FFN + ATTENTION_MIXER
DELTA_NET = NORMS + DENSE_FFN + DELTA_MIXER


def layer_schema(recurrent: bool, ffn: tuple[TensorSpec, ...] = DENSE_FFN) -> tuple[TensorSpec, ...]:
    return NORMS + ffn + (DELTA_MIXER if recurrent else ATTENTION_MIXER)


class Schema(llama.Schema):
    config_class = Config
    tensors = ATTENTION          # the attention layers' schema; DeltaNet layers use DELTA_NET
    ffn_tensors = DENSE_FFN      # qwen35moe: the routed and shared experts

    @classmethod
    def check_layer(cls, t: Tensors, i: int) -> None:
        c = t.config
        t.layer(i, layer_schema(c.recurrent[i], cls.ffn_tensors), c.dims())

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        pass   # no rope_freqs: the multi-section RoPE comes from the config
