"""diffusion-gemma's schema (torch-free): Gemma 4's config and layers under the
`diffusion-gemma.` key prefix, plus what block text-diffusion adds (models/diffusion_gemma.py):

- `diffusion.canvas_length` (required): the positions one canvas denoises at once;
- `diffusion.eb_*` (optional): the entropy-bound sampler's settings, defaults from the
  reference generation config (EbParams);
- per layer, both output scales are required: `layer_output_scale` (the canvas pass)
  and `enc_layer_output_scale` (the causal encoder pass over the prompt and every
  committed canvas);
- optional self-conditioning MLP: `self_cond_pre_norm`, `self_cond_gate`/`_up`
  [n_ff, n_embd], `self_cond_down` [n_embd, n_ff] (all four or none);
- no per-layer embeddings (the family has none).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fucina.errors import GGUFError, UnsupportedArchitecture
from fucina.gguf import GGUFFile
from fucina.models.schema import gemma4, llama
from fucina.models.schema.base import Tensors

CANVAS_KEY = "diffusion.canvas_length"
SCALES = (llama.norm("layer_output_scale", "one"), llama.norm("enc_layer_output_scale", "one"))
SELF_COND = ("self_cond_pre_norm", "self_cond_gate", "self_cond_up", "self_cond_down")


@dataclass(frozen=True)
class EbParams:
    """The entropy-bound sampler: `max_steps` denoising steps per canvas, temperature from
    t_max (first step) to t_min (last), positions accepted while the summed entropy of the
    lower-entropy ones stays within `entropy_bound`, and an early stop once the argmax
    canvas held still `stability_threshold` steps with mean entropy under
    `confidence_threshold`."""
    max_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    KEYS = {"max_steps": "diffusion.eb_max_steps", "t_min": "diffusion.eb_t_min", "t_max": "diffusion.eb_t_max",
            "entropy_bound": "diffusion.eb_entropy_bound", "stability_threshold": "diffusion.eb_stability_threshold",
            "confidence_threshold": "diffusion.eb_confidence_threshold"}

    @classmethod
    def from_metadata(cls, m: dict, path: str = "") -> "EbParams":
        kw = {}
        for name, key in cls.KEYS.items():
            v = m.get(key)
            if v is None:
                continue
            kind = type(getattr(cls, name))
            try:
                kw[name] = kind(v)
            except (TypeError, ValueError):
                raise GGUFError(f"{path}: {key} = {v!r} is not a number") from None
        return cls(**kw)


@dataclass
class Config(gemma4.Config):
    canvas_length: int = 0
    eb: EbParams = field(default_factory=EbParams)

    def finish(self, f: GGUFFile) -> None:
        super().finish(f)
        if self.n_embd_per_layer:
            raise UnsupportedArchitecture(f"{f.path}: diffusion-gemma has no per-layer embeddings "
                                          f"({self.arch}.embedding_length_per_layer_input must be 0)")
        v = f.metadata.get(CANVAS_KEY)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise GGUFError(f"{f.path}: a diffusion-gemma file needs {CANVAS_KEY} (a positive canvas length), "
                            f"got {v!r}")
        self.canvas_length = int(v)
        self.eb = EbParams.from_metadata(f.metadata, f.path)


class Schema(gemma4.Schema):
    config_class = Config

    @classmethod
    def check_layer(cls, t: Tensors, i: int) -> None:
        super().check_layer(t, i)
        t.layer(i, SCALES, dict(one=1))     # both required: missing -> the GGUFError naming it

    @classmethod
    def check_extras(cls, t: Tensors) -> None:
        super().check_extras(t)
        c, f = t.config, t.f
        have = [n for n in SELF_COND if f"{n}.weight" in f.tensors]
        if have and len(have) != len(SELF_COND):
            raise GGUFError(f"{f.path}: the self-conditioning MLP needs all of "
                            f"{', '.join(n + '.weight' for n in SELF_COND)} (has {', '.join(have)})")
        if have:
            E, F = c.n_embd, c.n_ff
            t.want("self_cond_pre_norm.weight", (E,))
            t.want("self_cond_gate.weight", (F, E))
            t.want("self_cond_up.weight", (F, E))
            t.want("self_cond_down.weight", (E, F))
