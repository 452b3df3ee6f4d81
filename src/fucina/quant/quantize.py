"""Quantize f32 values into GGML blocks, vectorized over blocks with torch.

Where gguf-py has a quantizer (BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0, MXFP4) the
result is bit-exact with it. The K-quants, Q8_K, Q8_1 and Q1_0 follow llama.cpp's
quantize_row_*_ref step for step; checked byte-for-byte against that C compiled from source on
~10k random super-blocks (not in the test suite: no C oracle there). Bit-exactness needs C's float
semantics: sums left to right (`_sum`), one rounding per division (`_div`), f32 constants as C
folds them (`_c_f32`), correctly rounded sqrt.

Packing is the exact inverse of the unpacking in dequant.py: values laid out as
[..., m, k] are packed as sum_i v[..., i, :] << (width * i).
"""
from __future__ import annotations

import numpy as np
import torch

from fucina.errors import QuantError
from fucina.gguf import GGMLType, type_name
from fucina.quant import tables
from fucina.quant.formats import as_type, block_size, type_size

T = GGMLType
_f32 = torch.float32
GROUP_MAX_EPS = 1e-15


# ---- helpers ----

def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """f32 [n] or [n, k] -> round-to-nearest-even f16, as bytes [n, 2k]."""
    return v.reshape(v.shape[0], -1).to(torch.float16).view(torch.uint8)


def _pack(v: torch.Tensor, width: int) -> torch.Tensor:
    """[..., m, k] small ints -> [..., k] bytes: element i of each column goes to bits width*i."""
    out = torch.zeros(v.shape[:-2] + v.shape[-1:], dtype=torch.int32)
    for i in range(v.shape[-2]):
        out |= v[..., i, :].to(torch.int32) << (width * i)
    return out.to(torch.uint8)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C roundf: half away from zero. floor(|x| + 0.5) would round 0.49999997 up, so compare the
    (exact) fractional part instead."""
    a = x.abs()
    f = a.floor()
    return torch.copysign(f + (a - f >= 0.5).to(_f32), x)


def _nearest(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's nearest_int: round half to even (the 1.5*2^23 trick), as int32."""
    return torch.round(x).to(torch.int32)


def _div(a, b: torch.Tensor, ok: torch.Tensor | None = None) -> torch.Tensor:
    """a / b rounded once, as C does, and 0 where not `ok` (default: where b is 0).

    `a` may be a constant: it is made an f32 tensor first, because torch computes
    `scalar / tensor` as scalar * reciprocal(tensor), which rounds twice."""
    ok = b != 0 if ok is None else ok
    a = torch.tensor(a, dtype=_f32) if not isinstance(a, torch.Tensor) else a
    return torch.where(ok, a / torch.where(ok, b, torch.ones_like(b)), torch.zeros_like(b))


def _inv(d: torch.Tensor) -> torch.Tensor:
    """1/d, and 0 where d is 0 (an all-zero block quantizes to zeros)."""
    return _div(1.0, d)


def _sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim left to right, as llama.cpp's loops do (torch's own reduction order
    differs in the last bit, which can flip a scale search): [..., n] -> [..., 1]."""
    cols = t.movedim(-1, 0).contiguous()
    acc = cols[0].clone()
    for c in cols[1:]:
        acc += c
    return acc.unsqueeze(-1)


def _c_f32(v: float) -> float:
    """A constant as C computes it in float (e.g. -1.f + 0.1f*is + 15)."""
    return float(np.float32(v))


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The value (with its sign) of largest magnitude along the last dim; the first on ties."""
    return x.gather(-1, x.abs().argmax(-1, keepdim=True))


def _pos_max(v: torch.Tensor) -> torch.Tensor:
    """max(0, v...) along the last dim, +0 when nothing is positive (C starts from 0.f; a -0.0
    would leak into an f16 field as 0x8000)."""
    m = v.max(-1, keepdim=True).values
    return torch.where(m > 0, m, torch.zeros_like(m))


def _cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.reshape(p.shape[0], -1).to(torch.uint8) for p in parts], dim=1)


# ---- float and legacy types (bit-exact with gguf-py) ----

