"""The sampling a front end uses when the caller names none.

A GGUF may carry its authors' recommendation (`general.sampling.*`, written by
llama.cpp's converter from generation_config.json); otherwise llama.cpp's own
defaults apply (common/common.h: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05).
Every call without a seed draws a fresh one, as llama.cpp and OpenAI do; greedy
(temperature 0) never touches the RNG. `fucina run`, the parity tool, stays greedy.
"""
from __future__ import annotations

import random
from typing import Any, Mapping

from fucina.errors import FucinaError
from fucina.text.sampler import SamplingConfig

#: llama.cpp's common_params_sampling defaults for the stages fucina implements.
LLAMA_CPP_DEFAULTS = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)

#: general.sampling.<key> -> SamplingConfig field, and the type it must have.
_GGUF_KEYS = {"temp": ("temperature", float), "top_k": ("top_k", int), "top_p": ("top_p", float),
              "min_p": ("min_p", float), "penalty_repeat": ("repeat_penalty", float),
              "penalty_last_n": ("repeat_last_n", int)}


def recommended(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The model's own sampling recommendation, as SamplingConfig keywords (values that
    do not parse, or that SamplingConfig would refuse, are ignored)."""
    out: dict[str, Any] = {}
    for key, (name, kind) in _GGUF_KEYS.items():
        v = (metadata or {}).get("general.sampling." + key)
        if v is None or isinstance(v, (bool, str, list)):
            continue
        try:
            v = kind(v)
            SamplingConfig(**{name: v})
        except (TypeError, ValueError, OverflowError, FucinaError):    # a bad key is skipped
            continue
        out[name] = v
    return out


def default_sampling(metadata: Mapping[str, Any] | None = None) -> SamplingConfig:
    """llama.cpp's defaults overlaid with the model's recommendation (seed left at 0:
    `fresh_seed` picks one per call)."""
    return SamplingConfig.from_kwargs(LLAMA_CPP_DEFAULTS, **recommended(metadata))


def fresh_seed() -> int:
    return random.SystemRandom().getrandbits(32)


def describe(cfg: SamplingConfig) -> str:
    """One line for banners and logs."""
    if cfg.greedy:
        return "greedy"
    return (f"temperature {cfg.temperature:g}, top-k {cfg.top_k}, top-p {cfg.top_p:g}, "
            f"min-p {cfg.min_p:g}" + (f", repeat-penalty {cfg.repeat_penalty:g}"
                                      if cfg.repeat_penalty != 1.0 else ""))
