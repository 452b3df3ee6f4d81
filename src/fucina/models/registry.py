"""One registry: `general.architecture` -> the family module that implements it, and its
torch-free schema (`fucina.models.schema.<family>`: config and tensors).

Torch-free: `fucina.load()` checks the architecture, the family's config and every tensor
the decoder will read here (`check`) without importing a family module (each imports
torch); the decoder is built later, from the same schema."""
from __future__ import annotations

import importlib
import os

import numpy as np

from fucina.errors import GGUFError, UnsupportedArchitecture
from fucina.gguf import GGUFFile, meta_int_opt

FAMILIES: dict[str, str] = {
    "llama": "fucina.models.llama",
    "qwen3": "fucina.models.qwen3",
    "gemma3": "fucina.models.gemma3",
    "qwen2": "fucina.models.qwen2",
    "phi3": "fucina.models.phi3",
    "qwen35": "fucina.models.qwen35",
    "qwen35moe": "fucina.models.qwen35moe",
    "deepseek2": "fucina.models.deepseek2",
    "deepseek4": "fucina.models.deepseek4",
    "kimi-linear": "fucina.models.kimi_linear",
    "kimi-k3": "fucina.models.kimi_k3",
    "gemma4": "fucina.models.gemma4",
    "qwen3moe": "fucina.models.qwen3moe",
    "glm4moe": "fucina.models.glm4moe",
    "bitnet": "fucina.models.bitnet",
    "gpt-oss": "fucina.models.gpt_oss",
    "dream": "fucina.models.dream",
    "llada": "fucina.models.llada",
    "diffusion-gemma": "fucina.models.diffusion_gemma",
}


def family_module(arch: str) -> str:
    """The module name of `arch`'s family (not imported), or UnsupportedArchitecture."""
    try:
        return FAMILIES[arch]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        ) from None


def family(arch: str):
    return importlib.import_module(family_module(arch))


def schema_module(arch: str) -> str:
    """The module name of `arch`'s torch-free schema (not imported)."""
    return "fucina.models.schema." + family_module(arch).rsplit(".", 1)[1]


def check(f: GGUFFile):
    """`f` checked against its family's schema, without torch: the config (required
    metadata, consistency), then every tensor the decoder reads (present, shaped as the
    config says). Returns the checked `schema.base.Tensors` (with `.config`); raises the
    GGUFError the decoder build would."""
    return importlib.import_module(schema_module(f.architecture)).Schema.check(f)


def context_length(f: GGUFFile) -> int:
    """The trained context (`<arch>.context_length`) as every family's config reads it:
    absent, zero or negative -> 4096; a value that is not an integer is a GGUFError."""
    key = f"{f.architecture}.context_length"
    v = meta_int_opt(f.metadata, f.architecture, "context_length")
    if v is None and key in f.metadata and not isinstance(f.metadata[key], (int, np.integer)):
        raise GGUFError(f"metadata {key} = {f.metadata[key]!r} is not an integer")
    return 4096 if v is None else v


def load_model(path_or_file: str | os.PathLike | GGUFFile, checked=None, group_experts: bool = True):
    """Open a GGUF and build its family's Model (weights stay in the mmap); `checked`: the
    table `check(f)` returned for this file (the build then checks nothing again).
    `group_experts=False` leaves the expert stacks in the file's rows: for a model whose
    experts an expert store will stream (`stream_experts`), so they are never copied."""
    from fucina import kernels
    from fucina.weights.row_groups import interleave_model

    kernels.warn_if_missing()
    f = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
    model = family(f.architecture).Model(f, checked)
    model.gguf = f
    interleave_model(model, experts=group_experts)   # row groups where the ISA's decode GEMV reads them (fucina.weights.row_groups)
    return model