def _bf16(x):
    n = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(nan, (n & 0xFFFF0000) | (64 << 16), n)  # keep NaNs NaN: force quiet
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16                # round to nearest even
    return n.to(torch.int16).view(torch.uint8)


def _q4_0(x):
    d = _signed_absmax(x) / -8
    q = torch.trunc(x * _inv(d) + 8.5).clamp(0, 15)
    return _cat(_f16_bytes(d), _pack(q.view(-1, 2, 16), 4))


def _q4_1(x):
    mx, mn = x.max(-1, keepdim=True).values, x.min(-1, keepdim=True).values
    d = (mx - mn) / 15
    q = torch.trunc((x - mn) * _inv(d) + 0.5).clamp(0, 15)
    return _cat(_f16_bytes(d), _f16_bytes(mn), _pack(q.view(-1, 2, 16), 4))


def _q5_bits(q):
    """5-bit values [n, 32] -> (qh: bit j of the 32-bit mask is value j's 5th bit, nibbles [n, 16])."""
    q = q.to(torch.int32)
    qh = _pack((q >> 4).view(-1, 4, 8).transpose(-1, -2), 1)
    return qh, _pack((q & 0xF).view(-1, 2, 16), 4)


def _q5_0(x):
    d = _signed_absmax(x) / -16
    q = torch.trunc(x * _inv(d) + 16.5).clamp(0, 31)
    return _cat(_f16_bytes(d), *_q5_bits(q))


def _q5_1(x):
    mx, mn = x.max(-1, keepdim=True).values, x.min(-1, keepdim=True).values
    d = (mx - mn) / 31
    q = torch.trunc((x - mn) * _inv(d) + 0.5).clamp(0, 31)
    return _cat(_f16_bytes(d), _f16_bytes(mn), *_q5_bits(q))


def _q8_0(x):
    d = x.abs().max(-1, keepdim=True).values / 127
    q = _roundf(x * _inv(d)).to(torch.int8)
    return _cat(_f16_bytes(d), q.view(torch.uint8))


def _q8_1(x):
    d = x.abs().max(-1, keepdim=True).values / 127
    q = _roundf(x * _inv(d)).to(torch.int8)
    s = q.to(torch.int32).sum(-1, keepdim=True).to(_f32) * d
    return _cat(_f16_bytes(d), _f16_bytes(s), q.view(torch.uint8))


def _q8_k(x):
    mx = _signed_absmax(x)
    iscale = _div(-127.0, mx)
    q = _nearest(iscale * x).clamp(max=127)
    bsums = q.view(-1, 16, 16).sum(-1).to(torch.int16)
    d = _inv(iscale)
    return _cat(d.contiguous().view(torch.uint8), q.to(torch.int8).view(torch.uint8), bsums.view(torch.uint8))


def _q1_0(x):
    d = _sum(x.abs()) / 128
    bits = (x >= 0).view(-1, 16, 8).transpose(-1, -2)      # [n, bit, byte]
    return _cat(_f16_bytes(d), _pack(bits, 1))


def _tq1_0(x):
    d = x.abs().max(-1, keepdim=True).values
    q = (_roundf(x * _inv(d)) + 1).to(torch.int32)  # -1, 0, 1 -> 0, 1, 2
    pow3 = torch.tensor([81, 27, 9, 3, 1], dtype=torch.int32)

    def trits(v, k, width):  # [n, k*width] -> [n, width]: k trits, the first most significant
        return (v.reshape(v.shape[0], k, width) * pow3[:k].view(-1, 1)).sum(1)

    packed = torch.cat([trits(q[:, :160], 5, 32), trits(q[:, 160:240], 5, 16), trits(q[:, 240:], 4, 4)], dim=1)
    # ceiling division maps the base-3 number onto a byte whose top bits hold the first trit
    packed = (packed * 256 + 242) // 243
    return _cat(packed, _f16_bytes(d))


def _tq2_0(x):
    d = x.abs().max(-1, keepdim=True).values
    q = (_roundf(x * _inv(d)) + 1).to(torch.int32)
    return _cat(_pack(q.view(-1, 2, 4, 32), 2), _f16_bytes(d))


