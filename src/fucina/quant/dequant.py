"""Dequantize GGML blocks to f32 with vectorized torch: the reference path every kernel is
tested against and the runtime falls back to.

Each decoder takes the blocks as a uint8 tensor [n_blocks, type_size] and returns f32 with
n_blocks * block_size elements. The float arithmetic is done in the same order, in f32, as
gguf-py's numpy reference (and llama.cpp's dequantize_row_*), so results are bit-exact: every
product or sum below rounds exactly once, where the reference rounds.
"""
from __future__ import annotations

from typing import Callable

import torch

from fucina.errors import QuantError
from fucina.gguf import GGMLType, type_name
from fucina.quant import tables
from fucina.quant.formats import as_bytes, as_type, row_bytes, type_size

T = GGMLType
QK_K = 256
_f32 = torch.float32


# ---- field readers: small fields are copied out (cheap), bulk quants stay strided views ----

def _view(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as `dtype`; copies only when torch's view needs it (a strided
    slice, or a storage offset that is not a multiple of the element size)."""
    width = torch.empty((), dtype=dtype).element_size()
    if not b.is_contiguous() or b.storage_offset() % width:
        b = b.clone(memory_format=torch.contiguous_format)
    return b.view(dtype)


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The f16 at byte `off` of each block, as f32 [n, 1]."""
    return _view(b[:, off:off + 2], torch.float16).to(_f32)


