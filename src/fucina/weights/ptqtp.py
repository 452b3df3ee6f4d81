"""PtqtpWeight: a matrix as K PTQTP trit-planes (fucina.quant.ptqtp), y = sum_k x @ P_k^T.

The K planes are TQ2_0 matrices of the same shape; they are kept stacked as one
[K * out, in] TQ2_0 LinearWeight, so one native call quantizes the activations once and
runs every plane in one pass over the weights (the canonical route: each output is one
fixed formula whatever the rows computed with it), and the K slices of its output are
summed in plane order. That equals the per-plane sum bit for bit (`per_plane`, the
reference the tests hold it to).
"""
from __future__ import annotations

import numpy as np
import torch

from fucina.errors import QuantError
from fucina.gguf import GGMLType
from fucina.weights.linear import LinearWeight


class PtqtpWeight:
    def __init__(self, planes: list[np.ndarray], out_features: int, in_features: int, name: str = ""):
        if not 1 <= len(planes) <= 3:
            raise QuantError(f"{name}: PTQTP takes 1, 2 or 3 planes, not {len(planes)}")
        self.k = len(planes)
        self.out_features, self.in_features, self.name = out_features, in_features, name
        raw = torch.cat([torch.as_tensor(np.ascontiguousarray(p)).reshape(out_features, -1) for p in planes])
        self.stacked = LinearWeight(raw, GGMLType.TQ2_0, self.k * out_features, in_features, name)
        from fucina.kernels import attach
        attach(self.stacked)

    @classmethod
    def from_fit(cls, fit, name: str = "") -> "PtqtpWeight":
        from fucina.quant.ptqtp import plane_bytes
        K, n, k = fit.trits.shape
        return cls([plane_bytes(fit, p) for p in range(K)], n, k, name)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def plane(self, p: int) -> LinearWeight:
        """Plane p alone (a view of the stacked bytes)."""
        n = self.out_features
        w = LinearWeight(self.stacked.raw[p * n:(p + 1) * n], GGMLType.TQ2_0, n, self.in_features, f"{self.name}.ptqtp{p}")
        from fucina.kernels import attach
        attach(w)
        return w

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stacked(x)
        n = self.out_features
        out = y[..., :n]
        for p in range(1, self.k):
            out = out + y[..., p * n:(p + 1) * n]
        return out.contiguous()

    __call__ = linear

    def per_plane(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: each plane's own matmul, summed in plane order."""
        out = self.plane(0)(x)
        for p in range(1, self.k):
            out = out + self.plane(p)(x)
        return out

    def dequantize(self) -> torch.Tensor:
        w = self.stacked.dequantize().view(self.k, self.out_features, self.in_features)
        out = w[0]
        for p in range(1, self.k):
            out = out + w[p]
        return out

    def __repr__(self) -> str:
        return f"PtqtpWeight({self.name!r}, K={self.k}, {self.shape})"
