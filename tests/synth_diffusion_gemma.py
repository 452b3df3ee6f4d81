"""Random-weight diffusion-gemma GGUFs, written from the family's description (no public
file exists): Gemma 4's keys and tensors under the `diffusion-gemma` architecture (no
per-layer embeddings), `diffusion.canvas_length`, optional `diffusion.eb_*` overrides,
both per-layer output scales (`layer_output_scale` for the canvas pass,
`enc_layer_output_scale` for the encoder pass) and, unless `self_cond=False`, the
self-conditioning GeGLU MLP (`self_cond_pre_norm`, `self_cond_gate/up` [ffn, hidden],
`self_cond_down` [hidden, ffn]).

`twin=True` writes the plain gemma4 file with the same backbone weights (the same draws
in the same order): the canvas pass is checked against gemma4's forward on it."""
from __future__ import annotations

import numpy as np

from synth_gemma4 import write_gemma4

GEOMETRY = dict(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, window=8)


def write_diffusion_gemma(path, *, canvas: int = 16, self_cond: bool = True, enc_scale: bool = True,
                          eb: dict | None = None, seed: int = 0, twin: bool = False, **kw) -> str:
    g = {**GEOMETRY, **kw}
    if twin:
        return write_gemma4(path, ple=0, seed=seed, **g)
    rng = np.random.default_rng(seed + 1000)
    H, F = g["hidden"], g["ffn"]
    tensors = {}
    if enc_scale:
        for i in range(g["layers"]):
            tensors[f"blk.{i}.enc_layer_output_scale.weight"] = np.array([0.5 + rng.random()], dtype=np.float32)
    if self_cond:
        tensors["self_cond_pre_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)
        tensors["self_cond_gate.weight"] = (rng.standard_normal((F, H)) / np.sqrt(H)).astype(np.float32)
        tensors["self_cond_up.weight"] = (rng.standard_normal((F, H)) / np.sqrt(H)).astype(np.float32)
        tensors["self_cond_down.weight"] = (rng.standard_normal((H, F)) / np.sqrt(F)).astype(np.float32)
    extra = {"diffusion.canvas_length": canvas} if canvas else {}
    for name, v in (eb or {}).items():
        extra[f"diffusion.eb_{name}"] = v
    return write_gemma4(path, ple=0, seed=seed, arch="diffusion-gemma", extra=extra, extra_tensors=tensors, **g)
