"""The sampling a front end uses when the caller names none.

A GGUF may carry its authors' recommendation (`general.sampling.*`, written by
llama.cpp's converter from generation_config.json); otherwise llama.cpp's own
defaults apply (common/common.h: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05).
Every call without a seed draws a fresh one, as llama.cpp and OpenAI do; greedy
(temperature 0) never touches the RNG. `fucina run`, the parity tool, stays greedy.
"""
from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:                     # the sampler imports torch; `fucina info` must not
    from fucina.text.sampler import SamplingConfig

#: llama.cpp's common_params_sampling defaults for the stages fucina implements.
LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}

#: general.sampling.<key> -> SamplingConfig field, and the range it must be in.
_GGUF_KEYS = {"temp": ("temperature", float, 0.0, 100.0), "top_k": ("top_k", int, 0, 1 << 31),
              "top_p": ("top_p", float, 0.0, 1.0), "min_p": ("min_p", float, 0.0, 1.0),
              "penalty_repeat": ("repeat_penalty", float, 1e-6, 100.0),
              "penalty_last_n": ("repeat_last_n", int, -1, 1 << 31)}


def recommended(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The model's own sampling recommendation, as SamplingConfig keywords (values of
    the wrong type or out of range are ignored)."""
    out: dict[str, Any] = {}
    for key, (name, kind, lo, hi) in _GGUF_KEYS.items():
        v = (metadata or {}).get("general.sampling." + key)
        if isinstance(v, (bool, str, list)) or not isinstance(v, (int, float)):
            continue
        if kind is int and v != int(v) or not math.isfinite(v) or not lo <= v <= hi:
            continue
        out[name] = kind(v)
    return out


def default_sampling(metadata: Mapping[str, Any] | None = None) -> "SamplingConfig":
    """llama.cpp's defaults overlaid with the model's recommendation (seed left at 0:
    `fresh_seed` picks one per call)."""
    from fucina.text.sampler import SamplingConfig

    return SamplingConfig(**{**LLAMA_CPP, **recommended(metadata)})


def fresh_seed() -> int:
    return random.SystemRandom().getrandbits(32)


def describe(cfg: "SamplingConfig") -> str:
    """One line for banners and logs."""
    if cfg.greedy:
        return "greedy"
    return (f"temperature {cfg.temperature:g}, top-k {cfg.top_k}, top-p {cfg.top_p:g}, "
            f"min-p {cfg.min_p:g}" + (f", repeat-penalty {cfg.repeat_penalty:g}"
                                      if cfg.repeat_penalty != 1.0 else ""))
