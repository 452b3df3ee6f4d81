"""DeepSeek-V4's schema (torch-free): llama.cpp b11434's `deepseek4` keys and tensors
(src/models/deepseek4.cpp load_arch_hparams / load_arch_tensors).

Per layer: the hyper-connection mixers (hc_attn_* / hc_ffn_*), a low-rank query, one
shared K=V row (attn_kv) with its norm, the grouped low-rank output (attn_output_a/b),
sinks; by the layer's compress ratio the compressor (4 and 128) and the lightning indexer
(4 only); a routed MoE whose first `hash_layer_count` layers pick experts by token id
(ffn_gate_tid2eid) and the rest by sqrt-softplus scores with a selection bias, plus shared
experts. The MTP block (nextn, counted in block_count when the file carries it) is not
read: the trunk runs without it."""
from __future__ import annotations

from dataclasses import dataclass, field

from fucina.errors import GGUFError
from fucina.gguf import GGUFFile, meta_float_opt
from fucina.models.schema import llama
from fucina.models.schema.base import LayerSpec, Tensors, TensorSpec, meta_field
from fucina.models.schema.mla import YarnParams

CSA, HCA = 4, 128          # the only compress ratios llama.cpp builds (0: the raw window alone)
SQRT_SOFTPLUS = 4          # llama_expert_gating_func_type


