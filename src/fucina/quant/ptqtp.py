"""PTQTP: post-training quantization to K trit-planes (arXiv 2509.16989), K in {1, 2, 3}.

Each row is cut into groups of 256 values w and each group is fitted independently as
w ~ sum_k a_k t_k with trit planes t_k in {-1, 0, 1}^256 and one scale a_k per plane, by
alternating, from every plane at sign(w):
  1. the scales: ridge regression a = (S^T S + lam I)^-1 S^T w over the planes S = [t_1..t_K];
     lam starts at 1e-8 and grows x10 while the system's Frobenius condition estimate
     exceeds 1e6, up to 1.0 (at the start the K planes are equal and S^T S is singular);
  2. the topology: per element, the one of the 3^K trit tuples c minimising (w - a . c)^2,
     the tuples tried in a fixed order (zero first, sparser before denser, the finer planes
     before the coarser, + before -) with the first strict minimum kept.
A group stops when no scale moved more than 1e-4, or after 50 rounds. Then each |a_k| is
rounded to f16 (a negative scale flips its plane's trits) and the topology is fitted once
more against the rounded scales, so the stored trits are optimal for exactly the scales
inference multiplies by. Each plane is then a standalone TQ2_0 tensor (d = the group's
f16 scale, q = t + 1): K plain ternary matmuls whose outputs summed in plane order are
the fitted weight. Deterministic: no randomness, groups independent, chunked in order.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from fucina.errors import QuantError

GROUP = 256
LAMBDA0, LAMBDA_MAX, KAPPA_MAX = 1e-8, 1.0, 1e6
EPSILON, MAX_ITERATIONS = 1e-4, 50
_CHUNK = 1024   # groups solved at once (the 3^K candidate errors: CHUNK x 256 x 27 floats)


def candidates(k: int) -> torch.Tensor:
    """The 3^k trit tuples [3^k, k] in the pinned search order."""
    tuples = list(itertools.product((0, 1, -1), repeat=k))
    # sparser first; among equals the nonzeros on finer (later) planes first; + before -
    tuples.sort(key=lambda c: (sum(v != 0 for v in c), tuple(-i for i in reversed(range(k)) if c[i]),
                               tuple(v == -1 for v in c)))
    return torch.tensor(tuples, dtype=torch.float32)


@dataclass
class Fit:
    """A matrix's planes: trits [K, n, k] int8, scales [K, n, k / 256] f32 (f16-exact, >= 0),
    and the solve's statistics."""
    trits: torch.Tensor
    scales: torch.Tensor
    iterations: int
    unconverged: int

    def weight(self) -> torch.Tensor:
        """The fitted matrix, planes summed in order (f32)."""
        K, n, k = self.trits.shape
        out = torch.zeros(n, k)
        for p in range(K):
            out += (self.trits[p].float().view(n, -1, GROUP) * self.scales[p].unsqueeze(-1)).view(n, k)
        return out


def _ridge(S: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per group a = (S^T S + lam I)^-1 S^T w, lam escalated until the condition estimate <= KAPPA_MAX."""
    G, _, K = S.shape
    A = S.transpose(1, 2) @ S                       # [G, K, K]: integer trit counts
    b = (S.transpose(1, 2) @ w.unsqueeze(-1)).squeeze(-1)
    eye = torch.eye(K, dtype=torch.float64)
    lam = torch.full((G,), LAMBDA0, dtype=torch.float64)
    A64 = A.double()
    while True:
        M = A64 + lam.view(-1, 1, 1) * eye
        inv = torch.linalg.inv(M)
        kappa = torch.linalg.matrix_norm(M) * torch.linalg.matrix_norm(inv)
        bad = (kappa > KAPPA_MAX) & (lam < LAMBDA_MAX)
        if not bool(bad.any()):
            break
        lam = torch.where(bad, torch.clamp(lam * 10, max=LAMBDA_MAX), lam)
    return (inv @ b.double().unsqueeze(-1)).squeeze(-1).float()


def _topology(w: torch.Tensor, a: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Per element the first candidate tuple of least squared error: [G, 256, K]."""
    levels = a @ cand.T                             # [G, C]
    err = (w.unsqueeze(-1) - levels.unsqueeze(1)) ** 2
    return cand[err.argmin(-1)]


def _solve_groups(w: torch.Tensor, K: int, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """w [G, 256] -> trits [G, 256, K] int8, scales [G, K] (f16-rounded magnitudes)."""
    finite = torch.isfinite(w)
    w = torch.where(finite, w, torch.zeros_like(w))   # non-finite values: out of the fit, trit 0
    S = torch.sign(w).unsqueeze(-1).expand(-1, -1, K).contiguous()
    a = torch.zeros(w.shape[0], K)
    active = torch.ones(w.shape[0], dtype=torch.bool)
    it = 0
    for it in range(1, MAX_ITERATIONS + 1):
        idx = active.nonzero().squeeze(-1)
        a_new = _ridge(S[idx], w[idx])
        moved = (a_new - a[idx]).abs().amax(-1)
        a[idx] = a_new
        S[idx] = _topology(w[idx], a_new, cand)
        active[idx] = moved >= EPSILON
        if not bool(active.any()):
            break
    unconverged = int(active.sum())
    sign = torch.where(a < 0, -1.0, 1.0)
    mag = a.abs().half().float()                    # the stored scales
    S = _topology(w, mag * sign, cand) * sign.unsqueeze(1)   # trits for exactly those scales
    S = torch.where(finite.unsqueeze(-1), S, torch.zeros_like(S))
    return S.to(torch.int8), mag, it, unconverged


def fit(weight, planes: int, progress=None) -> Fit:
    """Fit `planes` trit-planes to a matrix [n, k] (k a multiple of 256); `progress(g)` is
    called with the number of 256-groups done after each chunk of them."""
    if planes not in (1, 2, 3):
        raise QuantError(f"PTQTP takes 1, 2 or 3 planes, not {planes}")
    W = torch.as_tensor(np.asarray(weight, dtype=np.float32) if not isinstance(weight, torch.Tensor) else weight)
    W = W.detach().float()
    if W.dim() != 2 or W.shape[1] % GROUP:
        raise QuantError(f"PTQTP needs a matrix whose rows split into {GROUP}-value groups, got {tuple(W.shape)}")
    n, k = W.shape
    groups = W.reshape(-1, GROUP)
    cand = candidates(planes)
    trits, scales, its, unconv = [], [], 0, 0
    for g0 in range(0, groups.shape[0], _CHUNK):
        t, s, i, u = _solve_groups(groups[g0:g0 + _CHUNK], planes, cand)
        trits.append(t)
        scales.append(s)
        its, unconv = max(its, i), unconv + u
        if progress is not None:
            progress(t.shape[0])
    T = torch.cat(trits).view(n, k, planes).permute(2, 0, 1).contiguous()
    A = torch.cat(scales).view(n, k // GROUP, planes).permute(2, 0, 1).contiguous()
    return Fit(T, A, its, unconv)


def plane_bytes(f: Fit, p: int) -> np.ndarray:
    """Plane p as TQ2_0 blocks [n, k / 256 * 66] (d = the group's scale, q = t + 1)."""
    from fucina.quant.quantize import _cat, _f16_bytes, _pack

    q = (f.trits[p].to(torch.int32) + 1).reshape(-1, 2, 4, 32)     # one 256-group a row
    return _cat(_pack(q, 2), _f16_bytes(f.scales[p].reshape(-1))).reshape(f.trits.shape[1], -1).numpy()
