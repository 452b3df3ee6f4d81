"""DeepSeek-V4's small per-row ops as native calls (csrc/fk_dsv4.cpp): the hyper-connection
mixers, the RMS norm and the clamped SwiGLU.

`pre` takes a step's 24 mixes per row (hc_fn of the RMS-normed streams) and the four
streams, and returns the sublayer's input (the streams weighed by sigmoid(.) + eps), the
post weights (2 sigmoid(.)) and the Sinkhorn-normalised 4x4 comb; `post` spreads the
sublayer's output back over the streams and mixes the old ones by the comb. Each is one
call for all rows in the order of ggml's fused CPU ops (llama.cpp's dsv4_hc_pre /
dsv4_hc_comb / dsv4_hc_post). `rms_norm` and `swiglu_clamp` compute as ggml's CPU ops do
(the squares summed in double). `fucina.models.deepseek4` keeps the torch spelling as the
path without native kernels.
"""
from __future__ import annotations

import torch

from fucina import kernels
from fucina.kernels import KernelError

try:
    from fucina.kernels import _native
except ImportError:     # a source checkout whose extensions are not built
    _native = None

HC = 4
MIX = (2 + HC) * HC


def available() -> bool:
    return _native is not None and kernels.available() and hasattr(_native, "hc_pre")


def _f32(*ts: torch.Tensor) -> bool:
    for t in ts:   # a loop, not all(generator): these checks run ~200 times a decode token
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def pre(mix: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix [m, 24], x [m, 4 n], scale [3], base [24] -> h [m, n], post [m, 4], comb [m, 4, 4]."""
    m = mix.shape[0]
    if (not _f32(mix, x, scale, base) or mix.shape != (m, MIX) or x.dim() != 2 or x.shape[0] != m
            or x.shape[1] % HC or x.shape[1] == 0 or scale.numel() != 3 or base.numel() != MIX or iters < 1):
        raise KernelError("hc.pre: mix [m, 24], x [m, 4 n], scale [3] and base [24], f32 and contiguous; "
                          "iters >= 1")
    n = x.shape[1] // HC
    h, post_w, comb = torch.empty(m, n), torch.empty(m, HC), torch.empty(m, HC, HC)
    _native.hc_pre(mix.data_ptr(), x.data_ptr(), scale.data_ptr(), base.data_ptr(), h.data_ptr(),
                   post_w.data_ptr(), comb.data_ptr(), m, n, iters, float(eps))
    return h, post_w, comb


def post(y: torch.Tensor, x: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [m, n], x [m, 4 n], post [m, 4], comb [m, 4, 4] -> the new streams [m, 4 n]."""
    m, n = y.shape[0], y.shape[-1]
    if (not _f32(y, x, post_w, comb) or y.dim() != 2 or x.shape != (m, HC * n) or post_w.shape != (m, HC)
            or comb.shape != (m, HC, HC) or n == 0):
        raise KernelError("hc.post: y [m, n], x [m, 4 n], post [m, 4], comb [m, 4, 4], f32 and contiguous")
    out = torch.empty(m, HC * n)
    _native.hc_post(y.data_ptr(), x.data_ptr(), post_w.data_ptr(), comb.data_ptr(), out.data_ptr(), m, n)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., n] / sqrt(mean(x^2) + eps) over the last dim, times w [n] when given."""
    n = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    if w is not None and not w.is_contiguous():
        w = w.contiguous()
    if not _f32(x) or n == 0 or (w is not None and (not _f32(w) or w.numel() != n)):
        raise KernelError("dsv4.rms_norm: x [..., n] and w [n] (or None), f32")
    out = torch.empty(x.shape)
    _native.rms_norm(x.data_ptr(), 0 if w is None else w.data_ptr(), out.data_ptr(), x.numel() // n, n, float(eps))
    return out


def swiglu_clamp(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, -limit, limit); silu(g) * u when limit <= 1e-6."""
    if not g.is_contiguous():
        g = g.contiguous()
    if not u.is_contiguous():
        u = u.contiguous()
    if not _f32(g, u) or g.shape != u.shape:
        raise KernelError("dsv4.swiglu_clamp: g and u of one shape, f32")
    out = torch.empty(g.shape)
    _native.swiglu_clamp(g.data_ptr(), u.data_ptr(), out.data_ptr(), g.numel(), float(limit))
    return out
