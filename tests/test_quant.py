"""fucina.quant: dequantize every GGML type bit-exactly, quantize the encodable ones."""
from __future__ import annotations

import hashlib
import warnings

import numpy as np
import pytest
import torch
from gguf import quants as gq

from fucina.errors import FucinaError, QuantError
from fucina.gguf import GGMLType as T
from fucina.quant import ENCODABLE, block_size, dequantize, dequantize_rows, quantize, row_bytes, type_size
from fucina.quant.dequant import DECODERS

# Byte offsets of the f16 fields in each block. Random bytes there can be inf/NaN, where the
# reference's output is ill-defined (NaN payloads, inf*0): we clear one exponent bit of those.
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q8_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0], T.IQ1_S: [0],
    T.IQ4_NL: [0], T.IQ4_XS: [0], T.TQ1_0: [52], T.TQ2_0: [64],
}
if hasattr(T, "Q1_0"):
    F16_FIELDS[T.Q1_0] = [0]

GGUF_DEQUANT = sorted((t for t in gq._type_traits if t in DECODERS), key=int) + [T.F32, T.F16]
GGUF_QUANT = [t for t, c in gq._type_traits.items() if "quantize_blocks" in c.__dict__]


def random_blocks(qtype, n_blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n_blocks, type_size(qtype)), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, []):
        b[:, off + 1] &= 0xBF                    # exponent bits 14..10 can no longer be all ones
    if qtype == T.F16:
        b[:, 1] &= 0xBF
    if qtype == T.IQ1_M:                         # its f16 scale is bits 12..15 of 4 words; bit 14 is byte 55 bit 6
        b[:, 55] &= 0xBF
    if qtype in (T.Q8_K, T.F32):                 # f32 scale / values: keep the exponent off all ones
        b[:, 3] &= 0xBF
    return b


def bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint32)


# ---- dequantize ----

def test_every_ggml_type_decodes():
    assert set(T) <= set(DECODERS), set(T) - set(DECODERS)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # gguf-py's own MXFP4 overflow to inf
@pytest.mark.parametrize("qtype", GGUF_DEQUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 5, 64])
def test_dequantize_bit_exact_vs_gguf(qtype, n_blocks):
    raw = random_blocks(qtype, n_blocks, seed=n_blocks)
    ref = gq.dequantize(raw, qtype)
    got = dequantize(raw, qtype)
    assert got.dtype == torch.float32 and got.shape == (n_blocks * block_size(qtype),)
    np.testing.assert_array_equal(bits(got), bits(ref))


def test_dequantize_2d_and_torch_input():
    raw = random_blocks(T.Q4_K, 12).reshape(3, -1)   # [rows, row_bytes], as a tensor view holds it
    ref = gq.dequantize(raw, T.Q4_K).reshape(-1)
    np.testing.assert_array_equal(bits(dequantize(raw, T.Q4_K, n_elements=3 * 1024)), bits(ref))
    np.testing.assert_array_equal(bits(dequantize(torch.from_numpy(raw), T.Q4_K)), bits(ref))


def _np_q8(raw, d_off, d_dtype, q_off, n):
    d = raw[:, d_off:d_off + np.dtype(d_dtype).itemsize].copy().view(d_dtype).astype(np.float32)
    return (d * raw[:, q_off:q_off + n].copy().view(np.int8).astype(np.float32)).reshape(-1)


def test_types_without_gguf_reference():
    """Q8_1, Q8_K, Q1_0 and the integer types: against plain numpy readings of ggml's layouts."""
    raw = random_blocks(T.Q8_1, 9)
    np.testing.assert_array_equal(bits(dequantize(raw, T.Q8_1)), bits(_np_q8(raw, 0, np.float16, 4, 32)))
    raw = random_blocks(T.Q8_K, 3)
    np.testing.assert_array_equal(bits(dequantize(raw, T.Q8_K)), bits(_np_q8(raw, 0, np.float32, 4, 256)))
    if hasattr(T, "Q1_0"):
        raw = random_blocks(T.Q1_0, 4)
        d = raw[:, :2].copy().view(np.float16).astype(np.float32)
        on = np.unpackbits(raw[:, 2:], axis=1, bitorder="little").astype(bool)
        np.testing.assert_array_equal(bits(dequantize(raw, T.Q1_0)), bits(np.where(on, d, -d)))
    for qtype, dt in [(T.I8, np.int8), (T.I16, np.int16), (T.I32, np.int32), (T.I64, np.int64), (T.F64, np.float64)]:
        v = np.arange(-50, 50).astype(dt) * 3
        np.testing.assert_array_equal(dequantize(v.view(np.uint8), qtype).numpy(), v.astype(np.float32))


