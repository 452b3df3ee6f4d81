"""One Engram layer's parameters and its differentiable forward, for a plain residual
stream (the reference's hc_mult = 1 case).

Per position t, with e = the gathered head rows of its n-grams, flattened [E]:
    gate  = sigmoid(ssqrt(<rms(W_k e + b_k) * g_k, rms(h) * g_q> / sqrt(d)))
            ssqrt(z) = sign(z) * sqrt(max(|z|, 1e-6)),  rms eps = f32 eps (torch's default)
    value = gate * (W_v e + b_v)
    out   = value + silu(conv(rms(value) * g_c))      rms eps 1e-5
where conv is a causal depthwise conv1d of `kernel` taps, dilation = max_ngram, no bias.
The caller adds `out` to the residual. `graft=True` zero-initialises W_v and b_v, so out
is exactly zero (the graft is the identity bitwise) while every parameter still gets a
gradient through the value path.

The conv streams: `forward(x, rows, prev)` reads the previous (kernel - 1) * dilation
normed value rows `prev` (zeros before the sequence's start) and returns this call's
normed rows for the next call, so a sequence run in pieces equals it run whole.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

F32_EPS = torch.finfo(torch.float32).eps
CONV_EPS = 1e-5
PARAMS = ("table", "key_w", "key_b", "key_norm", "query_norm", "value_w", "value_b", "conv_norm", "conv_w")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class EngramLayer(torch.nn.Module):
    def __init__(self, table_rows: int, n_embd: int, head_dim: int, n_heads: int, kernel: int, dilation: int,
                 *, graft: bool = True, generator: torch.Generator | None = None):
        super().__init__()
        self.n_embd, self.head_dim, self.n_heads = n_embd, head_dim, n_heads
        self.kernel, self.dilation = kernel, dilation
        e = head_dim * n_heads
        g = generator
        u = lambda shape, bound: (torch.rand(shape, generator=g) * 2 - 1) * bound   # noqa: E731 (nn.Linear's init)
        self.table = torch.nn.Parameter(torch.randn(table_rows, head_dim, generator=g))
        self.key_w = torch.nn.Parameter(u((n_embd, e), 1 / math.sqrt(e)))
        self.key_b = torch.nn.Parameter(u((n_embd,), 1 / math.sqrt(e)))
        self.key_norm = torch.nn.Parameter(torch.ones(n_embd))
        self.query_norm = torch.nn.Parameter(torch.ones(n_embd))
        if graft:
            self.value_w = torch.nn.Parameter(torch.zeros(n_embd, e))
            self.value_b = torch.nn.Parameter(torch.zeros(n_embd))
        else:
            self.value_w = torch.nn.Parameter(u((n_embd, e), 1 / math.sqrt(e)))
            self.value_b = torch.nn.Parameter(u((n_embd,), 1 / math.sqrt(e)))
        self.conv_norm = torch.nn.Parameter(torch.ones(n_embd))
        self.conv_w = torch.nn.Parameter(u((n_embd, kernel), 1 / math.sqrt(kernel)))

    @property
    def history(self) -> int:
        """Normed value rows the conv reads before a call's first position."""
        return (self.kernel - 1) * self.dilation

    def forward(self, x: torch.Tensor, rows: torch.Tensor, prev: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, n_embd] the residual entering the layer, rows [T, heads] int64 (offsets
        included), prev [history, n_embd] or None (the sequence starts here) ->
        (out [T, n_embd], this call's normed value rows [T, n_embd])."""
        d, t = self.n_embd, x.shape[0]
        emb = F.embedding(rows, self.table).reshape(t, -1)
        key = _rms(F.linear(emb, self.key_w, self.key_b), self.key_norm, F32_EPS)
        z = (key * _rms(x, self.query_norm, F32_EPS)).sum(-1) / math.sqrt(d)
        gate = torch.sigmoid(z.abs().clamp_min(1e-6).sqrt() * z.sign()).unsqueeze(-1)
        value = gate * F.linear(emb, self.value_w, self.value_b)
        vn = _rms(value, self.conv_norm, CONV_EPS)
        p = self.history
        if prev is None:
            prev = vn.new_zeros(p, d)
        padded = torch.cat([prev.to(vn.dtype), vn])
        y = padded[0:t] * self.conv_w[:, 0]
        for j in range(1, self.kernel):
            y = y + padded[j * self.dilation:j * self.dilation + t] * self.conv_w[:, j]
        return value + F.silu(y), vn
