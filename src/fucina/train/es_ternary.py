"""Ternary-native evolution strategies: the genome is the packed TQ2_0 bytes the kernels read.

A TQ2_0 row is blocks of 256 trits (2-bit codes q = t + 1 in {0, 1, 2}) and one f16 scale d;
element 128 j + 32 l + m of a block is bits 2l..2l+1 of byte 32 j + m (csrc/generic/
ternary_impl.inc). ES here never holds a float copy: theta is those bytes, a member is theta
with a few trits moved one bin, and a member is scored through the real TQ2_0 kernels on the
mutated bytes. The block scales d are never touched (fix them at init). The recipe follows
the original Fucina's ternary ES (its docs/TERNARY.md, "Ternary-native evolution
strategies", after EGGROLL's integer ES, arXiv 2511.16652 App. H); the code is ours:

perturb (member m of iteration t, pair j = m // 2, sign s = +1 for even m, -1 for odd):
    for each genome tensor k of L trits, F = max(1, round(flip_rate L)) indices and deltas
    d in {-1, +1} drawn from torch.Generator(mix64(seed, 0x7E, t, j, k)) (duplicates drop
    to their first draw); q_i <- clamp(q_i + s d_i, 0, 2). Mirrored members move the same
    trits the opposite way; clamping makes the pair asymmetric at the edges (so a member is
    built from theta, never by subtracting).
update (rewards R_0..R_P-1 shaped to C_m as the float path: centred ranks or z-scores):
    vote_i = sum over pairs j in index order of (C_2j - C_2j+1) d_i^(j) (f64, over the
    trits pair j touched); the K = round(update_fraction L s(t)) trits of largest |vote|
    (ties: lower index first; zero votes never move) move one bin toward sign(vote_i),
    clamped to {0, 1, 2}. s(t) is the float path's schedule factor (`es.schedule_factor`).

Everything is a function of (seed, iteration, pair, tensor) and the reward vector, so any
process rebuilds any member and every process applies the same update: the bytes are the
same for any worker count and after a resume.
"""
from __future__ import annotations

import os

import torch

from fucina.gguf import TYPE_SIZES, GGMLType
from fucina.quant.quantize import _cat, _f16_bytes, _pack
from fucina.train.es import (ESError, FullTarget, _fused_slots, _target_names, centred_ranks, check_rewards,
                             schedule_factor, zscores)
from fucina.train.lora import mix64

_TRIT_DOMAIN = 0x7E
_BLOCK, _BLOCK_BYTES = TYPE_SIZES[GGMLType.TQ2_0]