@dataclass
class Config(llama.Config):
    n_ff: int = meta_field("feed_forward_length", 0, zero_ok=True)
    q_lora: int = meta_field("attention.q_lora_rank")
    window: int = meta_field("attention.sliding_window")
    n_ff_exp: int = meta_field("expert_feed_forward_length")
    n_expert: int = meta_field("expert_count")
    n_expert_used: int = meta_field("expert_used_count")
    n_expert_shared: int = meta_field("expert_shared_count")
    expert_weights_scale: float = meta_field("expert_weights_scale", 0.0, kind=float)
    gating_func: int = meta_field("expert_gating_func")
    idx_heads: int = meta_field("attention.indexer.head_count")
    idx_dim: int = meta_field("attention.indexer.key_length")
    idx_top_k: int = meta_field("attention.indexer.top_k")
    o_groups: int = meta_field("attention.output_group_count")
    o_lora: int = meta_field("attention.output_lora_rank")
    compress_rope_base: float = meta_field("attention.compress_rope_freq_base", kind=float)
    hc: int = meta_field("hyper_connection.count")
    sinkhorn_iters: int = meta_field("hyper_connection.sinkhorn_iterations")
    hc_eps: float = meta_field("hyper_connection.epsilon", kind=float)
    n_hash: int = meta_field("hash_layer_count", 0, zero_ok=True)
    expert_weights_norm: bool = False
    ratios: list[int] = field(default_factory=list)
    clamp_exp: list[float] = field(default_factory=list)
    clamp_shexp: list[float] = field(default_factory=list)
    yarn: YarnParams | None = None

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        m, a, p = f.metadata, self.arch, f.path
        self.expert_weights_norm = bool(m.get(f"{a}.expert_weights_norm", False))
        nextn = int(m.get(f"{a}.nextn_predict_layers", 0) or 0)
        if nextn and f"blk.{self.n_layer - nextn}.nextn.eh_proj.weight" in f.tensors:
            if nextn >= self.n_layer:
                raise GGUFError(f"{p}: an MTP-only deepseek4 file (no trunk layers) cannot run on its own")
            self.n_layer -= nextn   # the trunk only: the MTP block (llama.cpp's drafter) is not read
        if self.n_head_kv != 1 or self.v_dim != self.head_dim:
            raise GGUFError(f"{p}: deepseek4 needs one K=V head (head_count_kv 1, value_length == key_length)")
        if self.n_rot % 2 or not 0 < self.n_rot <= min(self.head_dim, self.idx_dim):
            raise GGUFError(f"{p}: rope dimension count {self.n_rot} does not fit heads of {self.head_dim} "
                            f"and indexer keys of {self.idx_dim}")
        if self.hc != 4:
            raise GGUFError(f"{p}: hyper_connection.count {self.hc} is not supported (llama.cpp builds 4 streams)")
        if self.gating_func != SQRT_SOFTPLUS:
            raise GGUFError(f"{p}: deepseek4 expert_gating_func {self.gating_func} is not sqrt-softplus (4)")
        if not 0 < self.n_expert_used <= self.n_expert or self.n_expert_shared < 1:
            raise GGUFError(f"{p}: {self.n_expert_used} experts used of {self.n_expert}, "
                            f"{self.n_expert_shared} shared: deepseek4 needs 0 < used <= count and shared experts")
        if self.n_head % self.o_groups:
            raise GGUFError(f"{p}: {self.n_head} heads do not split into {self.o_groups} output groups")
        if not 0 <= self.n_hash <= self.n_layer:
            raise GGUFError(f"{p}: hash_layer_count {self.n_hash} exceeds {self.n_layer} layers")
        ratios = m.get(f"{a}.attention.compress_ratios")
        ratios = [int(r) for r in (ratios.tolist() if hasattr(ratios, "tolist") else ratios or [])]
        if len(ratios) < self.n_layer:
            raise GGUFError(f"{p}: attention.compress_ratios has {len(ratios)} entries for {self.n_layer} layers")
        bad = sorted({r for r in ratios[:self.n_layer] if r not in (0, CSA, HCA)})
        if bad:
            raise GGUFError(f"{p}: compress ratio(s) {bad} are not supported (0, {CSA} and {HCA} are)")
        self.ratios = ratios[:self.n_layer]
        if CSA in self.ratios and (self.idx_dim % 64 or self.idx_top_k < 1 or self.idx_heads < 1):
            raise GGUFError(f"{p}: the lightning indexer needs a key length that is a multiple of 64 "
                            f"(got {self.idx_dim}), heads and top_k >= 1")
        self.clamp_exp = _per_layer(m, a, "swiglu_clamp_exp", self.n_layer, p)
        self.clamp_shexp = (_per_layer(m, a, "swiglu_clamp_shexp", self.n_layer, p)
                            if f"{a}.swiglu_clamp_shexp" in m else list(self.clamp_exp))
        kind = m.get(f"{a}.rope.scaling.type", "none")
        if kind not in ("none", "yarn"):
            raise GGUFError(f"{p}: rope.scaling.type {kind!r} is not supported for deepseek4 (yarn, none)")
        factor = meta_float_opt(m, a, "rope.scaling.factor") or 0.0
        orig = m.get(f"{a}.rope.scaling.original_context_length") or self.n_ctx_train
        self.yarn = YarnParams(freq_scale=1.0 / factor if factor and kind == "yarn" else 1.0,
                               ext_factor=1.0 if kind == "yarn" else 0.0,
                               beta_fast=meta_float_opt(m, a, "rope.scaling.yarn_beta_fast") or 32.0,
                               beta_slow=meta_float_opt(m, a, "rope.scaling.yarn_beta_slow") or 1.0,
                               n_ctx_orig=int(orig))

    def layer_spec(self, i: int) -> LayerSpec:
        return LayerSpec(mixer="dsv4", ffn="moe", n_head=self.n_head, n_head_kv=1, head_dim=self.head_dim,
                         v_dim=self.head_dim, window=self.window)


def _per_layer(m: dict, a: str, key: str, n: int, path: str) -> list[float]:
    v = m.get(f"{a}.{key}")
    if v is None:
        raise GGUFError(f"{path}: missing metadata key {a}.{key}")
    v = v.tolist() if hasattr(v, "tolist") else v
    if isinstance(v, (list, tuple)):
        if len(v) < n:
            raise GGUFError(f"{path}: {a}.{key} has {len(v)} entries for {n} layers")
        return [float(x) for x in v[:n]]
    return [float(v)] * n


def T(name: str, *shape: str, suffix: str = "weight", role: str = "mat") -> TensorSpec:
    return TensorSpec(name, shape, True, role, suffix)


HC = tuple(T(f"hc_{p}_{k}", *s) for p in ("attn", "ffn")
           for k, s in (("fn", ("hc_mix", "hc_dim")), ("base", ("hc_mix",)), ("scale", ("three",))))
