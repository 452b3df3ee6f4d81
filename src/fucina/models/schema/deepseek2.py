"""DeepSeek-V2's schema (torch-free): the MLA and MoE keys with their checks, the YaRN
parameters, and the tensors of a dense or MoE layer with the combinations a layer needs
(one q path, one k_b/v_b generation, gate/up or fused expert stacks, the shared experts)."""
from __future__ import annotations

from dataclasses import dataclass

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile, meta_float_opt
from fucina.models.schema import llama
from fucina.models.schema.base import LayerSpec, Tensors, TensorSpec, meta_field
from fucina.models.schema.mla import MLAGeometry, YarnParams

GATING = {1: "softmax", 2: "sigmoid"}   # llama_expert_gating_func_type values this family uses


@dataclass
class Config(llama.Config):
    q_lora_rank: int = meta_field("attention.q_lora_rank", 0, zero_ok=True)
    kv_lora_rank: int = meta_field("attention.kv_lora_rank")
    head_k_mla: int = meta_field("attention.key_length_mla", 0, zero_ok=True)
    head_v_mla: int = meta_field("attention.value_length_mla", 0, zero_ok=True)
    n_dense_lead: int = meta_field("leading_dense_block_count", 0, zero_ok=True)
    n_ff_exp: int = meta_field("expert_feed_forward_length", 0, zero_ok=True)
    n_expert: int = meta_field("expert_count", 0, zero_ok=True)
    n_expert_used: int = meta_field("expert_used_count", 0, zero_ok=True)
    n_expert_shared: int = meta_field("expert_shared_count", 0, zero_ok=True)
    n_expert_groups: int = meta_field("expert_group_count", 0, zero_ok=True)
    n_group_used: int = meta_field("expert_group_used_count", 0, zero_ok=True)
    expert_weights_scale: float = meta_field("expert_weights_scale", 0.0, kind=float)
    gating_func: int = meta_field("expert_gating_func", 0, zero_ok=True)
    expert_weights_norm: bool = False
    nope: int = 0            # per-head key dims without RoPE
    v_head: int = 0          # per-head value dims
    yarn: YarnParams | None = None

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        m, a = f.metadata, self.arch
        mla = bool(self.head_k_mla and self.head_v_mla)    # llama_hparams::is_mla
        k_full = self.head_k_mla if mla else self.head_dim
        self.v_head = self.head_v_mla if mla else self.v_dim
        self.nope = k_full - self.n_rot
        if self.nope < 1 or self.n_rot % 2:
            raise GGUFError(f"{f.path}: deepseek2 key length {k_full} leaves no room for {self.n_rot} rope dims")
        self.expert_weights_norm = bool(m.get(f"{a}.expert_weights_norm", False))
        if self.gating_func == 0:   # older V2/V2.5 files: softmax (GLM-4.7-Lite's shape: sigmoid)
            self.gating_func = 2 if self.n_layer in (47, 48) and self.n_vocab == 154880 else 1
        if self.gating_func not in GATING:
            raise GGUFError(f"{f.path}: expert_gating_func {self.gating_func} is not softmax (1) or sigmoid (2)")
        if self.n_dense_lead < self.n_layer:
            self._check_moe(f.path)
        self.yarn = _yarn(m, a, self.n_ctx_train)

    def _check_moe(self, path: str) -> None:
        if not (0 < self.n_expert_used <= self.n_expert) or self.n_ff_exp <= 0:
            raise GGUFError(f"{path}: MoE layers need 0 < expert_used_count ({self.n_expert_used}) <= "
                            f"expert_count ({self.n_expert}) and expert_feed_forward_length")
        g = self.n_expert_groups
        if g > 1 and (self.n_expert % g or not 0 < self.n_group_used < g
                      or self.n_group_used * (self.n_expert // g) < self.n_expert_used
                      or self.n_expert // g < 2):
            raise GGUFError(f"{path}: expert groups {g} / used {self.n_group_used} do not fit "
                            f"{self.n_expert} experts, {self.n_expert_used} used")

    def layer_spec(self, i: int) -> LayerSpec:
        # the cache rows per position: one latent [kv_lora_rank] and one rope key [n_rot]
        return LayerSpec(mixer="mla", ffn="dense" if i < self.n_dense_lead else "moe", n_head=self.n_head,
                         n_head_kv=1, head_dim=self.kv_lora_rank, v_dim=self.n_rot)

    def geometry(self) -> MLAGeometry:
        return MLAGeometry(self.n_head, self.q_lora_rank, self.kv_lora_rank, self.nope, self.n_rot, self.v_head)


def _yarn(m: dict, a: str, n_ctx_train: int) -> YarnParams:
    """The context parameters llama.cpp derives from rope.scaling.* (its defaults when absent)."""
    kind = m.get(f"{a}.rope.scaling.type", "linear")
    factor = meta_float_opt(m, a, "rope.scaling.factor") or meta_float_opt(m, a, "rope.scale_linear") or 0.0
    log_mul = meta_float_opt(m, a, "rope.scaling.yarn_log_multiplier")
    orig = m.get(f"{a}.rope.scaling.original_context_length") or n_ctx_train
    return YarnParams(freq_scale=1.0 if kind == "none" or not factor else 1.0 / factor,
                      ext_factor=1.0 if kind == "yarn" else 0.0,
                      log_mul=(log_mul or 0.0) / 0.1,   # deepseek2's converter stores 0.1 * mscale_all_dim
                      attn_factor=meta_float_opt(m, a, "rope.scaling.attn_factor") or 1.0,
                      n_ctx_orig=int(orig))


def T(name: str, *shape: str, required: bool = True) -> TensorSpec:
    return llama.T(name, *shape, required=required)


# the attention tensors (one of the q paths and one of the kv_b generations must be present)
ATTN: tuple[TensorSpec, ...] = (
    llama.norm("attn_norm"),
    T("attn_q_a", "q_lora", "n_embd", required=False), llama.norm("attn_q_a_norm", "q_lora", required=False),
    T("attn_q_b", "q_out", "q_lora", required=False), T("attn_q", "q_out", "n_embd", required=False),
    T("attn_kv_a_mqa", "kv_a_out", "n_embd"), llama.norm("attn_kv_a_norm", "kv_lora"),
    T("attn_k_b", "k_b_rows", "nope", required=False), T("attn_v_b", "v_b_rows", "kv_lora", required=False),
    T("attn_kv_b", "kv_b_out", "kv_lora", required=False),
    T("attn_output", "n_embd", "o_in"),
    llama.norm("ffn_norm"),
)
DENSE = (T("ffn_gate", "n_ff", "n_embd"), T("ffn_up", "n_ff", "n_embd"), T("ffn_down", "n_embd", "n_ff"))
MOE = (
    T("ffn_gate_inp", "n_expert", "n_embd"),
    TensorSpec("exp_probs_b", ("n_expert",), False, "bias", "bias"),
    T("ffn_gate_exps", "exp_ff", "n_embd", required=False), T("ffn_up_exps", "exp_ff", "n_embd", required=False),
    T("ffn_gate_up_exps", "exp_gu", "n_embd", required=False),
    T("ffn_down_exps", "exp_embd", "n_ff_exp"),
    T("ffn_gate_shexp", "n_ff_sh", "n_embd", required=False), T("ffn_up_shexp", "n_ff_sh", "n_embd", required=False),
    T("ffn_down_shexp", "n_embd", "n_ff_sh", required=False),
)
TENSORS = ATTN + DENSE     # a dense layer's schema (MoE layers use ATTN + MOE)


def tensor_dims(c: Config) -> dict[str, int]:
    H = c.n_head
    return dict(n_embd=c.n_embd, q_lora=c.q_lora_rank or 1, q_out=H * (c.nope + c.n_rot),
                kv_a_out=c.kv_lora_rank + c.n_rot, kv_lora=c.kv_lora_rank, nope=c.nope,
                k_b_rows=H * c.kv_lora_rank, v_b_rows=H * c.v_head, kv_b_out=H * (c.nope + c.v_head),
                o_in=H * c.v_head, n_ff=c.n_ff, n_expert=c.n_expert, n_ff_exp=c.n_ff_exp,
                exp_ff=c.n_expert * c.n_ff_exp, exp_gu=2 * c.n_expert * c.n_ff_exp, exp_embd=c.n_expert * c.n_embd,
                n_ff_sh=c.n_ff_exp * c.n_expert_shared)


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS

    @classmethod
    def check_layer(cls, t: Tensors, i: int) -> None:
        c = t.config
        moe = i >= c.n_dense_lead
        got = t.layer(i, ATTN + (MOE if moe else DENSE), tensor_dims(c))
        where = f"{t.f.path}: blk.{i}"
        q_lora = got["attn_q_a"] is not None and got["attn_q_b"] is not None and got["attn_q_a_norm"] is not None
        if (got["attn_q"] is None) != q_lora:
            raise GGUFError(f"{where}: needs attn_q, or attn_q_a + attn_q_a_norm + attn_q_b")
        if (got["attn_k_b"] is None or got["attn_v_b"] is None) and got["attn_kv_b"] is None:
            raise GGUFError(f"{where}: needs attn_k_b + attn_v_b or attn_kv_b")
        if not moe:
            return
        if got["ffn_gate_up_exps"] is None and (got["ffn_gate_exps"] is None or got["ffn_up_exps"] is None):
            raise GGUFError(f"{where} needs ffn_gate_exps + ffn_up_exps or ffn_gate_up_exps")
        shared = [got["ffn_gate_shexp"], got["ffn_up_shexp"], got["ffn_down_shexp"]]
        if c.n_expert_shared and any(s is None for s in shared):
            raise GGUFError(f"{where} has {c.n_expert_shared} shared experts but no ffn_*_shexp")

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        pass   # YaRN comes from the config, no rope_freqs
