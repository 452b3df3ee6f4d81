"""The plain data of multi-head latent attention (torch-free): its per-head geometry and
the YaRN parameters llama.cpp derives from rope.scaling.*; models/mla.py holds the math."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class YarnParams:
    """What llama.cpp's context derives from the rope.scaling.* keys."""
    freq_scale: float = 1.0     # 1 / rope.scaling.factor (1 when the type is "none")
    ext_factor: float = 0.0     # 1 for YaRN, else 0
    log_mul: float = 0.0        # rope.scaling.yarn_log_multiplier / 0.1 (deepseek2's converter fix)
    attn_factor: float = 1.0    # rope.scaling.attn_factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 4096


@dataclass
class MLAGeometry:
    n_head: int
    q_lora: int      # 0: one attn_q
    kv_lora: int     # the latent's width
    nope: int        # per-head key dims without RoPE
    rope: int        # the rope key's dims (shared by all heads)
    v_dim: int       # per-head value dims
