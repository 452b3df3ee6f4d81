"""LinearWeight: one weight matrix kept in its GGUF type.

The bytes stay where the loader found them (a zero-copy view of the mmap), so
resident memory is about the file's size. `linear` routes to a native kernel for
the formats `fucina.kernels` covers and falls back to dequantize + torch matmul
(the reference path every kernel is tested against).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from fucina.errors import FucinaError
from fucina.gguf import TYPE_SIZES, GGMLType, TensorInfo
from fucina.quant import dequantize, dequantize_rows

_FLOAT_DTYPES = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16,
                 GGMLType.BF16: torch.bfloat16}


def bytes_view(arr: np.ndarray) -> torch.Tensor:
    """A uint8 torch tensor over a (possibly read-only) numpy buffer, without copying."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap: we never write to it
        return torch.from_numpy(arr)


class LinearWeight:
    """y = x @ W.T for W of shape [out_features, in_features] stored as GGML blocks."""

    def __init__(self, raw: torch.Tensor, qtype: GGMLType, out_features: int, in_features: int,
                 name: str = ""):
        block, size = TYPE_SIZES[qtype]
        if in_features % block:
            raise FucinaError(f"{name}: row length {in_features} not a multiple of {qtype.name} block {block}")
        row_bytes = in_features // block * size
        if raw.dtype != torch.uint8 or raw.numel() != out_features * row_bytes:
            raise FucinaError(f"{name}: {raw.numel()} bytes do not hold a {qtype.name} "
                              f"[{out_features}, {in_features}] matrix")
        self.raw = raw.reshape(out_features, row_bytes)
        self.qtype = GGMLType(qtype)   # ints and gguf-py's enum alike: `is` checks below
        self.out_features = out_features
        self.in_features = in_features
        self.name = name
        self.kernel = None  # set by fucina.kernels when a native route exists

    @classmethod
    def from_tensor(cls, t: TensorInfo) -> "LinearWeight":
        if getattr(t, "planes", None):   # a PTQTP-decorated matrix (fucina.gguf.ptqtp): its planes
            from fucina.weights.ptqtp import PtqtpWeight
            return PtqtpWeight.from_info(t)
        if len(t.ne) == 1:
            in_f, out_f = t.ne[0], 1
        else:
            in_f = t.ne[0]
            out_f = t.n_elements // in_f
        w = cls(bytes_view(t.data), t.ggml_type, out_f, in_f, t.name)
        from fucina.kernels import attach  # lazy: kernels are optional at import time
        attach(w)
        return w

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as f32 [out, in] (reference path; allocates)."""
        ft = _FLOAT_DTYPES.get(self.qtype)
        if ft is not None:
            return self.raw.view(ft).reshape(self.shape).float()
        return dequantize(self.raw.reshape(-1), self.qtype, self.out_features * self.in_features
                          ).reshape(self.shape)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise FucinaError(f"{self.name}: input has {x.shape[-1]} features, weight expects "
                              f"{self.in_features}")
        if self.kernel is not None:
            return self.kernel(x)
        if self.qtype is GGMLType.F32:
            return x @ self.raw.view(torch.float32).reshape(self.shape).T
        return x @ self.dequantize().T

    __call__ = linear

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as f32 [len(ids), in] (embedding lookup)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise FucinaError(f"{self.name}: token id out of range [0, {self.out_features})")
        if self.kernel is not None:   # native: ~100x faster than the torch reference per row
            return self.kernel.rows(ids)
        ft = _FLOAT_DTYPES.get(self.qtype)
        if ft is not None:
            return self.raw[ids].view(ft).float()
        return dequantize_rows(self.raw, self.qtype, ids, self.in_features)

    def to_f16(self) -> torch.Tensor:
        return self.dequantize().half()

    @classmethod
    def fuse(cls, parts: list["LinearWeight"], name: str = "") -> "LinearWeight":
        """Stack weights along the output dim (fused QKV, gate/up). Same type and in_features
        required; mixed types are the caller's to handle (keep them separate)."""
        if not parts:
            raise FucinaError("fuse: no parts")
        t, k = parts[0].qtype, parts[0].in_features
        if any(p.qtype is not t or p.in_features != k for p in parts):
            raise FucinaError("fuse: parts differ in type or in_features")
        raw = torch.cat([p.raw for p in parts], dim=0)  # one copy; callers drop the parts
        w = cls(raw, t, sum(p.out_features for p in parts), k, name or "+".join(p.name for p in parts))
        from fucina.kernels import attach
        attach(w)
        return w

    def __repr__(self) -> str:
        return f"LinearWeight({self.name!r}, {self.qtype.name}, {self.shape})"
