"""Lookup tables of the GGML block formats, as torch tensors.

The IQ grids, the sign table and the non-linear 4-bit codebooks are data, not
code: we take them from our `gguf` dependency (llama.cpp's own gguf-py) so they
can never drift from what llama.cpp writes. The small float tables (e8m0, ue4m3
scales) are computed here from their definitions; every entry is exactly
representable in f32, so there is no rounding to disagree about.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import torch


def _gq():
    """gguf-py's quants module, imported on first use (the package costs ~0.1 s to import)."""
    from gguf import quants
    return quants


def _grid(cls) -> torch.Tensor:
    """gguf-py keeps each grid hex-packed and unpacks it lazily; unpack once, as f32 [n, width]."""
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float32)
    return torch.from_numpy(g.reshape(cls.grid_shape).copy())


@cache
def iq_grid(name: str) -> torch.Tensor:
    """Grid for IQ2_XXS (256x8), IQ2_XS (512x8), IQ2_S (1024x8), IQ3_XXS (256x4),
    IQ3_S (512x4), IQ1_S/IQ1_M (2048x8, values -1/0/1)."""
    return _grid(getattr(_gq(), name))


@cache
def ksigns_f32() -> torch.Tensor:
    """[128, 8] of +-1: the 7 stored sign bits of a group of 8 plus an implied parity bit."""
    ks = np.frombuffer(_gq().IQ2_XXS.ksigns, dtype=np.uint8)
    bits = (ks[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return torch.from_numpy(np.where(bits == 0, 1.0, -1.0).astype(np.float32))


@cache
def kvalues_iq4nl() -> torch.Tensor:
    return torch.tensor(_gq().IQ4_NL.kvalues, dtype=torch.float32)


@cache
def kvalues_fp4() -> torch.Tensor:
    """E2M1 values doubled (MXFP4 and NVFP4 share it; the scales carry the 1/2)."""
    return torch.tensor(_gq().MXFP4.kvalues, dtype=torch.float32)


@cache
def e8m0_half() -> torch.Tensor:
    """MXFP4 scale byte -> 2^(e-127) / 2 (ggml_e8m0_to_fp32_half), all 256 codes."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return torch.from_numpy(bits.view(np.float32).copy())


@cache
def ue4m3_half() -> torch.Tensor:
    """NVFP4 scale byte (unsigned E4M3, bias 7) -> value / 2, all 256 codes.

    Like ggml_ue4m3_to_fp32: 0x00 and 0x7F read as 0, and the top bit is ignored."""
    x = np.arange(256)
    exp, man = (x >> 3) & 0xF, x & 7
    raw = np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * 2.0 ** (exp - 7.0))
    raw = np.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5)
    return torch.from_numpy(raw.astype(np.float32))


@cache
def iq_codebook_bytes() -> bytes:
    """The IQ1-IQ3 codebooks as the native kernels take them (csrc/fk_common.h, fk_iq_tables):
    IQ2_XXS [256, 8] u8, IQ3_XXS [256, 4] u8, IQ3_S [512, 4] u8, IQ1_S [2048, 8] i8, the 128
    sign bytes, IQ2_XS [512, 8] u8, IQ2_S [1024, 8] u8."""
    parts = [iq_grid("IQ2_XXS").numpy().astype(np.uint8), iq_grid("IQ3_XXS").numpy().astype(np.uint8),
             iq_grid("IQ3_S").numpy().astype(np.uint8), iq_grid("IQ1_S").numpy().astype(np.int8),
             np.frombuffer(_gq().IQ2_XXS.ksigns, dtype=np.uint8),
             iq_grid("IQ2_XS").numpy().astype(np.uint8), iq_grid("IQ2_S").numpy().astype(np.uint8)]
    return b"".join(p.tobytes() for p in parts)