ATTN = (
    llama.norm("attn_norm"), T("attn_sinks", "n_head", role="sink"),
    T("attn_q_a", "q_lora", "n_embd"), llama.norm("attn_q_a_norm", "q_lora"), T("attn_q_b", "q_out", "q_lora"),
    T("attn_kv", "head_dim", "n_embd"), llama.norm("attn_kv_a_norm", "head_dim"),
    T("attn_output_a", "o_a_out", "o_group_in"), T("attn_output_b", "n_embd", "o_b_in"),
)
COMPRESSOR = (
    T("attn_compressor_kv", "comp_out", "n_embd"), T("attn_compressor_gate", "comp_out", "n_embd"),
    T("attn_compressor_ape", "ratio", "comp_out"), llama.norm("attn_compressor_norm", "head_dim"),
)
INDEXER = (
    T("indexer.proj", "idx_heads", "n_embd"), T("indexer.attn_q_b", "idx_q_out", "q_lora"),
    T("indexer_compressor_kv", "idx_comp_out", "n_embd"), T("indexer_compressor_gate", "idx_comp_out", "n_embd"),
    T("indexer_compressor_ape", "ratio", "idx_comp_out"), llama.norm("indexer_compressor_norm", "idx_dim"),
)
MOE = (
    llama.norm("ffn_norm"), T("ffn_gate_inp", "n_expert", "n_embd"),
    T("ffn_gate_exps", "n_expert", "n_ff_exp", "n_embd"), T("ffn_up_exps", "n_expert", "n_ff_exp", "n_embd"),
    T("ffn_down_exps", "n_expert", "n_embd", "n_ff_exp"),
    T("ffn_gate_shexp", "n_ff_sh", "n_embd"), T("ffn_up_shexp", "n_ff_sh", "n_embd"),
    T("ffn_down_shexp", "n_embd", "n_ff_sh"),
)
HASH = (T("ffn_gate_tid2eid", "n_vocab", "n_used"),)
BIASED = (T("exp_probs_b", "n_expert", suffix="bias", role="bias"),)
TENSORS = HC + ATTN + MOE     # every layer's; the compressor, indexer and routing ones by layer


def layer_schema(c: Config, i: int) -> tuple[TensorSpec, ...]:
    r = c.ratios[i]
    return (HC + ATTN + (COMPRESSOR if r else ()) + (INDEXER if r == CSA else ()) + MOE
            + (HASH if i < c.n_hash else BIASED))


def tensor_dims(c: Config, i: int) -> dict[str, int]:
    r = c.ratios[i]
    coff = 2 if r == CSA else 1
    return dict(n_embd=c.n_embd, hc_mix=(2 + c.hc) * c.hc, hc_dim=c.hc * c.n_embd, three=3, n_head=c.n_head,
                q_lora=c.q_lora, q_out=c.n_head * c.head_dim, head_dim=c.head_dim,
                o_a_out=c.o_lora * c.o_groups, o_group_in=c.n_head * c.head_dim // c.o_groups,
                o_b_in=c.o_groups * c.o_lora, comp_out=coff * c.head_dim, ratio=max(r, 1),
                idx_heads=c.idx_heads, idx_q_out=c.idx_heads * c.idx_dim, idx_comp_out=2 * c.idx_dim,
                idx_dim=c.idx_dim, n_expert=c.n_expert, n_ff_exp=c.n_ff_exp,
                n_ff_sh=c.n_ff_exp * c.n_expert_shared, n_vocab=c.n_vocab, n_used=c.n_expert_used)


class Schema(llama.Schema):
    config_class = Config
    tensors = TENSORS

    @classmethod
    def check_globals(cls, t: Tensors) -> None:
        c = t.config
        t.want("token_embd.weight", (c.n_vocab, c.n_embd))
        t.want("output_norm.weight", (c.n_embd,))
        t.want("output.weight", (c.n_vocab, c.n_embd))    # llama.cpp requires the head (never tied)
        t.want("output_hc_fn.weight", (c.hc, c.hc * c.n_embd))
        t.want("output_hc_base.weight", (c.hc,))
        t.want("output_hc_scale.weight", (1,))

    @classmethod
    def check_layer(cls, t: Tensors, i: int) -> None:
        c = t.config
        got = t.layer(i, layer_schema(c, i), tensor_dims(c, i))
        table = got.get("ffn_gate_tid2eid")
        if table is not None and table.ggml_type.name != "I32":
            raise GGUFError(f"{t.f.path}: blk.{i}.ffn_gate_tid2eid is {table.ggml_type.name}, expected I32")

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        pass
