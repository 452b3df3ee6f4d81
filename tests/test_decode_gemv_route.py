"""The canonical decode GEMV's reach on each ISA, through the native route probe: which
formats take it for 1..m activation rows (a verify pass of 1 + k) instead of the panel
route. test_batch_invariance checks those rows' bits (== each row alone == the panel route
== the scalar unit); this test makes sure they run where the kernels say they do."""
from __future__ import annotations

import pytest

import fucina.kernels as K
from fucina.gguf import GGMLType as T
from test_batch_invariance import canonical_route  # noqa: F401  (autouse: the canonical route)

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

NIBBLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
KQ = (T.Q4_K, T.Q5_K, T.Q6_K)
TQ = (T.TQ1_0, T.TQ2_0)
IQ = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)
IQ_AVX2_4 = dict.fromkeys((T.IQ2_S, T.IQ3_S), 4)
# rows per format on each unit (formats left out: the panel route from one row)
REACH = {
    # the i-quants: IQ1_S to 3 rows on AVX-512; on AVX2 IQ2_S and IQ3_S to 4, the others to 2
    # (past them the panel route measured faster)
    "avx512": {**dict.fromkeys(NIBBLE + KQ + TQ + IQ + (T.IQ4_NL, T.Q8_0), 8), T.IQ1_S: 3},
    # AVX2: IQ4_NL only with VNNI (without it its panel route measured as fast or faster)
    "avx2vnni": {**dict.fromkeys(NIBBLE + KQ + TQ + (T.IQ4_NL, T.Q8_0), 8), **dict.fromkeys(IQ, 2), **IQ_AVX2_4},
    "avx2": {**dict.fromkeys(NIBBLE + KQ + TQ, 8), T.Q8_0: 8, **dict.fromkeys(IQ, 2), **IQ_AVX2_4},
    "scalar": {},
}
FORMATS = NIBBLE + KQ + TQ + IQ + (T.IQ4_NL, T.Q8_0, T.Q2_K, T.Q3_K, T.IQ4_XS, T.F16)


@pytest.mark.parametrize("name", sorted(REACH))
def test_decode_gemv_reach(name):
    if name not in K.supported_isas():
        pytest.skip(f"{name} not on this CPU")
    before = K.isa()
    K.set_isa(name)
    try:
        got = {qt: K._native.gemv_rows(int(qt)) for qt in FORMATS}
    finally:
        K.set_isa(before)
    assert got == {qt: REACH[name].get(qt, 0) for qt in FORMATS}


@pytest.mark.parametrize("qt", NIBBLE + KQ + TQ + IQ + (T.IQ4_NL, T.Q8_0), ids=lambda t: t.name)
def test_one_block_rows_equal_rows_alone_and_scalar(qt, isa):
    """The smallest rows the GEMV takes: one block (one superblock), 1 and 9 weight rows (a
    partial tile, a full one and one row past it): 1..8 activation rows == each alone ==
    the scalar unit."""
    import numpy as np
    import torch
    from test_kernels import rand_weight

    k = 256 if qt in KQ + TQ + IQ else 32
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3))
    for n in (1, 9):
        raw = torch.from_numpy(rand_weight(qt, n, k, np.random.default_rng(300 + n)))
        alone = torch.cat([K.matmul(raw, qt, n, k, x[i:i + 1]) for i in range(8)])
        K.set_isa("scalar")
        try:
            ref = K.matmul(raw, qt, n, k, x)
        finally:
            K.set_isa(isa)
        for m in range(1, 9):
            got = K.matmul(raw, qt, n, k, x[:m])
            assert torch.equal(got, alone[:m]) and torch.equal(got, ref[:m]), f"{qt.name} n={n} m={m} on {isa}"
