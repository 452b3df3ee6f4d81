"""Batch invariance of the native layer step on every native format, at every ISA level.

test_batch_invariance checks the step on F32, Q8_0 and Q4_1 model files and the matmul on
every format; this file runs the step itself on each of the others, so every format the
plan accepts is covered end to end: a prompt prefilled in one call == in chunks of any
split == token by token (logits and K/V rows), and a forward_step_batch row == its stream
alone. Odd shapes: an ffn of 3 blocks (3 superblocks for the K-quants), prompts of 23 / 13 tokens.

The quantized weights are random GGML blocks (every bit random but the f16 scale fields,
scaled so |w| <= 0.1): writing a K-quant file by quantizing takes 10-20 s in Python, and
nothing here encodes IQ4_NL / IQ4_XS. The step's bits do not depend on how the blocks
were made, only on their format.
"""
from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

import fucina.kernels as K
import synth
from fucina.gguf import TYPE_SIZES, GGMLType as T
from fucina.models import load_model
from test_batch_invariance import _prefill, _same_cache, canonical_route, check_batch_rows_equal_alone  # noqa: F401
from test_kernels import E8M0_FIELDS, F16_FIELDS, FLOATS, TYPES, rand_weight

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

SUPER = {t for t in TYPES if TYPE_SIZES[t][0] == 256}   # 256-element blocks
# the formats test_batch_invariance already runs through the step
COVERED = {T.F32, T.Q8_0, T.Q4_1}
FORMATS = [t for t in TYPES if t not in COVERED]
IDS = [(7 * i * i + 3 * i + 5) % 250 + 1 for i in range(40)]


def random_blocks(qt: T, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row bytes] of random blocks whose weights reach at most 0.1 in magnitude (the
    weights are linear in the f16 scale fields, so scaling those scales every weight)."""
    raw = rand_weight(qt, n, k, np.random.default_rng(seed))
    peak = float(np.abs(np.asarray(quants.dequantize(raw, qt), dtype=np.float32)).max())
    bs, ts = TYPE_SIZES[qt]
    blocks = raw.reshape(-1, ts)
    for o in F16_FIELDS[qt]:
        f = blocks[:, o:o + 2].copy().view(np.float16).astype(np.float32) * (0.1 / peak)
        blocks[:, o:o + 2] = f.astype(np.float16).view(np.uint8).reshape(-1, 2)
    for o in E8M0_FIELDS.get(qt, []):            # power-of-two scales: lower every exponent alike
        blocks[:, o] -= int(np.ceil(np.log2(peak / 0.1)))
    if qt == T.IQ1_M:                            # its f16 d: the top nibbles of bytes 49, 51, 53, 55
        d = sum((blocks[:, 49 + 2 * i].astype(np.uint16) >> 4) << (4 * i) for i in range(4)).astype(np.uint16)
        d = (d.view(np.float16).astype(np.float32) * (0.1 / peak)).astype(np.float16).view(np.uint16)
        for i in range(4):
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    return raw


def random_block_adder(w: gguf.GGUFWriter, qtype):
    """synth.quantized_adder's contract, with random blocks for the quantized formats."""
    qt = T(int(qtype))
    if qt in FLOATS:
        return _QUANTIZED_ADDER(w, qtype)

    def add(name, a, quantize=True):
        a = np.asarray(a, dtype=np.float32)
        if not quantize or a.ndim == 1:
            w.add_tensor(name, a)
            return
        rows = a.reshape(-1, a.shape[-1])
        raw = random_blocks(qt, rows.shape[0], rows.shape[1], zlib.crc32(name.encode()))
        raw = raw.reshape(a.shape[:-1] + (-1,))
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    return add


_QUANTIZED_ADDER = synth.quantized_adder
_MODELS: dict = {}


def _model(tmp_path_factory, qt: T):
    """A llama-shaped model in format qt (GQA 4/2; one 256-wide layer for the 256-blocks,
    two 64-wide ones for the rest), one per format for the module."""
    if qt not in _MODELS:
        shape = (dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=768, layers=1) if qt in SUPER
                 else dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, layers=2))
        path = tmp_path_factory.mktemp(qt.name) / "m.gguf"
        mp = pytest.MonkeyPatch()
        mp.setattr(synth, "quantized_adder", random_block_adder)
        try:
            synth.write_model(path, "llama", qtype=gguf.GGMLQuantizationType(int(qt)), **shape)
        finally:
            mp.undo()
        model = load_model(path)
        assert model.native_plan is not None, f"{qt.name}: no native plan"
        _MODELS[qt] = model
    return _MODELS[qt]


@pytest.mark.parametrize("qt", FORMATS, ids=lambda t: t.name)
def test_every_format_prefill_split_any_way_equals_token_by_token(tmp_path_factory, qt, isa):
    model = _model(tmp_path_factory, qt)
    n = 13 if qt in SUPER else 23   # the scalar unit's K-quant step is the slow one here
    ids = IDS[:n]
    whole, c0 = _prefill(model, ids, [n], capacity=64)
    assert torch.isfinite(whole).all()
    for chunks in ([1] * n, [5, 1, n - 6], [n // 2, n - n // 2]):
        got, c1 = _prefill(model, ids, chunks, capacity=64)
        assert torch.equal(got, whole), f"{qt.name} {chunks} on {isa}"
        _same_cache(c1, c0)


@pytest.mark.parametrize("qt", FORMATS, ids=lambda t: t.name)
def test_every_format_batch_row_equals_stream_alone(tmp_path_factory, qt, isa):
    check_batch_rows_equal_alone(_model(tmp_path_factory, qt), IDS, isa, same_cache=_same_cache)


def test_random_blocks_stay_small():
    """The generator's promise, which keeps every logit finite (torch.equal fails on NaN)."""
    for qt in (T.Q4_K, T.Q6_K, T.IQ4_XS, T.IQ4_NL, T.Q2_K, T.MXFP4, T.IQ3_S, T.IQ1_M):
        raw = random_blocks(qt, 8, 256, 1)
        w = np.asarray(quants.dequantize(raw, qt), dtype=np.float32)
        assert np.isfinite(w).all() and 0.05 < np.abs(w).max() <= 0.1001