def test_q8_1_is_ggml_36_byte_block():
    assert (block_size(T.Q8_1), type_size(T.Q8_1)) == (32, 36)


def test_read_only_view_is_neither_copied_warned_nor_written():
    raw = random_blocks(T.Q6_K, 4)
    ro = np.frombuffer(raw.tobytes(), dtype=np.uint8)      # read-only, like an mmap view
    assert not ro.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for qtype in (T.Q6_K, T.F32, T.F16):
            out = dequantize(ro[: len(ro) // type_size(qtype) * type_size(qtype)], qtype)
            out += 1                                        # the result is ours to write
    assert ro.tobytes() == raw.tobytes()


def test_empty_input():
    assert dequantize(np.zeros(0, np.uint8), T.Q4_0).shape == (0,)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_K, T.IQ2_XS, T.F16, T.BF16], ids=lambda t: t.name)
def test_dequantize_rows_matches_slice(qtype):
    row_len, n_rows = 2 * block_size(qtype) if block_size(qtype) > 1 else 64, 10
    raw = random_blocks(qtype, n_rows * row_len // block_size(qtype)).reshape(n_rows, -1)
    full = dequantize(raw, qtype).view(n_rows, row_len)
    ids = [3, 0, 9, 3]
    got = dequantize_rows(raw, qtype, ids, row_len)
    np.testing.assert_array_equal(bits(got), bits(full[ids]))
    assert dequantize_rows(raw, qtype, torch.tensor([], dtype=torch.long), row_len).shape == (0, row_len)


# ---- bad input ----

def test_errors_are_typed():
    assert issubclass(QuantError, FucinaError)
    with pytest.raises(QuantError):
        dequantize(np.zeros(17, np.uint8), T.Q4_0)            # not whole 18-byte blocks
    with pytest.raises(QuantError):
        dequantize(np.zeros(36, np.uint8), T.Q4_0, n_elements=32)
    with pytest.raises(QuantError):
        dequantize(np.zeros(18, np.uint8), 12345)              # unknown type id
    with pytest.raises(QuantError):
        dequantize(np.zeros(18, np.uint8), "Q4_0")
    with pytest.raises(QuantError):
        row_bytes(T.Q4_K, 100)
    with pytest.raises(QuantError):
        dequantize_rows(np.zeros((2, 18), np.uint8), T.Q4_0, [2], 32)
    with pytest.raises(QuantError):
        dequantize_rows(np.zeros((2, 18), np.uint8), T.Q4_0, [0], 64)
    with pytest.raises(QuantError):
        quantize(np.zeros(32, np.float32), T.IQ2_XXS)          # not encodable
    with pytest.raises(QuantError):
        quantize(np.zeros((2, 40), np.float32), T.Q4_0)        # row not whole blocks
    with pytest.raises(QuantError):
        dequantize([1, 2, 3], T.Q4_0)


def test_geometry_helpers():
    assert (block_size(T.Q4_K), type_size(T.Q4_K), row_bytes(T.Q4_K, 512)) == (256, 144, 288)
    assert (block_size(T.F32), type_size(T.F32), row_bytes(T.F32, 3)) == (1, 4, 12)
    assert row_bytes(int(T.Q8_0), 64) == 68


# ---- quantize ----

def sample(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Mixed distributions, with an all-zero and a constant block among them."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([
        rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 3, (rows, 1)),
        rng.standard_t(3, (rows, cols)),
        rng.uniform(-1, 1, (rows, cols)) + 0.5,
    ]).astype(np.float32)
    x[0, :256] = 0
    x[1, :256] = 0.25
    return x


