"""Block geometry of every GGML type, and the checks every entry point shares."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from fucina.errors import QuantError
from fucina.gguf import TYPE_SIZES as _GGUF_SIZES
from fucina.gguf import GGMLType, type_name

#: type -> (elements per block, bytes per block), as ggml lays the blocks out. gguf-py 0.19
#: still lists Q8_1 at 40 bytes (two f32s, an old layout); ggml's block_q8_1 is two f16s and
#: 32 int8s = 36 bytes, and newer gguf-py agrees.
TYPE_SIZES: dict[GGMLType, tuple[int, int]] = {**_GGUF_SIZES, GGMLType.Q8_1: (32, 36)}


def as_type(qtype) -> GGMLType:
    """Accept a GGMLType or its integer id; anything else is a QuantError."""
    try:
        t = GGMLType(qtype)
    except (ValueError, TypeError):
        raise QuantError(f"unknown GGML type {qtype!r}") from None
    if t not in TYPE_SIZES:
        raise QuantError(f"GGML type {t.name} has no block layout")
    return t


def block_size(qtype) -> int:
    """Elements per block."""
    return TYPE_SIZES[as_type(qtype)][0]


def type_size(qtype) -> int:
    """Bytes per block."""
    return TYPE_SIZES[as_type(qtype)][1]


def row_bytes(qtype, n: int) -> int:
    """Bytes holding `n` elements; `n` must be a whole number of blocks."""
    bs, ts = TYPE_SIZES[as_type(qtype)]
    if n < 0 or n % bs:
        raise QuantError(f"{type_name(qtype)}: {n} elements is not a whole number of {bs}-element blocks")
    return n // bs * ts


def as_bytes(data) -> torch.Tensor:
    """A flat torch uint8 view of `data` (numpy array, torch tensor, bytes-like), without copying
    when it is already contiguous. A read-only buffer (an mmap view) is wrapped as is: torch warns
    that it cannot mark it read-only, and we never write to it, so that one warning is silenced."""
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.dtype != torch.uint8:
            t = t.contiguous().view(torch.uint8)
        return t.reshape(-1)
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = np.frombuffer(data, dtype=np.uint8)
    if not isinstance(data, np.ndarray):
        raise QuantError(f"expected a uint8 numpy array or torch tensor, got {type(data).__name__}")
    a = np.ascontiguousarray(data).reshape(-1)
    if a.dtype != np.uint8:
        a = a.view(np.uint8)
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(a)
