"""MXFP4 (32 values in 17 bytes: an E8M0 scale byte, then 16 bytes of E2M1 nibbles).

The reference decoder is bit-exact against gguf-py (test_quant covers every type); here the
native route: every m from 1 to 33 (the decode GEMV's 1..8 rows, the panel route past them)
on every ISA level this CPU has, each the same bits as the scalar unit and as the rows
computed alone, and within float rounding of the reference matmul on the int8-rounded
activations. The scale bytes take the extremes too (subnormal and huge powers of two).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

import fucina.kernels as K
from fucina.gguf import GGMLType as T
from fucina.quant import dequantize, quantize
from test_batch_invariance import _matmul_on, canonical_route  # noqa: F401 (the fixture)
from test_kernels import check, rand_weight

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

QT = T.MXFP4


def _on(isa, raw, n, k, x):
    return _matmul_on(isa, raw, QT, n, k, x)


def test_m_1_to_33_every_isa_same_bits():
    """Rows [0, m) of one call == those rows alone == the scalar unit, for m = 1..33; n = 37
    fills no row tile, k = 7 blocks (an odd count: the GEMV's single last block)."""
    n, k = 37, 7 * 32
    raw = torch.from_numpy(rand_weight(QT, n, k, np.random.default_rng(5)))
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([_on("scalar", raw, n, k, x[i:i + 1]) for i in range(33)])
    for isa in K.supported_isas():
        for m in range(1, 34):
            got = _on(isa, raw, n, k, x[:m])
            assert torch.equal(got, alone[:m]), f"m={m} on {isa}"


def test_against_reference_every_isa(isa):
    rng = np.random.default_rng(9)
    for n, k, m in [(1, 32, 1), (19, 96, 2), (16, 64, 3), (33, 512, 5), (21, 160, 8), (9, 608, 9), (40, 256, 33)]:
        check(QT, n, k, m, rng)


def test_extreme_scales_decode_like_the_reference(isa):
    """Scale bytes 0 and 1 (subnormal f32 scales), 127 and 200: the native row decoder (the
    embedding lookup) gives the reference's bits."""
    from fucina.weights import LinearWeight
    raw = rand_weight(QT, 4, 64, np.random.default_rng(1))
    raw[:, 0], raw[:, 17] = [0, 1, 127, 200], [2, 3, 126, 150]
    w = LinearWeight(torch.from_numpy(raw.reshape(-1).copy()), QT, 4, 64, "w")
    K.attach(w)
    ref = np.asarray(quants.dequantize(raw, QT), dtype=np.float32).reshape(4, 64)
    got = w.kernel.rows(torch.arange(4)).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_encode_roundtrip_is_nearest():
    """quantize picks the nearest code for each value; decoding the result lands within half a
    code step of the input."""
    x = torch.randn(8 * 32, generator=torch.Generator().manual_seed(0))
    raw = quantize(x, QT)
    ref = quants.quantize(x.numpy().reshape(8, 32), QT).reshape(-1)
    np.testing.assert_array_equal(raw.numpy().reshape(-1) if isinstance(raw, torch.Tensor) else np.asarray(raw).reshape(-1), ref)
    y = dequantize(raw, QT)
    assert (y - x).abs().max() <= x.abs().max() / 6
