"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel decay, in plain torch.

Per head a state matrix S [d_k, d_v] is carried from token to token:
    S = diag(exp(g_t)) S                   g_t [d_k] <= 0: one decay per key channel
    u = (v_t - S^T k_t) * beta_t           the delta rule
    S = S + k_t u^T
    o_t = S^T q_t / sqrt(d_k)
It is models/delta_net.py's recurrence with the scalar gate g_t widened to a vector (ggml's
gated_delta_net op with a [d_k] gate, b11434: S[i][:] *= exp(g[i])); q, k, v and the state
have the same layout, so a RecurrentState holds it unchanged.

`sequential` runs token by token (decode, snapshots); `chunked` runs chunks of 16 tokens as
a few batched products each (the WY form with the decay inside the pair products:
exp(gc_i - gc_j) per channel for j <= i, never a growing exponent), then one state
hand-off per chunk: the prefill route.
"""
from __future__ import annotations

import torch

from fucina.models import delta_net

CHUNK = 16


def sequential(q, k, v, g, beta, state, keep_states: int = 0):
    """The recurrence token by token: delta_net.sequential with g [m, H, d_k]."""
    return delta_net.sequential(q, k, v, g, beta, state, keep_states)


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence over chunks of `chunk` tokens (same arguments as `sequential`);
    returns (o [m, H, d_v], final state)."""
    m, H, dk = k.shape
    n = -(-m // chunk)
    q, k, v, g, beta = delta_net.to_chunks([q * dk ** -0.5, k, v, g, beta], chunk)
    gc = g.cumsum(2)                                                     # [H, n, C, d_k]
    tri = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool))[..., None]
    diff = gc[:, :, :, None, :] - gc[:, :, None, :, :]                  # gc[i] - gc[j], [H, n, C, C, d_k]
    decay = torch.where(tri, diff, torch.full_like(diff, -torch.inf)).exp()
    kb = k * beta[..., None]
    # (I + L) W = B with L the strictly lower part of sum_d kb_i k_j exp(gc_i - gc_j): the WY form
    lower = (kb[:, :, :, None, :] * k[:, :, None, :, :] * decay).sum(-1)
    lhs = torch.tril(lower, -1) + torch.eye(chunk, dtype=k.dtype)
    v_w = torch.linalg.solve_triangular(lhs, v * beta[..., None], upper=False, unitriangular=True)
    k_w = torch.linalg.solve_triangular(lhs, kb * gc.exp(), upper=False, unitriangular=True)
    qk = (q[:, :, :, None, :] * k[:, :, None, :, :] * decay).sum(-1)   # causal, diagonal included
    del decay, diff
    q_g = q * gc.exp()
    g_last = gc[:, :, -1]                                                 # [H, n, d_k]
    k_tail = k * (g_last[:, :, None, :] - gc).exp()
    s = state.to(q.dtype).clone()
    out = torch.empty_like(v)
    for c in range(n):
        u = v_w[:, c] - k_w[:, c] @ s                                    # [H, C, d_v]
        out[:, c] = q_g[:, c] @ s + qk[:, c] @ u
        s = s * g_last[:, c].exp()[:, :, None] + k_tail[:, c].transpose(-1, -2) @ u
    o = out.reshape(H, n * chunk, -1)[:, :m].transpose(0, 1)
    return o, s


def scan(q, k, v, g, beta, state, keep: int):
    """The rule over m rows: the first m - keep chunked, the last `keep` sequentially (their
    states become snapshots). Returns (o, final state, kept states)."""
    m = q.shape[0]
    head = m - keep
    if head < CHUNK:   # a short step: the chunked form would not pay
        return sequential(q, k, v, g, beta, state, keep)
    o1, s = chunked(q[:head], k[:head], v[:head], g[:head], beta[:head], state)
    if not keep:
        return o1, s, []
    o2, s, kept = sequential(q[head:], k[head:], v[head:], g[head:], beta[head:], s, keep)
    return torch.cat([o1, o2]), s, kept
