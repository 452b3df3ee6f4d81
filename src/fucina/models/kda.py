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
from fucina.models.base import FusedParts, Ragged, rowwise
from fucina.models.cache import KVCache, LatentKV, Q8Cache, RecurrentState, cache_capacity

CHUNK = 16


class InputParts(FusedParts):
    """A KDA layer's input projections (q, k, v or the file's attn_qkv, then the gate and
    beta rows) as `FusedParts`, each slot named `in_<tensor>`."""

    def set_parts(self, t: dict, names: list[str]) -> None:
        self.part_attrs = ["in_" + n for n in names]
        for n in names:
            setattr(self, "in_" + n, t[n])


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


def mixer(step, x, cache, layer: int, pos0: int, d_conv: int):
    """A KDA layer over the normed residual x [m, n_embd] on layer `layer`'s RecurrentState
    (a family's KDA math is `step(x, window, state, keep)` -> (out [m, n_embd], the padded
    conv input [d_conv - 1 + m, ch], the final state, the last `keep` states)): steps of up
    to ROWWISE_MAX rows at inference run row by row with decode's ops (batch invariance:
    speculation is lossless), longer ones the chunked scan; the state advances and keeps
    its snapshots. A Ragged batch runs each stream's row as its own decode step."""
    if isinstance(cache, Ragged):
        return torch.cat([mixer(step, x[r:r + 1], c, layer, p, d_conv)
                          for r, (c, p) in enumerate(zip(cache.caches, cache.pos0s))])
    mem, m = cache.memories[layer], x.shape[0]
    window, state = mem.span(pos0, pos0)
    keep = min(m, mem.horizon)
    if rowwise(m, cache, x):
        outs, inner = [], []
        for r in range(m):
            o, full, state, _ = step(x[r:r + 1], window, state, 0)
            window = full[1:]
            outs.append(o)
            if r >= m - keep:
                inner.append((pos0 + r + 1, window, state))
        mem.write(pos0, window, state, inner)
        return torch.cat(outs)
    out, full, final, kept = step(x, window, state, keep)
    tail, d = m - len(kept), d_conv - 1
    mem.write(pos0, full[m:], final, [(pos0 + t + 1, full[t + 1:t + 1 + d], s) for t, s in zip(range(tail, m), kept)])
    return out


# -- the hybrid cache: KDA layers' RecurrentStates beside the MLA layers' LatentKVs ---------

def hybrid_cache(c, capacity: int | None, dtype: torch.dtype, cache_type: str, horizon: int,
                 decode_stride: int = 1) -> KVCache:
    """A KDA + MLA hybrid's cache (c: its config, `recurrent` per layer): KDA layers a
    RecurrentState (the q/k/v conv windows side by side, [H, d, d] states) with a snapshot
    at every `decode_stride`th length within `horizon` (1: without a native step a
    speculative verify runs one row a step, and any of its lengths may be the rewind), MLA
    layers every position's latent and key row (f16 or q8_0)."""
    cap = cache_capacity(capacity, c.n_ctx_train, cache_type)
    d = c.kda_head_dim
    mems = [RecurrentState(c.d_conv - 1, 3 * c.n_head * d, c.n_head, d, d, horizon=horizon,
                           decode_stride=decode_stride) if r
            else LatentKV(cap, c.kv_lora_rank, c.n_rot, cache_type, dtype) for r in c.recurrent]
    return (Q8Cache if cache_type == "q8_0" else KVCache).of(mems, cap)


def hybrid_cache_bytes(c, capacity: int, cache_type: str, horizon: int) -> int:
    """What hybrid_cache(c, capacity, ..., cache_type, horizon) allocates."""
    per_value = 2.0 if cache_type == "f16" else 34 / 32
    latent = sum(not r for r in c.recurrent) * capacity * (c.kv_lora_rank + c.n_rot) * per_value
    d = c.kda_head_dim
    state = (c.d_conv - 1) * 3 * c.n_head * d + c.n_head * d * d
    return int(latent + sum(c.recurrent) * state * 4 * (1 + horizon))


def plan_layers(model) -> list | None:
    """A KDA hybrid's per-layer native plan entries (`model.plan_layer`), or None where the
    model has no native route: an odd rope width, grouped expert routing, or a layer the
    plan cannot hold."""
    c = model.config
    if c.n_rot % 2 or (model.routing is not None and model.routing.groups > 1):
        return None
    layers = [model.plan_layer(i, L) for i, L in enumerate(model.layers)]
    return None if any(L is None for L in layers) else layers
