"""The GGML tensor type table: block size and bytes per block for every type.

Constants come from the `gguf` package (llama.cpp's own gguf-py), so the ids
and sizes always match the files llama.cpp writes.
"""
from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGMLType = GGMLQuantizationType

#: type -> (elements per block, bytes per block)
TYPE_SIZES: dict[GGMLType, tuple[int, int]] = dict(GGML_QUANT_SIZES)
# gguf 0.19 still lists Q8_1 with two f32 fields (40 B); ggml's block_q8_1 is two f16 + 32 int8.
TYPE_SIZES[GGMLType.Q8_1] = (32, 36)


def type_name(t: int) -> str:
    try:
        return GGMLType(t).name
    except ValueError:
        return f"type#{t}"


def tensor_nbytes(t: GGMLType, n_elements: int) -> int:
    block, size = TYPE_SIZES[t]
    return n_elements // block * size
