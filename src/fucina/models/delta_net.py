"""Gated DeltaNet (the linear-attention mixer of Qwen3.5 / Qwen3-Next), in plain torch.

Per value head, a state matrix S [d_k, d_v] is carried from token to token:
    S = S * exp(g_t)                       g_t <= 0: the gated decay
    u = (v_t - S^T k_t) * beta_t           the delta rule: correct S's prediction of v_t
    S = S + k_t u^T
    o_t = S^T q_t / sqrt(d_k)
with q and k L2-normalized and short-convolved first (a causal depthwise conv over the
last `d_conv` inputs, whose window is the other half of the layer's state).

Two schedules compute the same recurrence: `sequential` (one token at a time, every
intermediate state available: decode, snapshots) and `chunked` (chunks of 64 tokens as
a few matmuls each: WY form, a unit-lower-triangular solve per chunk, then one state
hand-off per chunk), the prefill route. Both follow ggml's gated_delta_net op (b11434):
v head j reads k/q head j % n_k_heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [m, ch] after `window` [d_conv - 1, ch] (the previous
    inputs) with weight [ch, d_conv] (tap d_conv - 1 is the current input), no bias.
    Returns (out [m, ch], the padded input [d_conv - 1 + m, ch]) — its last d_conv - 1
    rows are the next window, and rows [p + 1, p + d_conv) the window after row p."""
    full = torch.cat([window.to(x.dtype), x], dim=0)
    # elementwise, not conv1d: at decode (m = 1) a oneDNN call costs more than the math
    out = (full.unfold(0, weight.shape[1], 1) * weight.to(x.dtype)).sum(-1)
    return out, full


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (ggml: rms_norm(x, eps/n) / sqrt(n))."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def expand_heads(x: torch.Tensor, n_v: int) -> torch.Tensor:
    """[m, H_k, d] -> [m, n_v, d]: v head j reads head j % H_k (ggml's tiling)."""
    h_k = x.shape[1]
    return x if h_k == n_v else x[:, torch.arange(n_v) % h_k]


def sequential(q, k, v, g, beta, state, keep_states: int = 0):
    """The recurrence token by token. q, k [m, H, d_k] (normalized, expanded), v [m, H, d_v],
    g, beta [m, H] (g [m, H, d_k]: a decay per key channel, KDA's, models/kda.py), state
    [H, d_k, d_v] (not modified). Returns (o [m, H, d_v], final state, the states after each
    of the last `keep_states` tokens, oldest first)."""
    m, scale = q.shape[0], q.shape[-1] ** -0.5
    s = state.clone()
    out, kept = [], []
    for t in range(m):
        decay = torch.exp(g[t])
        s = s * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
        u = (v[t] - (s * k[t][:, :, None]).sum(1)) * beta[t][:, None]    # S^T k, elementwise:
        s = s + k[t][:, :, None] * u[:, None, :]                         # no BLAS call per token
        out.append((s * q[t][:, :, None]).sum(1) * scale)
        if t >= m - keep_states:
            kept.append(s)
    return torch.stack(out), s, kept


def to_chunks(xs: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    """Each [m, H, ...] as [H, n, chunk, ...]: m padded up to n * chunk with zero rows (no
    update, no decay)."""
    out = []
    for x in xs:
        pad = (-x.shape[0]) % chunk
        if pad:
            x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))])
        out.append(x.reshape(-1, chunk, *x.shape[1:]).movedim(2, 0))
    return out


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence over chunks of `chunk` tokens (same arguments as `sequential`);
    returns (o [m, H, d_v], final state)."""
    m, H, dk = k.shape
    n = -(-m // chunk)
    q, k, v, g, beta = to_chunks([q * dk ** -0.5, k, v, g, beta], chunk)
    gc = g.cumsum(-1)                                                   # [H, n, C]
    tri = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool))
    diff = gc[..., :, None] - gc[..., None, :]                          # g_cum[i] - g_cum[j]
    decay = torch.where(tri, diff, torch.full_like(diff, -torch.inf)).exp()
    kb = k * beta[..., None]
    # (I + L) W = B with L the strictly lower part of (k_beta k^T) * decay: the WY form
    lower = (kb @ k.transpose(-1, -2)) * decay
    lhs = torch.tril(lower, -1) + torch.eye(chunk, dtype=k.dtype)
    v_w = torch.linalg.solve_triangular(lhs, v * beta[..., None], upper=False, unitriangular=True)
    k_w = torch.linalg.solve_triangular(lhs, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay                              # causal, diagonal included
    q_g = q * gc.exp()[..., None]
    g_last = gc[..., -1]                                                 # [H, n]
    k_tail = k * (g_last[..., None] - gc).exp()[..., None]
    s = state.to(q.dtype).clone()
    out = torch.empty_like(v)
    for c in range(n):
        u = v_w[:, c] - k_w[:, c] @ s                                    # [H, C, d_v]
        out[:, c] = q_g[:, c] @ s + qk[:, c] @ u
        s = s * g_last[:, c].exp()[:, None, None] + k_tail[:, c].transpose(-1, -2) @ u
    o = out.reshape(H, n * chunk, -1)[:, :m].transpose(0, 1)
    return o, s