def _ints(b: torch.Tensor, off: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` little-endian integers of `dtype` at byte `off`, widened to int32 [n, count].
    Unsigned 16-bit fields are masked back to 0..65535; callers mask 32-bit fields as they shift."""
    width = torch.empty((), dtype=dtype).element_size()
    v = _view(b[:, off:off + width * count], dtype).to(torch.int32)
    return v & 0xFFFF if dtype == torch.int16 else v


def _shifted(x: torch.Tensor, shifts, mask: int) -> torch.Tensor:
    """(x[..., None, :] >> s) & mask for each s: [..., k] -> [..., len(shifts), k]."""
    s = torch.tensor(shifts, dtype=x.dtype).view(-1, 1)
    return (x.unsqueeze(-2) >> s) & mask


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2, k]: the low nibbles, then the high ones (ggml's order)."""
    return _shifted(qs, (0, 4), 0xF)


def _bits(x: torch.Tensor, n: int = 8) -> torch.Tensor:
    """[..., k] -> [..., n, k] single bits, bit i of every byte in row i."""
    return _shifted(x, tuple(range(n)), 1)


def _bits_per_byte(x: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., k, 8] bits, byte-major (for sign bytes and qh bitfields)."""
    return (x.unsqueeze(-1) >> torch.arange(8, dtype=x.dtype)) & 1


def _signs(bits: torch.Tensor) -> torch.Tensor:
    return 1.0 - 2.0 * bits.to(_f32)


# ---- legacy 32-element quants ----

def _q4_0(b):
    return _f16(b, 0).unsqueeze(-1) * (_nibbles(b[:, 2:]).to(_f32) - 8.0)


def _q4_1(b):
    d, m = _f16(b, 0).unsqueeze(-1), _f16(b, 2).unsqueeze(-1)
    return d * _nibbles(b[:, 4:]).to(_f32) + m


def _q5(b, off: int) -> torch.Tensor:
    """5-bit values of Q5_0/Q5_1: 4 low bits in nibbles, the 5th in a 32-bit mask at `off`."""
    qh = _ints(b, off, 1, torch.int32)
    hi = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    return _nibbles(b[:, off + 4:]).reshape(-1, 32).to(torch.int32) | (hi << 4)


def _q5_0(b):
    return _f16(b, 0) * (_q5(b, 2) - 16).to(_f32)


def _q5_1(b):
    return _f16(b, 0) * _q5(b, 4).to(_f32) + _f16(b, 2)


def _q8_0(b):
    return b[:, 2:].view(torch.int8).to(_f32) * _f16(b, 0)


def _q8_1(b):
    # d, then s = d * sum(qs) (a matmul helper, not needed to decode)
    return b[:, 4:].view(torch.int8).to(_f32) * _f16(b, 0)


def _q1_0(b):
    d = _f16(b, 0)
    return torch.where(_bits_per_byte(b[:, 2:]).reshape(-1, 128).bool(), d, -d)


def _mxfp4(b):
    d = tables.e8m0_half()[b[:, :1].long()].unsqueeze(-1)
    return d * tables.kvalues_fp4()[_nibbles(b[:, 1:]).long()]


def _nvfp4(b):
    d = tables.ue4m3_half()[b[:, :4].long()].view(-1, 4, 1, 1)
    q = _nibbles(b[:, 4:].reshape(-1, 4, 8))                 # [n, 4 sub-blocks, lo/hi, 8]
    return d * tables.kvalues_fp4()[q.long()]


def _iq4_nl(b):
    return _f16(b, 0).unsqueeze(-1) * tables.kvalues_iq4nl()[_nibbles(b[:, 2:]).long()]


# ---- K-quants: 256-element super-blocks with packed sub-block scales ----

def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed into 12 bytes (Q4_K, Q5_K)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.to(_f32), mn.to(_f32)


def _q2_k(b):
    sc = b[:, :16]
    dl = (_f16(b, 80) * (sc & 0xF).to(_f32)).unsqueeze(-1)
    ml = (_f16(b, 82) * (sc >> 4).to(_f32)).unsqueeze(-1)
    q = _shifted(b[:, 16:80].reshape(-1, 2, 32), (0, 2, 4, 6), 3).reshape(-1, 16, 16)
    return dl * q.to(_f32) - ml


def _q3_k(b):
    lo = _nibbles(b[:, 96:104]).reshape(-1, 16)
    hi = _shifted(b[:, 104:108], (0, 2, 4, 6), 3).reshape(-1, 16)
    scales = ((lo | (hi << 4)).to(torch.int32) - 32).to(_f32)
    dl = (_f16(b, 108) * scales).unsqueeze(-1)
    ql = _shifted(b[:, 32:96].reshape(-1, 2, 32), (0, 2, 4, 6), 3).reshape(-1, 16, 16)
    qh = _bits(b[:, :32]).reshape(-1, 16, 16)
    # a set hmask bit means "no -4 offset"
    q = ql.to(torch.int32) - ((qh ^ 1).to(torch.int32) << 2)
    return dl * q.to(_f32)


def _q4_k(b):
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).unsqueeze(-1)
    dm = (_f16(b, 2) * mn).unsqueeze(-1)
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return d * q.to(_f32) - dm


def _q5_k(b):
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).unsqueeze(-1)
    dm = (_f16(b, 2) * mn).unsqueeze(-1)
    ql = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    qh = _bits(b[:, 16:48])
    return d * (ql | (qh << 4)).to(_f32) - dm


def _q6_k(b):
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).to(_f32)).unsqueeze(-1)
    ql = _nibbles(b[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    qh = _shifted(b[:, 128:192].reshape(-1, 2, 32), (0, 2, 4, 6), 3).reshape(-1, 8, 32)
    q = (ql | (qh << 4)).to(torch.int32) - 32
    return d * q.reshape(-1, 16, 16).to(_f32)


def _q8_k(b):
    d = _view(b[:, :4], _f32)
    return d * b[:, 4:260].view(torch.int8).to(_f32)


# ---- ternary ----

_POW3 = (1, 3, 9, 27, 81)


def _tq1_0(b):
    def digits(x, k):  # x * 3^i (mod 256) keeps the i-th base-3 digit in the top bits
        return (x.unsqueeze(-2) * torch.tensor(_POW3[:k], dtype=torch.uint8).view(-1, 1)).reshape(x.shape[0], -1)
    q = torch.cat([digits(b[:, :32], 5), digits(b[:, 32:48], 5), digits(b[:, 48:52], 4)], dim=1)
    q = ((q.to(torch.int32) * 3) >> 8) - 1
    return _f16(b, 52) * q.to(_f32)


def _tq2_0(b):
    q = _shifted(b[:, :64].reshape(-1, 2, 32), (0, 2, 4, 6), 3).reshape(-1, 256)
    return _f16(b, 64) * (q.to(torch.int32) - 1).to(_f32)


# ---- i-quants: grid codebooks indexed per group of 8 (or 4) values ----

def _iq_scale(d, s, half: float):
    """db = d * (0.5 + s) * half, in the reference's order."""
    return d * (0.5 + s.to(_f32)) * half


def _iq2_xxs(b):
    qs = _ints(b, 2, 16, torch.int32).view(-1, 8, 2)
    aux, sg = b[:, 2:].reshape(-1, 8, 8)[:, :, :4], qs[..., 1]
    db = _iq_scale(_f16(b, 0), (sg >> 28) & 0xF, 0.25).view(-1, 8, 1, 1)
    signs = tables.ksigns_f32()[((sg.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], dtype=torch.int32)) & 0x7F).long()]
    grid = tables.iq_grid("IQ2_XXS")[aux.long()]
    return db * grid * signs


def _iq2_xs(b):
    qs = _ints(b, 2, 32, torch.int16)
    sc = _nibbles(b[:, 66:74]).transpose(1, 2).reshape(-1, 16)
    db = _iq_scale(_f16(b, 0), sc, 0.25).view(-1, 16, 1, 1)
    signs = tables.ksigns_f32()[(qs >> 9).long()].view(-1, 16, 2, 8)
    grid = tables.iq_grid("IQ2_XS")[(qs & 511).long()].view(-1, 16, 2, 8)
    return db * grid * signs


def _iq2_s(b):
    sc = _nibbles(b[:, 74:82]).transpose(1, 2).reshape(-1, 16)
    db = _iq_scale(_f16(b, 0), sc, 0.25).view(-1, 16, 1, 1)
    signs = _signs(_bits_per_byte(b[:, 34:66])).view(-1, 16, 2, 8)
    qh = _shifted(b[:, 66:74], (0, 2, 4, 6), 3).transpose(1, 2).reshape(-1, 32)
    idx = b[:, 2:34].to(torch.int32) | (qh.to(torch.int32) << 8)
    grid = tables.iq_grid("IQ2_S")[idx.long()].view(-1, 16, 2, 8)
    return db * grid * signs


def _iq3_xxs(b):
    sg = _ints(b, 66, 8, torch.int32)
    db = _iq_scale(_f16(b, 0), (sg >> 28) & 0xF, 0.5).view(-1, 8, 1, 1)
    signs = tables.ksigns_f32()[((sg.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], dtype=torch.int32)) & 0x7F).long()]
    grid = tables.iq_grid("IQ3_XXS")[b[:, 2:66].long()].view(-1, 8, 4, 8)
    return db * grid * signs


def _iq3_s(b):
    sc = _nibbles(b[:, 106:110]).transpose(1, 2).reshape(-1, 8)
    db = (_f16(b, 0) * (1 + 2 * sc.to(torch.int32)).to(_f32)).view(-1, 8, 1, 1)
    signs = _signs(_bits_per_byte(b[:, 74:106])).view(-1, 8, 4, 8)
    qh = _bits_per_byte(b[:, 66:74]).reshape(-1, 64)
    idx = b[:, 2:66].to(torch.int32) | (qh.to(torch.int32) << 8)
    grid = tables.iq_grid("IQ3_S")[idx.long()].view(-1, 8, 4, 8)
    return db * grid * signs


_IQ1_DELTA = 0.125


def _iq1_s(b):
    qh = _ints(b, 34, 8, torch.int16)
    dl = (_f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).to(_f32)).view(-1, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).view(-1, 8, 1, 1)
    hi = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], dtype=torch.int32)) & 7
    idx = b[:, 2:34].to(torch.int32) | (hi.reshape(-1, 32) << 8)
    grid = tables.iq_grid("IQ1_S")[idx.long()].view(-1, 8, 4, 8)
    return dl * (grid + delta)


def _iq1_m(b):
    sc = _ints(b, 48, 4, torch.int16)
    # the f16 super-scale is spread over the top nibble of the four scale words
    dbits = ((sc >> 12) << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(-1, keepdim=True)
    d = dbits.to(torch.int16).view(torch.float16).to(_f32)
    s = ((sc.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], dtype=torch.int32)) & 7).reshape(-1, 16)
    dl = (d * (2 * s + 1).to(_f32)).view(-1, 8, 2, 1, 1)
    qh = _nibbles(b[:, 32:48]).transpose(1, 2).reshape(-1, 32)
    idx = b[:, :32].to(torch.int32) | ((qh & 7).to(torch.int32) << 8)
    delta = torch.where((qh & 8) == 0, _IQ1_DELTA, -_IQ1_DELTA).view(-1, 8, 2, 2, 1)
    grid = tables.iq_grid("IQ1_S")[idx.long()].view(-1, 8, 2, 2, 8)
    return dl * (grid + delta)


def _iq4_xs(b):
    sh = _ints(b, 2, 1, torch.int16)
    lo = _nibbles(b[:, 4:8]).transpose(1, 2).reshape(-1, 8).to(torch.int32)
    hi = (sh >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3
    dl = (_f16(b, 0) * ((lo | (hi << 4)) - 32).to(_f32)).view(-1, 8, 1)
    q = _nibbles(b[:, 8:].reshape(-1, 4, 16)).reshape(-1, 8, 32)
    return dl * tables.kvalues_iq4nl()[q.long()]


# ---- plain element types: casts ----

def _cast(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda b: _view(b, dtype).to(_f32)


def _bf16(b):
    # bf16 is the top half of an f32: widen the bits, never round
    return (_view(b, torch.int16).to(torch.int32) << 16).view(_f32)


def _f32_copy(b):
    # a copy, so callers may write to the result even when `data` is a read-only mmap view
    return _view(b, _f32).clone()


DECODERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: _f32_copy, T.F16: _cast(torch.float16), T.BF16: _bf16, T.F64: _cast(torch.float64),
    T.I8: _cast(torch.int8), T.I16: _cast(torch.int16), T.I32: _cast(torch.int32), T.I64: _cast(torch.int64),
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.Q8_1: _q8_1,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.Q8_K: _q8_k,
    T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s,
    T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
    T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0, T.MXFP4: _mxfp4,
}
for _name, _fn in (("NVFP4", _nvfp4), ("Q1_0", _q1_0)):  # newer types, absent from older gguf-py
    if hasattr(T, _name):
        DECODERS[T[_name]] = _fn


def _decoder(qtype: GGMLType):
    fn = DECODERS.get(qtype)
    if fn is None:
        raise QuantError(f"no dequantizer for {type_name(qtype)}")
    return fn


def _decode(blocks: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    if blocks.numel() == 0:
        return torch.empty(0, dtype=_f32)
    return _decoder(qtype)(blocks.view(-1, type_size(qtype))).reshape(-1)


def dequantize(data, qtype, n_elements: int | None = None) -> torch.Tensor:
    """Whole blocks of `qtype` -> f32 1-D tensor. `data` is read, never written.

    With `n_elements`, `data` must hold exactly that many elements' bytes."""
    qtype = as_type(qtype)
    fn = _decoder(qtype)
    b = as_bytes(data)
    ts = type_size(qtype)
    if n_elements is not None and b.numel() != row_bytes(qtype, n_elements):
        raise QuantError(f"{qtype.name}: {n_elements} elements need {row_bytes(qtype, n_elements)} bytes, got {b.numel()}")
    if b.numel() % ts:
        raise QuantError(f"{qtype.name}: {b.numel()} bytes is not a whole number of {ts}-byte blocks")
    if b.numel() == 0:
        return torch.empty(0, dtype=_f32)
    return fn(b.view(-1, ts)).reshape(-1)


def dequantize_rows(data2d, qtype, row_ids, row_len: int) -> torch.Tensor:
    """Dequantize only rows `row_ids` of a [n_rows, row_bytes] matrix of `row_len`-element rows
    (an embedding lookup): -> f32 [len(row_ids), row_len]. Only the chosen rows are touched."""
    qtype = as_type(qtype)
    rb = row_bytes(qtype, row_len)
    shape = tuple(getattr(data2d, "shape", ()))
    if len(shape) == 2 and shape[1] * getattr(data2d, "itemsize", 1) != rb:
        raise QuantError(f"{qtype.name}: rows of {row_len} elements take {rb} bytes, the matrix has {shape[1]}")
    b = as_bytes(data2d)
    if rb == 0 or b.numel() % rb:
        raise QuantError(f"{qtype.name}: {b.numel()} bytes is not a whole number of {rb}-byte rows")
    rows = b.view(-1, rb)
    ids = torch.as_tensor(row_ids, dtype=torch.long).reshape(-1)
    if ids.numel() and (int(ids.min()) < -rows.shape[0] or int(ids.max()) >= rows.shape[0]):
        raise QuantError(f"row id out of range for {rows.shape[0]} rows")
    return _decode(rows[ids], qtype).view(-1, row_len)