def _where(shape: tuple[int, int], idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offset and bit shift of flat element indices `idx` of a TQ2_0 [n, k] matrix."""
    n, k = shape
    r, c = idx // k, idx % k
    e = c % _BLOCK
    byte = r * (k // _BLOCK * _BLOCK_BYTES) + (c // _BLOCK) * _BLOCK_BYTES + (e // 128) * 32 + e % 32
    return byte, (e % 128) // 32 * 2


def read_codes(raw: torch.Tensor, shape: tuple[int, int], idx: torch.Tensor) -> torch.Tensor:
    """The 2-bit codes q (t + 1) at flat element indices `idx` (int64)."""
    byte, shift = _where(shape, idx)
    return (raw.reshape(-1)[byte].long() >> shift) & 3


def write_codes(raw: torch.Tensor, shape: tuple[int, int], idx: torch.Tensor, codes: torch.Tensor) -> None:
    """Set the codes at distinct flat indices `idx` in place (crumbs sharing a byte merge)."""
    if idx.numel() == 0:
        return
    flat = raw.reshape(-1)
    byte, shift = _where(shape, idx)
    ub, inv = torch.unique(byte, return_inverse=True)
    mask = torch.zeros(ub.numel(), dtype=torch.int64).index_add_(0, inv, 3 << shift)
    val = torch.zeros(ub.numel(), dtype=torch.int64).index_add_(0, inv, codes.long() << shift)
    flat[ub] = ((flat[ub].long() & ~mask) | val).to(torch.uint8)


def trits(raw: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The whole matrix's trits t = q - 1 as int8 [n, k] (code 3, which ggml reads as +2, stays 2)."""
    n, k = shape
    return (read_codes(raw, shape, torch.arange(n * k)) - 1).to(torch.int8).reshape(n, k)


def pack(t: torch.Tensor, d: torch.Tensor | float) -> torch.Tensor:
    """Trits t [n, k] in {-1, 0, 1} and block scales d ([n, k / 256] or one value) as TQ2_0
    bytes [n, row_bytes], through the quantizer's own packing (quant.quantize)."""
    n, k = t.shape
    if k % _BLOCK:
        raise ValueError(f"TQ2_0 rows are whole blocks of {_BLOCK}, got {k}")
    q = (t.reshape(-1, _BLOCK).to(torch.int32) + 1).clamp(0, 2)
    d = torch.as_tensor(d, dtype=torch.float32).expand(n, k // _BLOCK).reshape(-1, 1)
    return _cat(_pack(q.view(-1, 2, 4, 32), 2), _f16_bytes(d)).reshape(n, -1)


class TernaryStrategy:
    """theta: TQ2_0 bytes [n, row_bytes] per genome tensor (updated in place), their [n, k]
    shapes and the iteration; the same interface as `es.Strategy`."""

    def __init__(self, theta: list[torch.Tensor], shapes: list[tuple[int, int]], cfg):
        if len(theta) != len(shapes):
            raise ESError("one [n, k] shape per ternary tensor")
        for t, (n, k) in zip(theta, shapes):
            if k % _BLOCK or t.dtype != torch.uint8 or tuple(t.shape) != (n, k // _BLOCK * _BLOCK_BYTES):
                raise ESError(f"ternary ES takes TQ2_0 bytes [n, k / 256 * 66]; got {tuple(t.shape)} "
                              f"{t.dtype} for a [{n}, {k}] matrix")
        self.theta = [t.detach().contiguous().clone() for t in theta]
        self.shapes = [(int(n), int(k)) for n, k in shapes]
        self.cfg, self.iteration = cfg, 0

    def _factor(self, iteration: int) -> float:
        return schedule_factor(self.cfg, iteration)

    def flips(self, pair: int, k: int, iteration: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted distinct flat indices, deltas +-1) pair `pair` moves in tensor k."""
        it = self.iteration if iteration is None else iteration
        n, kk = self.shapes[k]
        size = n * kk
        rate = self.cfg.flip_rate * (self._factor(it) if self.cfg.decay_sigma else 1.0)
        count = max(1, round(rate * size))
        g = torch.Generator().manual_seed(mix64(self.cfg.seed, _TRIT_DOMAIN, it, pair, k))
        idx = torch.randint(size, (count,), generator=g)
        delta = torch.randint(0, 2, (count,), generator=g) * 2 - 1
        idx, order = torch.sort(idx, stable=True)
        first = torch.ones_like(idx, dtype=torch.bool)
        first[1:] = idx[1:] != idx[:-1]
        return idx[first], delta[order][first]

    def member(self, m: int) -> list[torch.Tensor]:
        sign = 1 if m % 2 == 0 else -1
        out = []
        for k, (t, shape) in enumerate(zip(self.theta, self.shapes)):
            idx, delta = self.flips(m // 2, k)
            t = t.clone()
            write_codes(t, shape, idx, (read_codes(t, shape, idx) + sign * delta).clamp(0, 2))
            out.append(t)
        return out

    def coefficients(self, rewards: list[float]) -> list[float]:
        check_rewards(rewards, self.cfg.population)
        return centred_ranks(rewards) if self.cfg.norm == "rank" else zscores(rewards)

    def votes(self, rewards: list[float], k: int) -> torch.Tensor:
        """vote_i of tensor k (f64 over all its trits) for this iteration's rewards."""
        c = self.coefficients(rewards)
        n, kk = self.shapes[k]
        v = torch.zeros(n * kk, dtype=torch.float64)
        for j in range(self.cfg.population // 2):
            w = c[2 * j] - c[2 * j + 1]
            if w:
                idx, delta = self.flips(j, k)
                v.index_add_(0, idx, delta.double() * w)   # distinct within a pair: no collisions
        return v

    @torch.no_grad()
    def update(self, rewards: list[float]) -> None:
        self.coefficients(rewards)                       # validates before anything moves
        f = self._factor(self.iteration)
        for k, (t, shape) in enumerate(zip(self.theta, self.shapes)):
            v = self.votes(rewards, k)
            top = round(self.cfg.update_fraction * v.numel() * f)
            hit = v.nonzero().reshape(-1)                 # ascending index
            if top < 1 or hit.numel() == 0:
                continue
            order = torch.sort(-v[hit].abs(), stable=True).indices[:top]
            sel = hit[order]
            step = torch.sign(v[sel]).long()
            write_codes(t, shape, sel, (read_codes(t, shape, sel) + step).clamp(0, 2))
        self.iteration += 1


class TernaryTarget(FullTarget):
    """The target projections of a TQ2_0 model: owned copies of their bytes (the file's are
    mapped read-only), rewritten in place per member (`FullTarget.install`, the fused QKV /
    gate-up copies too); theta = [bytes_0, bytes_1, ...]."""

    def __init__(self, model, cfg):
        from fucina.kernels import attach
        from fucina.weights import LinearWeight
        from fucina.weights.lora import _rewrite, model_weights
        self.model, self.cfg = model, cfg
        self.names = _target_names(model, cfg.targets)
        weights = model_weights(model)
        other = sorted({weights[n].qtype.name for n in self.names} - {"TQ2_0"})
        if other:
            raise ESError(f"mode ternary trains TQ2_0 weights; the targets ({','.join(cfg.targets)}) are "
                          f"{', '.join(other)} (convert the model: fucina quantize MODEL OUT --type TQ2_0)")

        def own(w):
            c = LinearWeight(w.raw.clone(), GGMLType.TQ2_0, w.out_features, w.in_features, w.name)
            attach(c)
            return c
        _rewrite(model, set(self.names), own, lambda group, fused: LinearWeight.fuse(group))
        live = model_weights(model)
        self.live = [live[n].raw for n in self.names]
        self.shapes = [(live[n].out_features, live[n].in_features) for n in self.names]
        self.init = [r.clone() for r in self.live]
        self.fused = [(f, parts) for f, parts in _fused_slots(model) if any(p.name in self.names for p in parts)]

    def write(self, out_dir: str, theta: list[torch.Tensor]) -> str:
        from fucina.train.export import write_replaced
        src = self.source("mode ternary writes the trained GGUF and")
        out = os.path.join(out_dir, "model.gguf")
        write_replaced(src, dict(zip(self.names, theta)), out)
        return out
