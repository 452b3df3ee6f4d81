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

The scale-tied fit (`tie=True`, K = 2 only) locks the two scales at ratio 3, a_0 = 3 s and
a_1 = s, so each group is s c with c = 3 t_0 + t_1 a uniform 9-level code in -4..4 (balanced
ternary: every c has exactly one trit pair). The same alternation with one scale,
s = c.w / (c.c + LAMBDA0), and the same pinned 9-way topology search, from both planes at
sign(w); then s is rounded to the f16 nearest it whose triple is an f16 too (at most 9
significant bits), so the stored planes' scales are exactly 3 s and s, and the topology is
fitted once more against it. Its planes are two ordinary TQ2_0 planes that the per-plane sum
reads as they are; fucina serves them folded (`fold_bytes`, the kernels' FK_PTQTP_FOLD): one
4-bit code u = c + 4 a value with the group's s, ONE integer dot a block, whose canonical
result is s (sum c q) per block (`PtqtpWeight.fold_reference`), not the two planes' outputs summed.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from fucina.errors import QuantError

try:    # the native solver (csrc/ptqtp_solve.cpp); the torch formulation below is its reference
    from fucina.quant import _ptqtp
except ImportError:   # pragma: no cover - a build without the extension
    _ptqtp = None

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
    tied: bool = False

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


def tie_round(s: torch.Tensor) -> torch.Tensor:
    """Each s >= 0 to the f16 nearest it (its f16 rounding, else the closest of the next
    f16s either side) whose triple is an f16 too, as f32."""
    bits = s.half().view(torch.int16).int()
    out = torch.full_like(s, float("nan"))
    for delta in (0, -1, 1, -2, 2, -3, 3):
        b = (bits + delta).clamp(0, 0x7BFF).short().view(torch.float16).float()
        ok = torch.isnan(out) & ((3 * b).half().float() == 3 * b)
        out = torch.where(ok, b, out)
    if bool(torch.isnan(out).any()):
        raise QuantError("PTQTP scale-tied fit: a group's scale has no f16 value whose triple is an f16 too "
                         "(weights above ~20000 in magnitude)")
    return out


def _solve_tied(w: torch.Tensor, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The scale-tied K=2 fit of groups w [G, 256] -> trits [G, 256, 2] int8, scales [G, 2]
    (3 s, s: f16 values, s tie-rounded)."""
    finite = torch.isfinite(w)
    w = torch.where(finite, w, torch.zeros_like(w))
    tie = torch.tensor([3.0, 1.0])
    S = torch.sign(w).unsqueeze(-1).expand(-1, -1, 2).contiguous()
    s = torch.zeros(w.shape[0])
    active = torch.ones(w.shape[0], dtype=torch.bool)
    it = 0
    for it in range(1, MAX_ITERATIONS + 1):
        idx = active.nonzero().squeeze(-1)
        c = S[idx].double() @ tie.double()          # [g, 256] codes in -4..4
        s_new = ((c * w[idx].double()).sum(-1) / ((c * c).sum(-1) + LAMBDA0)).float()
        moved = (s_new - s[idx]).abs()
        s[idx] = s_new
        S[idx] = _topology(w[idx], s_new.unsqueeze(-1) * tie, cand)
        active[idx] = moved >= EPSILON
        if not bool(active.any()):
            break
    unconverged = int(active.sum())
    sign = torch.where(s < 0, -1.0, 1.0)
    mag = tie_round(s.abs())
    S = _topology(w, (mag * sign).unsqueeze(-1) * tie, cand) * sign.view(-1, 1, 1)
    S = torch.where(finite.unsqueeze(-1), S, torch.zeros_like(S))
    return S.to(torch.int8), mag.unsqueeze(-1) * tie, it, unconverged


def _solve_native(groups: torch.Tensor, K: int, tie: bool, threads: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The native solver on groups [G, 256]: the same alternation, each group solved alone."""
    G = groups.shape[0]
    trits = torch.empty(G, GROUP, K, dtype=torch.int8)
    scales = torch.empty(G, K)
    its, unconverged, failed = _ptqtp.solve(groups.data_ptr(), G, K, int(tie), trits.data_ptr(), scales.data_ptr(),
                                            threads)
    if failed >= 0:
        raise QuantError("PTQTP scale-tied fit: a group's scale has no f16 value whose triple is an f16 too "
                         "(weights above ~20000 in magnitude)")
    return trits, scales, its, unconverged


def fit(weight, planes: int, progress=None, tie: bool = False, solver: str = "auto", threads: int | None = None) -> Fit:
    """Fit `planes` trit-planes to a matrix [n, k] (k a multiple of 256); `progress(g)` is
    called with the number of 256-groups done after each chunk of them. `tie`: the
    scale-tied fit (planes = 2 only; module docstring). `solver`: "native" (csrc, minutes
    for a 0.6B model), "torch" (this module's batched formulation, hours for one), "auto"
    (native when built). The two agree on the method, not to the bit: their ridge sums round
    differently, so a few groups may differ in a scale's last f16 bit."""
    if planes not in (1, 2, 3):
        raise QuantError(f"PTQTP takes 1, 2 or 3 planes, not {planes}")
    if tie and planes != 2:
        raise QuantError(f"the scale-tied PTQTP fit takes 2 planes, not {planes}")
    W = torch.as_tensor(np.asarray(weight, dtype=np.float32) if not isinstance(weight, torch.Tensor) else weight)
    W = W.detach().float()
    if W.dim() != 2 or W.shape[1] % GROUP:
        raise QuantError(f"PTQTP needs a matrix whose rows split into {GROUP}-value groups, got {tuple(W.shape)}")
    if solver not in ("auto", "native", "torch"):
        raise QuantError(f"PTQTP solver is auto, native or torch, not {solver!r}")
    if solver == "native" and _ptqtp is None:
        raise QuantError("the native PTQTP solver is not built (reinstall fucina to compile it); use solver='torch'")
    native = solver != "torch" and _ptqtp is not None
    n, k = W.shape
    groups = W.reshape(-1, GROUP).contiguous()
    cand = candidates(planes)
    threads = threads or torch.get_num_threads()
    chunk_groups = 16 * _CHUNK if native else _CHUNK
    trits, scales, its, unconv = [], [], 0, 0
    for g0 in range(0, groups.shape[0], chunk_groups):
        chunk = groups[g0:g0 + chunk_groups]
        if native:
            t, s, i, u = _solve_native(chunk, planes, tie, threads)
        else:
            t, s, i, u = _solve_tied(chunk, cand) if tie else _solve_groups(chunk, planes, cand)
        trits.append(t)
        scales.append(s)
        its, unconv = max(its, i), unconv + u
        if progress is not None:
            progress(t.shape[0])
    T = torch.cat(trits).view(n, k, planes).permute(2, 0, 1).contiguous()
    A = torch.cat(scales).view(n, k // GROUP, planes).permute(2, 0, 1).contiguous()
    return Fit(T, A, its, unconv, tie)


def plane_bytes(f: Fit, p: int) -> np.ndarray:
    """Plane p as TQ2_0 blocks [n, k / 256 * 66] (d = the group's scale, q = t + 1)."""
    from fucina.quant.quantize import _cat, _f16_bytes, _pack

    q = (f.trits[p].to(torch.int32) + 1).reshape(-1, 2, 4, 32)     # one 256-group a row
    return _cat(_pack(q, 2), _f16_bytes(f.scales[p].reshape(-1))).reshape(f.trits.shape[1], -1).numpy()


#: bytes of one 256-group of a folded scale-tied pair (csrc/generic/ternary_impl.inc)
FOLD_BYTES = 130


def _plane_fields(raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A TQ2_0 plane's bytes [n, groups * 66] -> codes q (0..3) [n * groups, 256], d f32 [n * groups]."""
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, 66)
    qs = b[:, :64].reshape(-1, 2, 1, 32)
    q = (qs >> (2 * np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1))) & 3      # [G, j, l, m]: 128 j + 32 l + m
    return q.reshape(b.shape[0], 256), b[:, 64:66].copy().view(np.float16).astype(np.float32).reshape(-1)


def fold_bytes(plane0, plane1, n: int, name: str = "") -> np.ndarray:
    """Two scale-tied TQ2_0 planes (bytes [n, groups * 66], plane 0's d = 3 plane 1's in
    every group) as one folded plane [n, groups * 130]: u = 3 t0 + t1 + 4 in nibbles, d = the
    fine scale. Raises QuantError where a group's scales are not tied (d0 != 3 d1) or a code
    is 3 (the TQ2_0 value 2 d that no trit gives)."""
    q0, d0 = _plane_fields(plane0, n)
    q1, d1 = _plane_fields(plane1, n)
    if q0.shape != q1.shape:
        raise QuantError(f"{name}: the two planes differ in shape")
    bad = np.flatnonzero(d0 != 3 * d1)
    if bad.size:
        g = int(bad[0])
        raise QuantError(f"{name}: group {g} (row {g // max(1, q0.shape[0] // n)}) has plane scales {d0[g]} and "
                         f"{d1[g]}, not tied at 3 to 1: not a scale-tied PTQTP pair")
    if (q0 == 3).any() or (q1 == 3).any():
        raise QuantError(f"{name}: a scale-tied plane holds the code 3 (not a trit)")
    u = (3 * (q0.astype(np.int16) - 1) + (q1.astype(np.int16) - 1) + 4).astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([qs, d1.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(n, -1)


def fold_dequantize(raw, n: int, k: int) -> torch.Tensor:
    """A folded plane's matrix [n, k] f32: d (u - 4), every nibble read as is."""
    b = np.ascontiguousarray(np.asarray(raw), dtype=np.uint8).reshape(-1, FOLD_BYTES)
    qs = b[:, :128].reshape(-1, 4, 1, 32)
    u = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15       # element 64 j + 32 h + m
    d = b[:, 128:130].copy().view(np.float16).astype(np.float32)
    return torch.from_numpy(((u.reshape(-1, 256).astype(np.float32) - 4) * d).reshape(n, k))


def unfold_planes(folded, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A folded plane [n, groups * 130] back to its two TQ2_0 planes (d0 = 3 d, d1 = d):
    the balanced-ternary digits of each code c = u - 4 (u in 0..8)."""
    b = np.ascontiguousarray(np.asarray(folded), dtype=np.uint8).reshape(-1, FOLD_BYTES)
    qs = b[:, :128].reshape(-1, 4, 1, 32)
    c = (((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).astype(np.int16) - 4).reshape(-1, 256)
    t0 = (c + 4) // 3 - 1
    d = b[:, 128:130].copy().view(np.float16).astype(np.float32)
    out = []
    for t, scale in ((t0, 3 * d), (c - 3 * t0, d)):
        q = (t + 1).astype(np.uint8).reshape(-1, 2, 4, 32)                        # 128 j + 32 l + m
        packed = (q << (2 * np.arange(4, dtype=np.uint8).reshape(1, 1, 4, 1))).sum(axis=2, dtype=np.uint8)
        out.append(np.concatenate([packed.reshape(-1, 64), scale.astype(np.float16).view(np.uint8).reshape(-1, 2)],
                                  axis=1).reshape(n, -1))
    return out[0], out[1]
