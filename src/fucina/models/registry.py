"""One registry: `general.architecture` -> the family module that implements it."""
from __future__ import annotations

import importlib
import os

from fucina.errors import UnsupportedArchitecture
from fucina.gguf import GGUFFile

FAMILIES: dict[str, str] = {
    "llama": "fucina.models.llama",
    "qwen3": "fucina.models.qwen3",
    "gemma3": "fucina.models.gemma3",
    "qwen2": "fucina.models.qwen2",
    "phi3": "fucina.models.phi3",
    "qwen35": "fucina.models.qwen35",
    "qwen35moe": "fucina.models.qwen35moe",
    "deepseek2": "fucina.models.deepseek2",
    "gemma4": "fucina.models.gemma4",
    "qwen3moe": "fucina.models.qwen3moe",
}


def family(arch: str):
    try:
        return importlib.import_module(FAMILIES[arch])
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        ) from None


def load_model(path_or_file: str | os.PathLike | GGUFFile):
    """Open a GGUF and build its family's Model (weights stay in the mmap)."""
    f = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
    model = family(f.architecture).Model(f)
    model.gguf = f
    return model
