"""The GGML tensor type table: block size and bytes per block for every type.

Constants come from the `gguf` package (llama.cpp's own gguf-py), so the ids
and sizes always match the files llama.cpp writes.
"""
from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGMLType = GGMLQuantizationType

#: type -> (elements per block, bytes per block)
TYPE_SIZES: dict[GGMLType, tuple[int, int]] = dict(GGML_QUANT_SIZES)


def type_name(t: int) -> str:
    try:
        return GGMLType(t).name
    except ValueError:
        return f"type#{t}"


def tensor_nbytes(t: GGMLType, n_elements: int) -> int:
    block, size = TYPE_SIZES[t]
    return n_elements // block * size
