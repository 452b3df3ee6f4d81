"""DeepSeek-V4's hyper-connection mixers as native calls (csrc/fk_hc.cpp).

`pre` takes a step's 24 mixes per row (hc_fn of the RMS-normed streams) and the four
streams, and returns the sublayer's input (the streams weighed by sigmoid(.) + eps), the
post weights (2 sigmoid(.)) and the Sinkhorn-normalised 4x4 comb; `post` spreads the
sublayer's output back over the streams and mixes the old ones by the comb. Each is one
call for all rows in the order of ggml's fused CPU ops (llama.cpp's dsv4_hc_pre /
dsv4_hc_comb / dsv4_hc_post); `fucina.models.deepseek4` keeps the torch spelling as the
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
    return all(t.dtype is torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in ts)


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
