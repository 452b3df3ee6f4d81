"""PtqtpWeight: a matrix as K PTQTP trit-planes (fucina.quant.ptqtp), y = sum_k x @ P_k^T.

The K planes are TQ2_0 matrices of the same shape; they are kept stacked as one
[K * out, in] TQ2_0 matrix. With native kernels one call (kernels.attach_ptqtp,
csrc/generic/ptqtp_impl.inc) quantizes the activations once, runs every plane in one pass
over the weights on the canonical route (each output is one fixed formula whatever the
rows computed with it) and sums the K outputs in plane order; the decoder's layer step
takes the weight like any other. That equals the per-plane sum bit for bit (`per_plane`,
the reference the tests hold it to). Loaded from a GGUF's `<name>.ptqtpN` planes
(fucina.gguf.ptqtp) by `LinearWeight.from_tensor`.

A scale-tied K=2 weight (`tied`: every group's plane scales 3 s and s) is held folded
instead, one plane of 9-level codes (fucina.quant.ptqtp.fold_bytes, about the two planes'
bytes): the kernel (FK_PTQTP_FOLD) runs one integer dot a block, and its result, not the
per-plane sum, is the canonical one (`fold_reference`); its planes are rebuilt on demand.
"""
from __future__ import annotations

import numpy as np
import torch

from fucina.errors import GGUFError, QuantError
from fucina.gguf import GGMLType
from fucina.weights.linear import LinearWeight, bytes_view


class PtqtpWeight:
    def __init__(self, planes: list, out_features: int, in_features: int, name: str = "", tied: bool = False):
        if not 1 <= len(planes) <= 3:
            raise QuantError(f"{name}: PTQTP takes 1, 2 or 3 planes, not {len(planes)}")
        if tied and len(planes) != 2:
            raise QuantError(f"{name}: a scale-tied PTQTP weight has 2 planes, not {len(planes)}")
        self.k, self.tied = len(planes), tied
        self.out_features, self.in_features, self.name = out_features, in_features, name
        parts = [p if isinstance(p, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(p)) for p in planes]
        from fucina.kernels import attach, attach_ptqtp
        self.stacked = self.folded = None
        if tied:
            from fucina.quant.ptqtp import fold_bytes
            self.folded = torch.from_numpy(fold_bytes(*(p.numpy() for p in parts), out_features, name))
        else:
            raw = parts[0].reshape(out_features, -1) if self.k == 1 else torch.cat(
                [p.reshape(out_features, -1) for p in parts])
            self.stacked = LinearWeight(raw, GGMLType.TQ2_0, self.k * out_features, in_features, name)
            attach(self.stacked)
        attach_ptqtp(self)

    @classmethod
    def from_fit(cls, fit, name: str = "") -> "PtqtpWeight":
        from fucina.quant.ptqtp import plane_bytes
        K, n, k = fit.trits.shape
        return cls([plane_bytes(fit, p) for p in range(K)], n, k, name, tied=fit.tied)

    @classmethod
    def from_info(cls, info) -> "PtqtpWeight":
        """A GGUF's decorated matrix (fucina.gguf.ptqtp.PtqtpInfo): its planes' bytes, in order."""
        k = info.ne[0]
        n = info.n_elements // k
        try:
            return cls([bytes_view(t.data) for t in info.planes], n, k, info.name, tied=info.tied)
        except QuantError as e:
            raise GGUFError(f"{info.name}: {e}") from None

    @classmethod
    def fuse(cls, parts: list["PtqtpWeight"], name: str = "") -> "PtqtpWeight | None":
        """Stack weights along the output dim plane by plane (fused QKV, gate/up): the same
        bytes as decorating the stacked matrix. None when plane counts or in-dims differ."""
        if not parts or len({(p.k, p.in_features, p.tied) for p in parts}) != 1:
            return None
        K = parts[0].k
        planes = [torch.cat([p.plane_raw(i) for p in parts]) for i in range(K)]
        return cls(planes, sum(p.out_features for p in parts), parts[0].in_features,
                   name or "+".join(p.name for p in parts), tied=parts[0].tied)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.folded.nbytes if self.tied else self.stacked.nbytes

    def plane_raw(self, p: int) -> torch.Tensor:
        n = self.out_features
        if self.tied:
            from fucina.quant.ptqtp import unfold_planes
            return torch.from_numpy(unfold_planes(self.folded.numpy(), n)[p])
        return self.stacked.raw[p * n:(p + 1) * n]

    def plane(self, p: int) -> LinearWeight:
        """Plane p alone (a view of the stacked bytes)."""
        w = LinearWeight(self.plane_raw(p), GGMLType.TQ2_0, self.out_features, self.in_features,
                         f"{self.name}.ptqtp{p}")
        from fucina.kernels import attach
        attach(w)
        return w

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        if self.tied:
            return (x.float() @ self.dequantize().T).contiguous()
        y = self.stacked(x)
        n = self.out_features
        out = y[..., :n]
        for p in range(1, self.k):
            out = out + y[..., p * n:(p + 1) * n]
        return out.contiguous()

    __call__ = linear

    def per_plane(self, x: torch.Tensor) -> torch.Tensor:
        """The reference of an untied weight: each plane's own matmul, summed in plane order
        (a tied weight's canonical result is the folded one: `fold_reference`)."""
        out = self.plane(0)(x)
        for p in range(1, self.k):
            out = out + self.plane(p)(x)
        return out

    def fold_reference(self, x: torch.Tensor) -> torch.Tensor:
        """A tied weight's reference in f64, which its folded kernel equals to float rounding:
        x through the kernels' int8 activation round trip, against the folded matrix."""
        import fucina.kernels as K

        k = self.in_features
        xr = K.act_roundtrip(x.reshape(-1, k)).reshape(-1, k).double()
        return (xr @ self.dequantize().double().T).reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        if self.tied:   # s c: the same values as the planes' sum, exactly
            from fucina.quant.ptqtp import fold_dequantize
            return fold_dequantize(self.folded.numpy(), self.out_features, self.in_features)
        w = self.stacked.dequantize().view(self.k, self.out_features, self.in_features)
        out = w[0]
        for p in range(1, self.k):
            out = out + w[p]
        return out

    def __repr__(self) -> str:
        return f"PtqtpWeight({self.name!r}, K={self.k}{', tied' if self.tied else ''}, {self.shape})"