def _fp4_index(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Index of the E2M1 codebook entry nearest x/d (first of equals, as llama.cpp's loop)."""
    err = (tables.kvalues_fp4() * d.unsqueeze(-1) - x.unsqueeze(-1)).abs()
    return err.argmin(-1)


def _mxfp4(x):
    amax = x.abs().max(-1, keepdim=True).values
    # log2f of the f32 amax, correctly rounded to f32, then floored: as llama.cpp and gguf-py
    lg = torch.log2(amax.to(torch.float64)).to(_f32).floor()
    e = torch.where(amax > 0, lg - 2 + 127, torch.zeros_like(amax)).to(torch.int32).to(torch.uint8)
    d = tables.e8m0_half()[e.long()]
    return _cat(e, _pack(_fp4_index(x, d).view(-1, 2, 16), 4))


# ---- K-quants (llama.cpp's reference algorithms) ----

def _make_qkx2(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """Scale and min for groups x [G, n] with weights w (make_qkx2_quants): a grid search over
    the scale, each step refit by weighted least squares; the best fit so far (scale *and* min)
    seeds the next step. Returns scale [G,1], -min [G,1], levels L [G,n]."""
    mn = x.min(-1, keepdim=True).values.clamp(max=0)
    mx = x.max(-1, keepdim=True).values
    live = mx != mn                      # a flat group quantizes to scale 0, levels 0
    mn0, sum_w, sum_x = mn, _sum(w), _sum(w * x)

    def err(scale, m, L):
        diff = scale * L + m - x
        return _sum(w * (diff.abs() if use_mad else diff * diff))

    def levels(num):
        iscale = _div(num, mx - mn, live)
        return iscale, _nearest(iscale * (x - mn)).clamp(0, nmax).to(_f32)

    iscale, L = levels(float(nmax))
    scale = 1 / iscale
    best = err(scale, mn, L)
    f32 = np.float32
    for step in range(nstep + 1):
        _, La = levels(_c_f32(f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)))
        sum_l, sum_l2, sum_xl = _sum(w * La), _sum(w * La * La), _sum(w * La * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        s = _div(sum_w * sum_xl - sum_x * sum_l, D, ok)
        m = _div(sum_l2 * sum_x - sum_l * sum_xl, D, ok)
        s = torch.where(m > 0, _div(sum_xl, sum_l2), s)
        m = m.clamp(max=0)
        cur = err(s, m, La)
        better = ok & (cur < best)
        best = torch.where(better, cur, best)
        L = torch.where(better, La, L)
        scale = torch.where(better, s, scale)
        mn = torch.where(better, m, mn)
    scale = torch.where(live, scale, torch.zeros_like(scale))
    L = torch.where(live, L, torch.zeros_like(L))
    return scale, -torch.where(live, mn, mn0), L


def _make_qx(x, nmax: int):
    """Symmetric scale for groups x [G, n] with weights x^2, searching 18 scales around
    nmax/max (make_qx_quants, rmse_type 1). Returns scale [G,1], L [G,n] in 0..2*nmax-1."""
    mx = _signed_absmax(x)
    zero = mx.abs() < GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x

    def fit(iscale):
        l = _nearest(iscale * x).clamp(-nmax, nmax - 1).to(_f32)
        return l, _sum(w * x * l), _sum(w * l * l)

    l, sumlx, suml2 = fit(_div(-nmax, mx))
    scale = _div(sumlx, suml2)
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        la, slx, sl2 = fit(_div(-_c_f32(np.float32(nmax) + np.float32(0.1) * np.float32(step)), mx))
        better = (sl2 > 0) & (slx * slx > best * sl2)
        s = _div(slx, sl2)
        l = torch.where(better, la, l)
        scale = torch.where(better, s, scale)
        best = torch.where(better, s * slx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    L = torch.where(zero, torch.zeros_like(l), l + nmax)
    return scale, L


def _make_q3(x, nmax: int = 4):
    """make_q3_quants with rmse: start from nmax/max, then up to 5 passes of coordinate descent
    that move one value at a time when it raises sumlx^2/suml2. Returns scale [G,1], L in 0..7."""
    mx = _signed_absmax(x)
    zero = mx.abs() < GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x
    L = _nearest(_div(-nmax, mx) * x).clamp(-nmax, nmax - 1).to(_f32)
    sumlx, suml2 = _sum(w * x * L), _sum(w * L * L)
    # a pass that changes nothing leaves the state as it was, so running all 5 for every group
    # equals llama.cpp's early exit
    for _ in range(5):
        for i in range(x.shape[1]):
            xi, wi, li = x[:, i:i + 1], w[:, i:i + 1], L[:, i:i + 1]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            movable = slx > 0
            new = _nearest(_div(xi * sl2, slx, movable)).clamp(-nmax, nmax - 1).to(_f32)
            slx = slx + wi * xi * new
            sl2 = sl2 + wi * new * new
            take = movable & (new != li) & (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L[:, i:i + 1] = torch.where(take, new, li)
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    scale = torch.where(zero, torch.zeros_like(sumlx), _div(sumlx, suml2, suml2 > 0))
    return scale, torch.where(zero, torch.zeros_like(L), L + nmax)


def _requant(x, d, L, lo: int, hi: int, dm=None):
    """With the f16-rounded sub-block scales d [n, s, 1] (and mins dm), recompute each value's
    level; sub-blocks whose scale rounded to 0 keep the levels found by the search."""
    num = x if dm is None else x + dm
    new = _nearest(_div(num, d)).clamp(lo, hi) - lo
    return torch.where(d == 0, L.to(torch.int32), new)


def _f16_round(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).to(_f32)


def _q2_k(x):
    xs = x.view(-1, 16)
    scale, mins, L = _make_qkx2(xs, xs.abs(), 3, -0.5, 0.1, 15, True)
    scale, mins, L = scale.view(-1, 16), mins.view(-1, 16), L.view(-1, 16, 16)
    max_scale, max_min = _pos_max(scale), _pos_max(mins)
    ls = _nearest(_div(15.0, max_scale, max_scale > 0) * scale)
    lm = _nearest(_div(15.0, max_min, max_min > 0) * mins)
    d, dmin = max_scale / 15, max_min / 15
    dl = (_f16_round(d) * (ls & 0xF).to(_f32)).unsqueeze(-1)
    ml = (_f16_round(dmin) * (lm & 0xF).to(_f32)).unsqueeze(-1)
    q = _requant(x.view(-1, 16, 16), dl, L, 0, 3, ml)
    return _cat(ls | (lm << 4), _pack(q.view(-1, 2, 4, 32), 2), _f16_bytes(d), _f16_bytes(dmin))


def _q3_k(x):
    scale, L = _make_q3(x.reshape(-1, 16))
    scale, L = scale.view(-1, 16), L.view(-1, 16, 16)
    max_scale = _signed_absmax(scale)
    nz = max_scale != 0
    iscale = _div(-32.0, max_scale)
    ls = torch.where(nz, _nearest(iscale * scale).clamp(-32, 31) + 32, 0)  # all-zero block: zero bytes
    d = _inv(iscale)
    lo = (ls & 0xF).view(-1, 2, 8)
    hi = (ls >> 4).view(-1, 4, 4)
    dl = (_f16_round(d) * (ls - 32).to(_f32)).unsqueeze(-1)
    q = _requant(x.view(-1, 16, 16), dl, L, -4, 3).view(-1, 256)
    hmask = _pack((q > 3).view(-1, 8, 32), 1)
    q = torch.where(q > 3, q - 4, q)
    return _cat(hmask, _pack(q.view(-1, 2, 4, 32), 2), _pack(lo, 4), _pack(hi, 2), _f16_bytes(d))


def _k_scales(x, nmax: int, rmin: float, nstep: int):
    """Shared first half of Q4_K/Q5_K: per 32-value sub-block scale/min search, 6-bit scale codes
    packed in 12 bytes, then levels recomputed with the rounded scales."""
    xs = x.view(-1, 32)
    # sqrt via f64: torch's f32 sqrt is not correctly rounded here (C's sqrtf is)
    av = (_sum(xs * xs) / 32).double().sqrt().float()
    scale, mins, L = _make_qkx2(xs, av + xs.abs(), nmax, rmin, 0.1, nstep, False)
    scale, mins, L = scale.view(-1, 8), mins.view(-1, 8), L.view(-1, 8, 32)
    max_scale, max_min = _pos_max(scale), _pos_max(mins)
    ls = _nearest(_div(63.0, max_scale, max_scale > 0) * scale).clamp(0, 63)
    lm = _nearest(_div(63.0, max_min, max_min > 0) * mins).clamp(0, 63)
    packed = torch.cat([
        ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
        lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
        (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
    ], dim=1)
    d, dmin = max_scale / 63, max_min / 63
    dl = (_f16_round(d) * ls.to(_f32)).unsqueeze(-1)
    ml = (_f16_round(dmin) * lm.to(_f32)).unsqueeze(-1)
    q = _requant(x.view(-1, 8, 32), dl, L, 0, nmax, ml)
    return _cat(_f16_bytes(d), _f16_bytes(dmin), packed), q


def _q4_k(x):
    head, q = _k_scales(x, 15, -1.0, 20)
    return _cat(head, _pack(q.view(-1, 4, 2, 32), 4))


def _q5_k(x):
    head, q = _k_scales(x, 31, -0.5, 15)
    return _cat(head, _pack(q >> 4, 1), _pack((q & 0xF).view(-1, 4, 2, 32), 4))


def _q6_k(x):
    scale, L = _make_qx(x.reshape(-1, 16), 32)
    scale, L = scale.view(-1, 16), L.view(-1, 16, 16)
    max_scale = _signed_absmax(scale)
    zero = max_scale.abs() < GROUP_MAX_EPS
    iscale = _div(-128.0, max_scale, ~zero)
    d = _inv(iscale)
    sc = _nearest(iscale * scale).clamp(max=127)
    dl = (_f16_round(d) * sc.to(_f32)).unsqueeze(-1)
    q = _requant(x.view(-1, 16, 16), dl, L, -32, 31)
    q = torch.where(zero.unsqueeze(-1), 0, q).view(-1, 2, 4, 32)  # an all-zero block is all zero bytes
    # per 128-half: byte c holds values c (low nibble) and 64 + c (high nibble)
    ql = _pack((q & 0xF).view(-1, 2, 2, 64), 4)
    return _cat(ql, _pack(q >> 4, 2), sc.to(torch.int8).view(torch.uint8), _f16_bytes(d))


def _float_bytes(dtype: torch.dtype):
    return lambda x: x.to(dtype).contiguous().view(torch.uint8)


ENCODERS = {
    T.F32: _float_bytes(_f32), T.F16: _float_bytes(torch.float16), T.BF16: _bf16,
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.Q8_1: _q8_1,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.Q8_K: _q8_k,
    T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0, T.MXFP4: _mxfp4,
}
if hasattr(T, "Q1_0"):  # newer than some gguf-py releases
    ENCODERS[T.Q1_0] = _q1_0

#: the types `quantize` can write
ENCODABLE: frozenset[GGMLType] = frozenset(ENCODERS)


def quantize(x, qtype):
    """f32 values -> GGML blocks of `qtype` as uint8 with shape (*x.shape[:-1], row bytes).

    Returns numpy for numpy input and torch for torch input (gguf's writer takes the numpy
    form with raw_dtype=qtype). The last dimension must be a whole number of blocks."""
    qtype = as_type(qtype)
    enc = ENCODERS.get(qtype)
    if enc is None:
        raise QuantError(f"cannot quantize to {type_name(qtype)}")
    is_np = not isinstance(x, torch.Tensor)
    t = torch.from_numpy(np.asarray(x, dtype=np.float32)) if is_np else x.detach().to(_f32)
    shape = tuple(t.shape) or (1,)
    bs, ts = block_size(qtype), type_size(qtype)
    if shape[-1] % bs:
        raise QuantError(f"{qtype.name}: row length {shape[-1]} is not a multiple of the block size {bs}")
    n_blocks = t.numel() // bs
    if n_blocks == 0:
        out = torch.empty((*shape[:-1], 0), dtype=torch.uint8)
    else:
        blocks = enc(t.contiguous().view(n_blocks, bs))
        out = blocks.contiguous().view(*shape[:-1], shape[-1] // bs * ts)
    return out.numpy() if is_np else out
