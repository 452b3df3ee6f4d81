"""Weights in row groups (fucina.kernels.interleave): TQ2_0 in 8-row groups
(csrc/generic/tq2x8_impl.inc, the AVX2 decode GEMV), Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, MXFP4 and IQ4_NL in 16-row groups (csrc/generic/q4kx16_impl.inc, q6kx16_impl.inc, x16n_impl.inc,
q80x16_impl.inc: the AVX-512 and AVX2 decode GEMVs). Each layout round-trips,
and every route on every ISA (the GEMV for 1..8 rows where a level reads the layout, the
panel route past them and on the other units) gives the bits of the rows it came from, on
row counts that are not a multiple of the group; a model loaded at such a level computes on
the groups and gives the same logits as its rows."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import fucina.kernels as K
from fucina.gguf import GGMLType as T
from test_batch_invariance import canonical_route  # noqa: F401  (autouse: the canonical route)
from test_kernels import rand_weight

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")


@dataclass(frozen=True)
class Layout:
    fmt: T
    pseudo: int
    group: int
    unit: int           # bytes a unit (a superblock; Q4_0 .. Q8_0: two blocks)
    levels: tuple       # the ISA levels that repack (their GEMV reads the groups)
    env: str            # the variable that opts out
    elems: int = 256    # elements a unit

    def interleave(self, raw, n):
        return {T.TQ2_0: K.tq2_interleave, T.Q4_K: K.q4k_interleave, T.Q6_K: K.q6k_interleave, T.Q5_K: K.q5k_interleave,
                T.IQ4_XS: K.iq4xs_interleave, T.Q2_K: K.q2k_interleave,
                T.Q3_K: K.q3k_interleave,
                T.Q5_0: K.q50_interleave, T.Q8_0: K.q80_interleave, T.Q4_0: K.q40_interleave,
                T.Q4_1: K.q41_interleave, T.Q5_1: K.q51_interleave, T.MXFP4: K.mxfp4_interleave,
                T.IQ4_NL: K.iq4nl_interleave}[self.fmt](raw, n)

    def undo(self, groups, n):
        return {T.TQ2_0: K.tq2_deinterleave, T.Q4_K: K.q4k_deinterleave, T.Q6_K: K.q6k_deinterleave,
                T.Q5_K: K.q5k_deinterleave, T.IQ4_XS: K.iq4xs_deinterleave, T.Q2_K: K.q2k_deinterleave,
                T.Q3_K: K.q3k_deinterleave,
                T.Q5_0: K.q50_deinterleave, T.Q8_0: K.q80_deinterleave, T.Q4_0: K.q40_deinterleave,
                T.Q4_1: K.q41_deinterleave, T.Q5_1: K.q51_deinterleave, T.MXFP4: K.mxfp4_deinterleave,
                T.IQ4_NL: K.iq4nl_deinterleave}[self.fmt](groups, n)

    def matmul(self, groups, n, k, x):
        y = torch.empty(x.shape[0], n)
        K._native.matmul(self.pseudo, groups.data_ptr(), k // self.elems * self.unit, n, k, x.data_ptr(), x.shape[0],
                         y.data_ptr(), n)
        return y

    def here(self):
        return [i for i in self.levels if i in K.supported_isas()]


TQ2 = Layout(T.TQ2_0, K.TQ2_X8, 8, 66, ("avx2", "avx2vnni"), "FUCINA_TQ2_X8")
Q4K = Layout(T.Q4_K, K.Q4K_X16, 16, 144, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q4K_X16")
Q6K = Layout(T.Q6_K, K.Q6K_X16, 16, 210, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q6K_X16")
Q5K = Layout(T.Q5_K, K.Q5K_X16, 16, 176, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q5K_X16")
IQ4XS = Layout(T.IQ4_XS, K.IQ4XS_X16, 16, 136, ("avx512", "avx2", "avx2vnni"), "FUCINA_IQ4XS_X16")
Q2K = Layout(T.Q2_K, K.Q2K_X16, 16, 84, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q2K_X16")
Q3K = Layout(T.Q3_K, K.Q3K_X16, 16, 110, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q3K_X16")
Q50 = Layout(T.Q5_0, K.Q50_X16, 16, 44, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q50_X16", 64)
Q80 = Layout(T.Q8_0, K.Q80_X16, 16, 68, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q80_X16", 64)
Q40 = Layout(T.Q4_0, K.Q40_X16, 16, 36, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q40_X16", 64)
Q41 = Layout(T.Q4_1, K.Q41_X16, 16, 40, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q41_X16", 64)
Q51 = Layout(T.Q5_1, K.Q51_X16, 16, 48, ("avx512", "avx2", "avx2vnni"), "FUCINA_Q51_X16", 64)
MXF4 = Layout(T.MXFP4, K.MXFP4_X16, 16, 34, ("avx512", "avx2", "avx2vnni"), "FUCINA_MXFP4_X16", 64)
IQ4NL = Layout(T.IQ4_NL, K.IQ4NL_X16, 16, 36, ("avx512", "avx2", "avx2vnni"), "FUCINA_IQ4NL_X16", 64)
ALL = {"tq2x8": TQ2, "q4kx16": Q4K, "q5kx16": Q5K, "q6kx16": Q6K, "iq4xsx16": IQ4XS, "q2kx16": Q2K, "q3kx16": Q3K, "q50x16": Q50, "q80x16": Q80, "q40x16": Q40, "q41x16": Q41,
       "q51x16": Q51, "mxfp4x16": MXF4, "iq4nlx16": IQ4NL}
LAYOUTS = pytest.mark.parametrize("lay", list(ALL.values()), ids=list(ALL))


def _raw(fmt, n: int, k: int, seed: int) -> torch.Tensor:
    """random blocks (TQ2_0: every 2-bit field 0..3, ggml reads a 3 as 2 d; f16 scales)"""
    return torch.from_numpy(rand_weight(fmt, n, k, np.random.default_rng(seed)))


def _round_trip(lay: Layout, n: int, k: int):
    """raw rows, their groups and the row count rounded up to the group: the shape, the
    inverse, zero padding rows and a typed error on bytes that are not whole superblocks"""
    undo = lay.undo
    raw = _raw(lay.fmt, n, k, n + k)
    groups, g = lay.interleave(raw, n), -(-n // lay.group) * lay.group
    assert tuple(groups.shape) == (g, raw.shape[1]) and groups.dtype is torch.uint8
    assert torch.equal(undo(groups, n), raw)
    assert int(undo(groups, g)[n:].count_nonzero()) == 0   # the padding rows
    with pytest.raises(K.KernelError):
        lay.interleave(raw[:, :lay.unit - 1].contiguous(), n)
    with pytest.raises(K.KernelError):
        undo(groups, g + 1)
    return raw, groups, g


@pytest.mark.parametrize("n,k", [(1, 256), (7, 256), (8, 512), (9, 256), (17, 768), (24, 256)])
def test_tq2_interleave_round_trips(n, k):
    raw, x8, _ = _round_trip(TQ2, n, k)
    # the documented places: row r's qs dword e and scale of superblock s in group 0
    nsb = k // 256
    grp = x8[:8].reshape(-1)
    for r, s, e in ((0, 0, 0), (min(n, 8) - 1, nsb - 1, 15), (min(n, 8) // 2, 0, 9)):
        assert torch.equal(grp[512 * s + 32 * e + 4 * r:][:4], raw[r, 66 * s + 4 * e:][:4])
        assert torch.equal(grp[512 * nsb + 16 * s + 2 * r:][:2], raw[r, 66 * s + 64:][:2])


@pytest.mark.parametrize("lay", [Q4K, Q5K, Q6K, IQ4XS, Q2K, Q3K],
                         ids=["q4kx16", "q5kx16", "q6kx16", "iq4xsx16", "q2kx16", "q3kx16"])
@pytest.mark.parametrize("n,k", [(1, 256), (15, 256), (16, 512), (33, 768)])
def test_x16_interleave_round_trips(lay, n, k):
    """the documented places in group 0: a superblock's dword e of row r at 64 e + 4 r (Q4_K:
    d | dmin, the 3 scale dwords, the 32 qs dwords; Q5_K: the 8 qh dwords between; Q6_K: the
    52 dwords before d; IQ4_XS: d | scales_h, scales_l, the 32 qs dwords; Q2_K: the 4 scale
    dwords, the 16 qs dwords, d | dmin; Q3_K: hmask, qs and the scales, 27 dwords), Q6_K's and
    Q3_K's d of row r after them"""
    raw, x16, _ = _round_trip(lay, n, k)
    nsb, ncol = k // 256, lay.unit // 4
    grp = x16[:16].reshape(-1)
    for r, s in ((0, 0), (min(n, 16) - 1, nsb - 1), (min(n, 16) // 2, nsb // 2)):
        sb = grp[16 * lay.unit * s:]
        for e in range(ncol):
            assert torch.equal(sb[64 * e + 4 * r:][:4], raw[r, lay.unit * s + 4 * e:][:4]), (r, s, e)
        if lay.unit % 4:   # Q6_K, Q3_K: the f16 d
            assert torch.equal(sb[64 * ncol + 2 * r:][:2], raw[r, lay.unit * s + 4 * ncol:][:2])


def _q50_fifth_bit(qh: torch.Tensor, e: int) -> int:
    return int(qh[e // 8]) >> (e % 8) & 1


#: the nibble formats' byte places in a unit (csrc/generic/x16n_impl.inc): unit bytes, block
#: bytes, whether [d | m] columns (else column 0 holds both d), the qh column (0: none), the qs
#: columns; the block's qh and qs offsets
_NIBBLE = {T.Q4_0: (576, 18, False, 0, 64, None, 2), T.IQ4_NL: (576, 18, False, 0, 64, None, 2),
           T.Q4_1: (640, 20, True, 0, 128, None, 4),
           T.Q5_0: (704, 22, False, 64, 192, 2, 6), T.Q5_1: (768, 24, True, 128, 256, 4, 8)}


@pytest.mark.parametrize("lay", [Q40, Q41, Q50, Q51, IQ4NL], ids=["q40x16", "q41x16", "q50x16", "q51x16", "iq4nlx16"])
@pytest.mark.parametrize("n,k", [(1, 64), (15, 128), (16, 256), (33, 640)])
def test_nibble_interleave_round_trips(lay, n, k):
    """the documented places in group 0, unit u, block 2 u + h, row r: Q4_0, Q5_0: d at 4 r + 2 h;
    Q4_1, Q5_1: [d | m] at 64 h + 4 r; Q5: qh transposed at QH0 + 64 h + 4 r (element
    16 s + 4 i + t's fifth bit at bit 8 t + 4 s + i); qs dword i at QS0 + 256 h + 64 i + 4 r"""
    unit, bb, dm, qh0, qs0, qh_at, qs_at = _NIBBLE[lay.fmt]
    raw, x16, _ = _round_trip(lay, n, k)
    grp = x16[:16].reshape(-1)
    for r, u, h in ((0, 0, 0), (min(n, 16) - 1, k // 64 - 1, 1), (min(n, 16) // 2, k // 128, 1)):
        unt, blk = grp[unit * u:], raw[r, 2 * bb * u + bb * h:][:bb]
        if dm:
            assert torch.equal(unt[64 * h + 4 * r:][:4], blk[:4])
        else:
            assert torch.equal(unt[4 * r + 2 * h:][:2], blk[:2])
        if qh_at is not None:
            qh = int.from_bytes(bytes(unt[qh0 + 64 * h + 4 * r:][:4].tolist()), "little")
            for e in range(32):
                s, i, t = e // 16, e % 16 // 4, e % 4
                assert qh >> (8 * t + 4 * s + i) & 1 == _q50_fifth_bit(blk[qh_at:qh_at + 4], e), (r, u, h, e)
        for i in range(4):
            assert torch.equal(unt[qs0 + 256 * h + 64 * i + 4 * r:][:4], blk[qs_at + 4 * i:][:4])


@pytest.mark.parametrize("n,k", [(1, 64), (15, 128), (33, 640)])
def test_q80_interleave_round_trips(n, k):
    """the documented places in group 0, unit u, block 2 u + h, row r: d at 4 r + 2 h; quant
    dword i at 64 + 512 h + 64 i + 4 r, each byte q ^ 0x80"""
    raw, x16, _ = _round_trip(Q80, n, k)
    grp = x16[:16].reshape(-1)
    for r, u, h in ((0, 0, 0), (min(n, 16) - 1, k // 64 - 1, 1), (min(n, 16) // 2, k // 128, 1)):
        unit, blk = grp[1088 * u:], raw[r, 68 * u + 34 * h:][:34]
        assert torch.equal(unit[4 * r + 2 * h:][:2], blk[:2])
        for i in range(8):
            assert torch.equal(unit[64 + 512 * h + 64 * i + 4 * r:][:4], blk[2 + 4 * i:][:4] ^ 0x80)


@pytest.mark.parametrize("n,k", [(1, 64), (15, 128), (33, 640)])
def test_mxfp4_interleave_round_trips(n, k):
    """the documented places in group 0, unit u, block 2 u + h, row r: the E8M0 byte at 2 r + h;
    qs dword i at 32 + 256 h + 64 i + 4 r"""
    raw, x16, _ = _round_trip(MXF4, n, k)
    grp = x16[:16].reshape(-1)
    for r, u, h in ((0, 0, 0), (min(n, 16) - 1, k // 64 - 1, 1), (min(n, 16) // 2, k // 128, 1)):
        unit, blk = grp[544 * u:], raw[r, 34 * u + 17 * h:][:17]
        assert int(unit[2 * r + h]) == int(blk[0])
        for i in range(4):
            assert torch.equal(unit[32 + 256 * h + 64 * i + 4 * r:][:4], blk[1 + 4 * i:][:4])


@pytest.mark.parametrize("lay", [Q40, Q41, Q50, Q51, Q80, MXF4, IQ4NL],
                         ids=["q40x16", "q41x16", "q50x16", "q51x16", "q80x16", "mxfp4x16", "iq4nlx16"])
def test_rows_of_an_odd_block_count_stay_rows(lay):
    """rows of 3 blocks do not cut into two-block units: the weight keeps its rows (and the
    interleave says why in a typed error)"""
    from fucina.weights import LinearWeight
    raw = _raw(lay.fmt, 16, 96, 3)
    with pytest.raises(K.KernelError, match=lay.fmt.name):
        lay.interleave(raw, 16)
    w = LinearWeight(raw.clone(), lay.fmt, 16, 96, "w")
    K.attach(w)
    assert K.layout_group(w) is None and not K.interleave(w) and w.kernel.qtype == int(lay.fmt)


@pytest.mark.parametrize("huge", [True, False], ids=["huge-pages", "plain-pages"])
def test_huge_empty_gives_the_bytes_asked_for(monkeypatch, huge):
    """huge_empty: nbytes writable bytes at any size; past 2 MB, where it asks for huge pages,
    they start on a 2 MB boundary (what the madvise covers)"""
    if not huge:
        monkeypatch.setattr(K, "_MADVISE", None)
    elif not K.hugepages():
        pytest.skip("no madvise on this host")
    for nbytes in (1, 4096, (1 << 21) - 1, (1 << 21) + 4097, 3 << 21):
        t = K.huge_empty(nbytes)
        assert t.dtype is torch.uint8 and t.shape == (nbytes,) and t.is_contiguous()
        t.fill_(7)
        assert int(t.sum()) == 7 * nbytes
        if huge and nbytes >= 1 << 21:
            assert t.data_ptr() % (1 << 21) == 0


@LAYOUTS
def test_interleave_past_a_huge_page_round_trips(lay):
    """a layout larger than a huge page (its copy in huge_empty's bytes) round-trips"""
    n = {T.TQ2_0: 4157, T.Q5_0: 2989, T.Q4_0: 3011, T.Q4_1: 2711, T.Q2_K: 3301, T.Q3_K: 2683}.get(lay.fmt, 2077)   # not a multiple of the group: padding rows too
    raw, groups, _ = _round_trip(lay, n, 2048)
    assert groups.numel() > 1 << 21


def _uniform_rows(fmt: T, n: int, k: int, fill: int, scales: int | None = None) -> torch.Tensor:
    """n rows of one block repeated: every byte fill (the first `scales` bytes 0xFF: Q2_K's
    scales and mins 15), its f16 fields 2^-7 and an E8M0 scale 2^-8"""
    from test_kernels import E8M0_FIELDS, F16_FIELDS
    from fucina.gguf import TYPE_SIZES
    bs, ts = TYPE_SIZES[fmt]
    blk = np.full(ts, fill, dtype=np.uint8)
    if scales:
        blk[:scales] = 0xFF
    for o in F16_FIELDS[fmt]:
        blk[o:o + 2] = np.array([0x2000], dtype=np.uint16).view(np.uint8)
    for o in E8M0_FIELDS.get(fmt, []):
        blk[o] = 120
    return torch.from_numpy(np.tile(blk, n * (k // bs)).reshape(n, -1))


def _equal_to_scalar(raw, fmt: T, n: int, k: int, x: torch.Tensor, isa: str, lay=None) -> None:
    """rows (and lay's groups of them) at m = 1..9 and 20 give the scalar unit's bits, which are
    nonzero where x's row 0 (every q +127) meets them"""
    K.set_isa("scalar")
    try:
        ref = K.matmul(raw, fmt, n, k, x)
    finally:
        K.set_isa(isa)
    assert bool(ref[0].ne(0).all())
    groups = lay.interleave(raw, n) if lay else None
    for m in (*range(1, 10), 20):
        assert torch.equal(K.matmul(raw, fmt, n, k, x[:m]), ref[:m]), f"rows m={m} on {isa}"
        if lay:
            assert torch.equal(lay.matmul(groups, n, k, x[:m].contiguous()), ref[:m]), f"groups m={m} on {isa}"


@pytest.mark.parametrize("lay", [Q2K, Q3K], ids=["q2kx16", "q3kx16"])
@pytest.mark.parametrize("high", [True, False], ids=["largest", "smallest"])
def test_k23_panels_at_their_int16_bounds(lay, high, isa):
    """The panel kernels sum a Q2_K / Q3_K 16-group's (u - z) q and its min term in int16 halves:
    groups at the bounds give the scalar unit's bits, rows and groups, at m = 1..9 and 20. Every
    activation q is +-127; every value is at its largest (Q2_K 3, Q3_K +3) or (not high) its
    smallest (0, Q3_K -4, with Q3_K's scale -32), Q2_K's scales and mins 15"""
    n, k = 19, 512
    raw = _uniform_rows(lay.fmt, n, k, 0xFF if high else 0x00, scales=16 if lay.fmt == T.Q2_K else None)
    x = torch.ones(20, k)
    x[1::2, 256:] = -1.0                                          # -127 in every other row's second superblock
    _equal_to_scalar(raw, lay.fmt, n, k, x, isa, lay)


@pytest.mark.parametrize("fmt", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.MXFP4], ids=lambda f: f.name)
def test_int16_runs_at_the_largest_values(fmt, isa):
    """Without VNNI the AVX2 panel kernel adds 8 (4-bit values) or 4 (5-bit, MXFP4) dwords'
    vpmaddubsw sums in int16 before widening them (cb_u16_run), the groups' GEMVs 4: every
    value at its largest against every q at +127 gives the scalar unit's bits at m = 1..9 and
    20, rows and groups"""
    n, k = 19, 512
    raw = _uniform_rows(fmt, n, k, 0x77 if fmt == T.MXFP4 else 0xFF)   # MXFP4: code 7, u = 24
    lay = {T.Q4_0: Q40, T.Q4_1: Q41, T.Q4_K: Q4K, T.Q5_0: Q50, T.Q5_1: Q51, T.Q5_K: Q5K, T.MXFP4: MXF4}[fmt]
    _equal_to_scalar(raw, fmt, n, k, torch.ones(20, k), isa, lay)   # and the groups' GEMVs and panels


@pytest.mark.parametrize("fill", [0x00, 0xFF], ids=["code0", "code15"])
def test_iq4nl_groups_at_their_extreme_codes(fill, isa):
    """IQ4_NL's groups without VNNI take the sign trick (u up to 241 would saturate
    vpmaddubsw): every code at -127 (code 0) or +113 (code 15) against q = +-127 gives the
    scalar unit's bits, rows and groups, at m = 1..9 and 20"""
    n, k = 19, 512
    x = torch.ones(20, k)
    x[1::2, 256:] = -1.0
    _equal_to_scalar(_uniform_rows(T.IQ4_NL, n, k, fill), T.IQ4_NL, n, k, x, isa, IQ4NL)


@LAYOUTS
@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (9, 256), (17, 256), (20, 768), (37, 1024)])
def test_groups_equal_rows_bitwise(lay, n, k, isa):
    """m = 1..8 (the GEMV where a level reads the groups), 9 and 20 (panels): == the rows on
    this ISA == each activation row alone == the scalar unit's rows; close to the torch
    reference."""
    raw = _raw(lay.fmt, n, k, 7 * n + k)
    groups = lay.interleave(raw, n)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(n))
    K.set_isa("scalar")
    try:
        ref = K.matmul(raw, lay.fmt, n, k, x)
    finally:
        K.set_isa(isa)
    alone = torch.cat([lay.matmul(groups, n, k, x[i:i + 1].contiguous()) for i in range(20)])
    assert torch.equal(alone, ref), isa
    for m in (*range(1, 9), 9, 20):
        got = lay.matmul(groups, n, k, x[:m].contiguous())
        assert torch.equal(got, K.matmul(raw, lay.fmt, n, k, x[:m])), f"n={n} k={k} m={m} on {isa}"
        assert torch.equal(got, ref[:m]), f"n={n} k={k} m={m} on {isa}"
    from fucina.quant import dequantize
    w = dequantize(raw.reshape(-1), lay.fmt, n * k).reshape(n, k)
    want = K.act_roundtrip(x).reshape(x.shape) @ w.T
    torch.testing.assert_close(ref, want, rtol=1e-4, atol=1e-3 * float(want.abs().max()))


@LAYOUTS
def test_gemv_probe_takes_groups(lay):
    if not lay.here():
        pytest.skip("no level here reads these groups")
    before = K.isa()
    try:
        for name in lay.here():
            K.set_isa(name)
            assert K._native.gemv_rows(lay.pseudo) == 8
    finally:
        K.set_isa(before)


@LAYOUTS
def test_weight_interleaves_where_its_gemv_reads_groups_and_keeps_rows(lay, monkeypatch):
    from fucina.weights import LinearWeight
    monkeypatch.delenv(lay.env, raising=False)
    n, k = 21, 512
    raw = _raw(lay.fmt, n, k, 5)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([0, 20, 7, 8, 3, 16, 20])
    before = K.isa()
    try:
        for name in K.supported_isas():
            K.set_isa(name)
            w = LinearWeight(raw.clone(), lay.fmt, n, k, "w")
            K.attach(w)
            canon, rows = w(x), w.rows(ids)
            assert K.interleave(w) == (name in lay.levels)
            assert torch.equal(w.raw, raw)    # the weight keeps its rows
            assert torch.equal(w(x), canon) and torch.equal(w.rows(ids), rows)
            if name in lay.levels:
                assert w.kernel.qtype == lay.pseudo and torch.equal(K.deinterleave(w.kernel), raw)
                with pytest.raises(K.KernelError):
                    w.kernel.rows(torch.tensor([n]))
                with pytest.raises(Exception):
                    w.rows(torch.tensor([-1]))
    finally:
        K.set_isa(before)


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    import gguf
    from synth import write_model
    d = tmp_path_factory.mktemp("row_groups")
    # TQ2_0: 260 ffn rows (gate/up fused: 520) and 36 kv rows; Q4_K: an untied head of 260
    # rows: groups with a tail
    return {T.TQ2_0: str(write_model(d / "tq2.gguf", "qwen3", qtype=gguf.GGMLQuantizationType.TQ2_0, hidden=256,
                                     heads=4, kv_heads=2, head_dim=64, ffn=512, layers=2, seed=11)),
            T.Q4_K: str(write_model(d / "q4k.gguf", "qwen3", qtype=gguf.GGMLQuantizationType.Q4_K, hidden=256,
                                    heads=4, kv_heads=2, head_dim=64, ffn=512, layers=2, seed=12, tied=False)),
            T.Q6_K: str(write_model(d / "q6k.gguf", "qwen3", qtype=gguf.GGMLQuantizationType.Q6_K, hidden=256,
                                    heads=4, kv_heads=2, head_dim=64, ffn=512, layers=2, seed=13, tied=False)),
            T.Q5_0: str(write_model(d / "q50.gguf", "qwen3", qtype=gguf.GGMLQuantizationType.Q5_0, hidden=256,
                                    heads=4, kv_heads=2, head_dim=64, ffn=512, layers=2, seed=14, tied=False)),
            T.Q8_0: str(write_model(d / "q80.gguf", "qwen3", qtype=gguf.GGMLQuantizationType.Q8_0, hidden=256,
                                    heads=4, kv_heads=2, head_dim=64, ffn=512, layers=2, seed=15, tied=False)),
            **{fmt: str(write_model(d / f"{fmt.name}.gguf", "qwen3", qtype=gguf.GGMLQuantizationType[fmt.name],
                                    hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, layers=2, seed=16 + i,
                                    tied=False))
               for i, fmt in enumerate((T.Q4_0, T.Q4_1, T.Q5_1, T.Q5_K, T.Q2_K, T.Q3_K))}}


#: the layouts a synthetic model is written in (fucina.quant has no IQ4_XS or IQ4_NL quantizer:
#: their groups are checked bitwise on weights above, and on llama-quantize files in BENCHMARK.md;
#: MXFP4: gpt-oss's expert stacks, below)
MODEL_LAYOUTS = {name: lay for name, lay in ALL.items() if lay not in (IQ4XS, MXF4, IQ4NL)}


@pytest.mark.parametrize("lay,level", [(lay, level) for name, lay in MODEL_LAYOUTS.items() for level in ("avx512", "avx2")
                                       if name != "tq2x8" or level == "avx2"],
                         ids=[f"{name}-{level}" for name in MODEL_LAYOUTS for level in ("avx512", "avx2")
                              if name != "tq2x8" or level == "avx2"])
def test_model_on_groups_gives_the_rows_logits(model_paths, monkeypatch, lay, level):
    """load_model at a level that reads the groups repacks the layer weights (the native plan
    computes on them): prefill, decode and a 3-row verify give the logits of the same model on
    its rows."""
    if level not in K.supported_isas():
        pytest.skip(f"no {level} on this CPU")
    from fucina.errors import FucinaError
    from fucina.models import load_model
    from fucina.weights.row_groups import GroupedWeight
    before = K.isa()
    try:
        K.set_isa(level)
        monkeypatch.setenv(lay.env, "0")
        rows = load_model(model_paths[lay.fmt])
        monkeypatch.setenv(lay.env, "1")
        grp = load_model(model_paths[lay.fmt])
        L, R = grp.layers[0], rows.layers[0]
        assert L.wqkv.kernel.qtype == lay.pseudo and L.w_gate_up.kernel.qtype == lay.pseudo
        assert R.wqkv.kernel.qtype == int(lay.fmt)
        assert L.wq.kernel.qtype == int(lay.fmt)   # a fused weight's parts are left as they are
        if lay.fmt != T.TQ2_0:
            assert grp.output.kernel.qtype == lay.pseudo and grp.output.out_features == 260
        # the fused weight's stacked rows are dropped; raw rebuilds them from the groups
        assert isinstance(L.w_gate_up, GroupedWeight) and "raw" not in vars(L.w_gate_up)
        assert torch.equal(L.w_gate_up.raw, R.w_gate_up.raw) and L.w_gate_up.nbytes == R.w_gate_up.nbytes
        assert torch.equal(L.wqkv.dequantize(), R.wqkv.dequantize())
        with pytest.raises(FucinaError, match="row groups"):
            L.wqkv.raw = R.wqkv.raw
        ids = torch.tensor([3, 17, 42, 5, 9, 100, 7])
        outs = []
        for m in (rows, grp):
            c = m.init_cache(16)
            a = m.forward_step_all_logits(c, ids[:4], 0)
            b = m.forward_step(c, ids[4:5], 4)
            v = m.forward_step_all_logits(c, ids[5:], 5)
            outs.append((a, b, v))
        for x, y in zip(*outs):
            assert torch.equal(x, y)
    finally:
        K.set_isa(before)


def _moe_file(d, kind: str, qtype: str = "Q4_K") -> str:
    import gguf
    from synth import write_model
    from synth_deepseek2 import write_deepseek2
    from synth_gemma4 import write_gemma4
    q = gguf.GGMLQuantizationType[qtype]
    if kind == "qwen3moe":      # gate, up, down stacks of 8 experts, 256 rows each
        return str(write_model(d / f"q3moe-{qtype}.gguf", "qwen3moe", qtype=q, hidden=256, heads=4, kv_heads=2,
                               head_dim=64, ffn=512, layers=2, seed=21, experts=8, experts_used=2, moe_ffn=256))
    if kind == "deepseek2":     # one fused gate_up stack, read as two strided views
        return str(write_deepseek2(d / "ds2.gguf", layers=3, hidden=256, q_lora=256, kv_lora=256, ffn=256,
                                   ffn_exp=256, experts=4, used=2, fused_gate_up=True, qtype=q, seed=22,
                                   v_head=64, generation="kv_b"))
    return str(write_gemma4(d / "g4.gguf", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
                            qtype=q, experts=4, experts_used=2, moe_ffn=256, fused_experts=True, seed=23, ple=0,
                            head_dim_swa=64))


@pytest.mark.parametrize("kind,level", [("qwen3moe", "avx512"), ("deepseek2", "avx512"), ("deepseek2", "avx2"),
                                        ("gemma4", "avx2")])
def test_moe_on_grouped_expert_stacks_gives_the_rows_logits(tmp_path, kind, level):
    """The expert stacks go to 16-row groups too (each expert's rows whole groups, so expert e
    stays at e x rows x row bytes); a fused gate_up stack's two strided views read the groups.
    Prefill, decode and verify logits equal the rows'; an expert store on either model packs
    the file's rows into the groups as it reads them, and the logits stay the rows model's."""
    if level not in K.supported_isas():
        pytest.skip(f"no {level} on this CPU")
    from fucina.models import load_model
    from fucina.models.expert_store import stream_experts
    from fucina.weights.row_groups import expert_stacks, row_view
    path = _moe_file(tmp_path, kind)
    before = K.isa()
    try:
        K.set_isa(level)
        rows, grp = load_model(path, group_experts=False), load_model(path)
        moe = [i for i, L in enumerate(grp.layers) if expert_stacks(L)]
        assert moe
        for i in moe:
            for s, r in zip(expert_stacks(grp.layers[i]), expert_stacks(rows.layers[i])):
                assert s.whole.kernel.qtype == Q4K.pseudo and r.whole.kernel.qtype == int(T.Q4_K), s.name
                e = s.expert(1)   # an expert's own weight stays on the file's rows
                assert e.kernel.qtype == int(T.Q4_K) and torch.equal(e.raw, r.expert(1).raw)
        whole = expert_stacks(grp.layers[moe[0]])[0].whole
        v = row_view(whole, 256, 512, "up")
        assert v.kernel.qtype == Q4K.pseudo and torch.equal(K.deinterleave(v.kernel), whole.raw[256:768])
        assert row_view(whole, 8, 32, "off").kernel.qtype == int(T.Q4_K)   # not on a group: over the rows

        def logits(m):
            ids = torch.tensor([3, 17, 42, 5, 9, 100, 7, 64, 2])
            c = m.init_cache(16)
            return (m.forward_step_all_logits(c, ids[:5], 0), m.forward_step(c, ids[5:6], 5),
                    m.forward_step_all_logits(c, ids[6:], 6))

        want = logits(rows)
        for x, y in zip(want, logits(grp)):
            assert torch.equal(x, y)
        if kind != "gemma4":    # the store does not stream gemma4's fused halves yet
            for m in (rows, grp):
                stream_experts(m, "60%")
            assert all(isinstance(s.whole.kernel, K.StoredKernel) and s.whole.kernel.qtype == Q4K.pseudo
                       for m in (rows, grp) for i in moe for s in expert_stacks(m.layers[i]))   # packed as read
            for x, y, z in zip(want, logits(rows), logits(grp)):
                assert torch.equal(y, z)
                assert grp.native_plan is None or torch.equal(x, y)   # none over a fused stack: torch blocks
    finally:
        K.set_isa(before)


@pytest.mark.parametrize("lay", [Q50, Q41, Q5K], ids=["q50x16", "q41x16", "q5kx16"])
def test_more_expert_stacks_in_groups_give_the_rows_logits(tmp_path, lay):
    """Q5_0, Q4_1 and Q5_K expert stacks go to 16-row groups like Q4_K's; prefill, decode and
    verify logits equal the rows model's"""
    level = next((i for i in ("avx512", "avx2") if i in K.supported_isas()), None)
    if level is None:
        pytest.skip("no level reads the groups")
    _grouped_stacks_give_the_rows_logits(_moe_file(tmp_path, "qwen3moe", lay.fmt.name), level, lay)


def _grouped_stacks_give_the_rows_logits(path: str, level: str, lay: Layout) -> None:
    """the model at `level` with its expert stacks in lay's groups (every stack) and on the
    file's rows: the same prefill, decode and verify logits"""
    from fucina.models import load_model
    from fucina.weights.row_groups import expert_stacks
    before = K.isa()
    try:
        K.set_isa(level)
        rows, grp = load_model(path, group_experts=False), load_model(path)
        stacks = [s for L in grp.layers for s in expert_stacks(L)]
        assert stacks and all(s.whole.kernel.qtype == lay.pseudo for s in stacks)
        assert all(s.whole.kernel.qtype == int(lay.fmt) for L in rows.layers for s in expert_stacks(L))
        ids = torch.tensor([3, 17, 42, 5, 9, 100, 7, 64, 2])
        outs = []
        for m in (rows, grp):
            c = m.init_cache(16)
            outs.append((m.forward_step_all_logits(c, ids[:5], 0), m.forward_step(c, ids[5:6], 5),
                         m.forward_step_all_logits(c, ids[6:], 6)))
        for x, y in zip(*outs):
            assert torch.equal(x, y)
    finally:
        K.set_isa(before)


@pytest.mark.parametrize("level", ["avx512", "avx2"])
def test_gptoss_mxfp4_expert_stacks_in_groups_give_the_rows_logits(tmp_path, level):
    """gpt-oss's MXFP4 expert stacks (gate, up, down) go to 16-row groups; prefill, decode and
    verify logits equal the rows model's"""
    if level not in K.supported_isas():
        pytest.skip(f"no {level} on this CPU")
    from synth_gptoss import write_gptoss
    path = write_gptoss(tmp_path / "g.gguf", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, window=8,
                        experts=4, experts_used=2, moe_ffn=128, seed=3)
    _grouped_stacks_give_the_rows_logits(path, level, MXF4)


def test_expert_stacks_stay_on_rows_when_their_copy_would_not_fit(tmp_path, monkeypatch):
    """Stacks more than half the memory available keep the file's (evictable) pages; the
    dense weights are grouped as ever."""
    level = next((i for i in ("avx512", "avx2") if i in K.supported_isas()), None)
    if level is None:
        pytest.skip("no level reads the groups")
    import fucina.weights.row_groups as rg
    from fucina.models import load_model
    path = _moe_file(tmp_path, "qwen3moe")
    before = K.isa()
    try:
        K.set_isa(level)
        stack_bytes = sum(s.whole.nbytes for L in load_model(path, group_experts=False).layers
                          for s in rg.expert_stacks(L))
        monkeypatch.setattr(rg, "available_ram", lambda: 2 * stack_bytes - 1)
        m = load_model(path)
        assert all(s.whole.kernel.qtype == int(T.Q4_K) for L in m.layers for s in rg.expert_stacks(L))
        assert m.layers[0].wqkv.kernel.qtype == Q4K.pseudo
        monkeypatch.setattr(rg, "available_ram", lambda: 2 * stack_bytes)
        m = load_model(path)
        assert all(s.whole.kernel.qtype == Q4K.pseudo for L in m.layers for s in rg.expert_stacks(L))
    finally:
        K.set_isa(before)


def test_available_ram_reads_meminfo_and_a_cgroup_limit(tmp_path, monkeypatch):
    import builtins

    import fucina.weights.ram as ram
    files = {"/proc/meminfo": "MemTotal: 1000 kB\nMemAvailable: 800 kB\n",
             "/sys/fs/cgroup/memory.max": "max\n", "/sys/fs/cgroup/memory.current": "100\n"}
    real_open = builtins.open

    def fake_open(path, *a, **kw):
        if path in files:
            import io
            return io.StringIO(files[path])
        if str(path).startswith(("/proc/", "/sys/")):
            raise OSError(path)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert ram.available_ram() == 800 * 1024                  # no cgroup limit
    files["/sys/fs/cgroup/memory.max"] = str(300 * 1024 + 100)
    assert ram.available_ram() == 300 * 1024                  # the cgroup's room is tighter
    del files["/proc/meminfo"]
    assert ram.available_ram() == 300 * 1024
    del files["/sys/fs/cgroup/memory.max"]
    assert ram.available_ram() is None


@pytest.mark.skipif("avx512" not in K.supported_isas() and "avx2" not in K.supported_isas(), reason="no x16 level")
def test_expert_groups_benchmark_pairs_rows_and_groups(tmp_path, capsys):
    """benchmarks/expert_groups.py loads a MoE file on rows and on groups and reports both,
    with the logits bitwise equal."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "expert_groups", Path(__file__).resolve().parents[1] / "benchmarks" / "expert_groups.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    before, threads, torch_threads = K.isa(), K.get_threads(), torch.get_num_threads()
    try:
        if before not in Q4K.levels:
            K.set_isa("avx2")
        assert bench.main([_moe_file(tmp_path, "qwen3moe"), "--rounds", "1", "--steps", "2", "--pp", "4",
                           "--threads", "1"]) == 0
    finally:
        K.set_isa(before)
        K.set_threads(threads)
        torch.set_num_threads(torch_threads)
    out = capsys.readouterr().out
    assert "6 of 6 expert stacks in groups; logits equal: True" in out and "tg2: rows" in out and "pp4: rows" in out