@pytest.mark.parametrize("qtype", GGUF_QUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 256), (4, 512), (2, 3, 768)])
def test_quantize_bit_exact_vs_gguf(qtype, shape):
    x = sample(4, 768)[: int(np.prod(shape[:-1]))].reshape(-1)[: int(np.prod(shape))].reshape(shape)
    np.testing.assert_array_equal(quantize(x, qtype), gq.quantize(x, qtype))


# sha256 (first 32 hex) of llama.cpp's quantize_row_*_ref output for sample(4, 512, seed=1234)'s
# first rows, produced once from ggml-quants.c compiled from source: our port is byte-exact.
C_REF_SHA = {
    "Q2_K": "1cfea835f56a8f528383bae08b7d7013", "Q3_K": "492e249af638a3dfd968455534bcfc93",
    "Q4_K": "3bb922f1737d80f48ad0f85525ab55ff", "Q5_K": "7f99737fccd40b466e1f469d686428aa",
    "Q6_K": "b7d778c8e412c5bbf7cc9593714af329", "Q8_K": "1ed6949055f83a6c05f774a93987fe58",
    "Q8_1": "ff7e80fac4122736b9376527f823c664", "Q1_0": "361c0e88ce3af78ea2fd441e15ed4b65",
}


def _c_ref_input() -> np.ndarray:
    rng = np.random.default_rng(1234)
    x = np.concatenate([rng.standard_normal((4, 512)), rng.standard_t(3, (4, 512)),
                        rng.uniform(-1, 1, (4, 512))]).astype(np.float32)
    x[0, :256] = 0
    x[1, :256] = 0.25
    return x


@pytest.mark.parametrize("name", [n for n in C_REF_SHA if hasattr(T, n)])
def test_quantize_bit_exact_vs_llama_cpp_golden(name):
    q = quantize(_c_ref_input(), T[name])
    assert hashlib.sha256(q.tobytes()).hexdigest()[:32] == C_REF_SHA[name]


# relative RMS error bound of a quantize -> dequantize round trip on sample(); measured values
# are roughly half of these (Q2_K 0.30, Q3_K 0.15, Q4_K 0.072, Q5_K 0.036, Q6_K 0.018 on normals)
MAX_REL_RMSE = {
    "F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q8_1": 0.01, "Q8_K": 0.02,
    "Q6_K": 0.03, "Q5_0": 0.07, "Q5_1": 0.06, "Q5_K": 0.06, "Q4_0": 0.14, "Q4_1": 0.13,
    "Q4_K": 0.12, "MXFP4": 0.2, "Q3_K": 0.25, "Q2_K": 0.45, "TQ2_0": 1.0, "TQ1_0": 1.0, "Q1_0": 1.0,
}


@pytest.mark.parametrize("qtype", sorted(ENCODABLE, key=int), ids=lambda t: t.name)
def test_quantize_round_trip(qtype):
    x = sample(2, 512, seed=int(qtype))
    q = quantize(x, qtype)
    assert q.dtype == np.uint8 and q.shape == (x.shape[0], row_bytes(qtype, 512))
    y = dequantize(q, qtype).numpy().reshape(x.shape)
    assert np.isfinite(y).all()
    rel = np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean())
    assert rel <= MAX_REL_RMSE[qtype.name], rel
    if block_size(qtype) <= 256:                              # the all-zero block stays zero
        assert not y[0, :256].any()
    # torch in -> torch out, same bytes
    qt = quantize(torch.from_numpy(x), qtype)
    assert isinstance(qt, torch.Tensor) and np.array_equal(qt.numpy(), q)


def test_quantize_is_idempotent_on_its_own_grid():
    x = sample(2, 512)
    for qtype in (T.Q8_0, T.Q4_0, T.Q6_K):
        y = dequantize(quantize(x, qtype), qtype).numpy().reshape(x.shape)
        z = dequantize(quantize(y, qtype), qtype).numpy().reshape(x.shape)
        np.testing.assert_allclose(z, y, rtol=0, atol=1e-2 * np.abs(y).max())
