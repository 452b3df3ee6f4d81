"""The canonical decode GEMV's reach on each ISA, through the native route probe: which
formats take it for 1..m activation rows (a verify pass of 1 + k) instead of the panel
route. test_batch_invariance checks those rows' bits (== each row alone == the panel route
== the scalar unit); this test makes sure they run where the kernels say they do."""
from __future__ import annotations

import pytest

import fucina.kernels as K
from fucina.gguf import GGMLType as T

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

NIBBLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
KQ = (T.Q4_K, T.Q5_K, T.Q6_K)
# rows per format on each unit (formats left out: the panel route from one row)
REACH = {
    "avx512": {**dict.fromkeys(NIBBLE + KQ + (T.IQ4_NL, T.Q8_0), 8)},
    # AVX2: the K-quants past 2 rows and IQ4_NL only with VNNI (without it their panel
    # route measured as fast or faster)
    "avx2vnni": {**dict.fromkeys(NIBBLE + KQ + (T.IQ4_NL, T.Q8_0), 8)},
    "avx2": {**dict.fromkeys(NIBBLE, 8), **dict.fromkeys(KQ, 2), T.Q8_0: 8},
    "scalar": {},
}
FORMATS = NIBBLE + KQ + (T.IQ4_NL, T.Q8_0, T.Q2_K, T.Q3_K, T.IQ4_XS, T.F16)


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
