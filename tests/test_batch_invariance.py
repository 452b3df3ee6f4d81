"""Batch invariance: a row's result never depends on the rows computed with it.

The native layer step promises bitwise-equal logits and K/V rows for a position whether
it runs alone (m = 1), in a block of rows, in a prefill chunk of any size, or as one
stream of forward_step_batch, on every native format and ISA level (torch.equal, not
allclose). The quantized matmuls go further: one canonical per-block formula on every
ISA, so AVX-512, AVX2 and the scalar unit agree bit for bit as well. The torch path
(use_native_step = False) is close to the native step, not bitwise (test_native_step), and
chunk-invariant on its own (test_torch_invariance).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import fucina.kernels as K
from fucina.gguf import TYPE_SIZES, GGMLType as T
from fucina.models import load_model
from synth import write_model
from test_kernels import FLOATS, TYPES, rand_weight

Q = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

SUPER = {t for t in TYPES if TYPE_SIZES[t][0] == 256}   # 256-element blocks


@pytest.fixture(autouse=True)
def canonical_route():
    before = K.prefill_route()
    K.set_prefill_route("canon")
    yield
    K.set_prefill_route(before)


def _matmul_on(isa, raw, qt, n, k, x):
    before = K.isa()
    K.set_isa(isa)
    try:
        return K.matmul(raw, qt, n, k, x)
    finally:
        K.set_isa(before)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_matmul_rows_together_equal_rows_alone(qt, isa):
    """Every split of 41 rows (1, 2..4, odd tiles, all at once) gives the same bits; k spans
    several 8-block panel chunks (the last one partial for the 32-blocks)."""
    rng = np.random.default_rng(int(qt))
    n, k = 53, (768 if qt in SUPER else 608)
    raw = torch.from_numpy(rand_weight(qt, n, k, rng))
    x = torch.randn(41, k, generator=torch.Generator().manual_seed(int(qt)))
    whole = K.matmul(raw, qt, n, k, x)
    for split in ([1] * 41, [2, 3, 4, 1, 7, 8, 16], [5, 36], [13, 13, 13, 2]):
        parts, i = [], 0
        for s in split:
            parts.append(K.matmul(raw, qt, n, k, x[i:i + s]))
            i += s
        assert torch.equal(torch.cat(parts), whole), f"{qt.name} split {split} on {isa}"


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_decode_rows_equal_rows_alone(qt, isa):
    """1..8 rows (a verify pass of 1 + k, the decode GEMV's reach) == each row alone, and the
    first 8 of 9 rows (the panel route) too; n = 53 and 7 fill no unit's row tile, k is an
    odd count of blocks (superblocks)."""
    rng = np.random.default_rng(200 + int(qt))
    k = 768 if qt in SUPER else 608
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    for n in (53, 7):
        raw = torch.from_numpy(rand_weight(qt, n, k, rng))
        alone = torch.cat([K.matmul(raw, qt, n, k, x[i:i + 1]) for i in range(8)])
        for m in (2, 3, 4, 5, 6, 7, 8, 9):
            got = K.matmul(raw, qt, n, k, x[:m])
            assert torch.equal(got[:8], alone[:m]), f"{qt.name} n={n} m={m} on {isa}"


@pytest.mark.parametrize("qt", [t for t in TYPES if t not in FLOATS], ids=lambda t: t.name)
def test_quantized_matmul_same_bits_on_every_isa(qt):
    """The canonical formula is the same on every unit: AVX-512 / AVX2 == scalar, on the
    panel route (9 rows) and the decode GEMV (1, 3, 5 and 8 rows)."""
    rng = np.random.default_rng(100 + int(qt))
    n, k = 29, (512 if qt in SUPER else 96)
    raw = torch.from_numpy(rand_weight(qt, n, k, rng))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    for rows in (x, x[:1], x[:3], x[:5], x[:8]):
        ref = _matmul_on("scalar", raw, qt, n, k, rows)
        for isa in K.supported_isas():
            assert torch.equal(_matmul_on(isa, raw, qt, n, k, rows), ref), f"{qt.name} m={len(rows)} on {isa}"


@pytest.mark.parametrize("qt", [T.IQ1_M, T.Q3_K, T.Q2_K], ids=lambda t: t.name)
def test_int16_group_sums_at_their_bounds(qt):
    """The formats whose 16-group sums pass through int16 (AVX2 sums a group's dwords in two int16
    halves, the low one from the zero-point term -z sum q): activations at +-127 everywhere, signed
    so that row 0's half-group sums and the zero-point term grow together, give the scalar unit's
    bits on every ISA (the panel route, 9 rows, and the decode GEMV, 1 row)."""
    from fucina.quant.dequant import dequantize

    rng = np.random.default_rng(500 + int(qt))
    n, k = 29, 512
    raw = torch.from_numpy(rand_weight(qt, n, k, rng))
    sign = torch.sign(dequantize(raw[0], qt, k).float())
    sign[sign == 0] = 1
    low = (torch.arange(k) % 4) < 2   # each dword's first two values: AVX2's low int16 half
    rows = [torch.ones(k), -torch.ones(k)]
    for s in (1.0, -1.0):
        rows += [torch.where(low, s * sign, -s), torch.where(low, -s, s * sign)]
    x = torch.stack(rows + [sign, -sign, torch.ones(k)])   # 9 rows
    for batch in (x, x[:1], x[2:3], x[4:5]):
        ref = _matmul_on("scalar", raw, qt, n, k, batch)
        for isa in K.supported_isas():
            assert torch.equal(_matmul_on(isa, raw, qt, n, k, batch), ref), f"{qt.name} m={len(batch)} on {isa}"


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q6_K, T.Q8_0, T.IQ2_XS], ids=lambda t: t.name)
def test_rows_past_l2_in_blocks(qt):
    """A call whose activation rows outgrow a core's L2 takes them in blocks (matmul_cb's
    cb_row_block): 1100 rows of k = 4096 (about 13 MB of quantized rows) give, on every ISA,
    the bits of the same rows in calls of 100, which no unit splits."""
    rng = np.random.default_rng(700 + int(qt))
    n, k, m = 29, 4096, 1100
    raw = torch.from_numpy(rand_weight(qt, n, k, rng))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    for isa in K.supported_isas():
        whole = _matmul_on(isa, raw, qt, n, k, x)
        parts = torch.cat([_matmul_on(isa, raw, qt, n, k, x[r:r + 100]) for r in range(0, m, 100)])
        assert torch.equal(whole, parts), f"{qt.name} on {isa}"


# (value bytes, their fill, scale bytes) of the 16-group formats whose group sums pass
# through floats: every value at its largest magnitude, every scale at its largest
_EXTREMES = {
    T.Q6_K: ((slice(0, 192), 0x00), slice(192, 208), 0x80),       # values -32, scales -128
    T.IQ2_XS: ((slice(2, 66), 0xFF), slice(66, 74), 0xFF),        # grid 511 (all 43), scales 31
    T.IQ2_S: ((slice(2, 34), 0xFF), slice(74, 82), 0xFF),         # grid 1023 with qh below
}


@pytest.mark.parametrize("qt", sorted(_EXTREMES), ids=lambda t: t.name)
def test_float_group_products_at_their_bounds(qt):
    """The formats whose block integer I = c_lo s_lo + c_hi s_hi the AVX-512 unit forms in
    floats (exact while each product and I stay under 2^24; Q6_K's reach 16646144): rows of
    extreme values and scales, activations at +-127 signed by row 0's weights, give the scalar
    unit's bits on every ISA (the panel route, 9 rows, and the decode GEMV, 1 row)."""
    from fucina.quant.dequant import dequantize

    rng = np.random.default_rng(600 + int(qt))
    n, k = 29, 512
    bs, ts = TYPE_SIZES[qt]
    raw = rand_weight(qt, n, k, rng).reshape(n, k // bs, ts)
    (vals, fill), scales, smax = _EXTREMES[qt]
    raw[:3, :, vals] = fill
    raw[:3, :, scales] = smax
    if qt == T.IQ2_S:
        raw[:3, :, 66:74] = 0xFF      # the grid index's high bits
    if qt == T.Q6_K:
        raw[1, :, vals] = 0xFF        # values +31
        raw[2, :, 192:208:2] = 0x7F   # scales -128 and 127 in turn
    if qt == T.IQ2_XS:                # each grid index keeps a random sign pattern (bits 9-15)
        raw[:3, :, 3:66:2] = rng.integers(0, 256, raw[:3, :, 3:66:2].shape, dtype=np.uint8) | 0x01
    raw = torch.from_numpy(raw.reshape(n, -1))
    sign = torch.sign(dequantize(raw[0], qt, k).float())
    sign[sign == 0] = 1
    x = torch.stack([sign, -sign, torch.ones(k), -torch.ones(k), sign.roll(16), sign, -sign, sign, torch.ones(k)])
    for batch in (x, x[:1], x[1:2], x[2:3]):
        ref = _matmul_on("scalar", raw, qt, n, k, batch)
        for isa in K.supported_isas():
            assert torch.equal(_matmul_on(isa, raw, qt, n, k, batch), ref), f"{qt.name} m={len(batch)} on {isa}"


@pytest.mark.skipif(not K.available() or not K.amx(), reason="no AMX tiles on this CPU (or its OS keeps them off)")
@pytest.mark.parametrize("qt", [t for t in TYPES if t not in FLOATS], ids=lambda t: t.name)
def test_amx_tiles_same_bits(qt):
    """The AMX kernel (16 activation rows a tile, from 32 rows a call) gives the vector kernel's
    bits and the scalar unit's, for 32, 33 and 37 rows (tiles plus a remainder), k spanning a
    partial panel chunk."""
    rng = np.random.default_rng(300 + int(qt))
    n, k = 37, (1280 if qt in SUPER else 1312)
    raw = torch.from_numpy(rand_weight(qt, n, k, rng))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(4))
    try:
        for rows in (x[:32], x[:33], x):
            K.set_amx(True)
            tiles = K.matmul(raw, qt, n, k, rows)
            K.set_amx(False)
            assert torch.equal(tiles, K.matmul(raw, qt, n, k, rows)), f"{qt.name} m={len(rows)}"
            assert torch.equal(tiles, _matmul_on("scalar", raw, qt, n, k, rows)), f"{qt.name} m={len(rows)} scalar"
    finally:
        K.set_amx(True)


# ---- the layer step ----------------------------------------------------------------------

CASES = {
    "llama": ("llama", dict(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2)),
    "qwen3-gqa": ("qwen3", dict(hidden=64, heads=4, kv_heads=1, head_dim=128, layers=2)),
    "gemma3-window": ("gemma3", dict(hidden=64, heads=4, kv_heads=2, head_dim=32, layers=3,
                                     sliding_window=5)),
}
# every format's matmul is covered above (the step's other pieces do not depend on the
# format): the step is checked on the float route and a 32-block format with and without
# mins (writing a K-quant model file takes ~20 s of Python quantizing)
STEP_CASES = [(name, qt) for name in sorted(CASES) for qt in (Q.F32, Q.Q8_0, Q.Q4_1)]
IDS = [(7 * i * i + 3 * i + 5) % 250 + 1 for i in range(300)]


_MODELS: dict = {}


def _model(tmp_path_factory, name, qtype):
    """One model per (case, format) for the whole module: writing a K-quant file is slow."""
    if (name, qtype) in _MODELS:
        return _MODELS[name, qtype]
    arch, kw = CASES[name]
    path = write_model(tmp_path_factory.mktemp(name) / "m.gguf", arch, qtype=qtype, **kw)
    model = load_model(path)
    assert model.native_plan is not None
    _MODELS[name, qtype] = model
    return model


def _prefill(model, ids, chunks, capacity=320):
    cache = model.init_cache(capacity)
    out, pos = [], 0
    for n in chunks:
        out.append(model.forward_step_all_logits(cache, ids[pos:pos + n], pos))
        pos += n
    assert pos == len(ids)
    return torch.cat(out), cache


SPLITS = ([1] * 37, [9, 1, 1, 6, 2, 18], [20, 17])     # ways to cut a 37-token prompt


def check_split_equals_whole(model, ids, splits, isa, capacity=320, also=None):
    """The prompt in one call against each split of it: the same logits and cache, bitwise
    (and `also(whole_cache, split_cache)`, a family's own state check)."""
    whole, c0 = _prefill(model, ids, [len(ids)], capacity)
    for chunks in splits:
        got, c1 = _prefill(model, ids, chunks, capacity)
        assert torch.equal(got, whole), f"{chunks} on {isa}"
        _same_cache(c1, c0)
        if also is not None:
            also(c0, c1)


def _same_cache(a, b):
    """Every position both caches still hold (a window memory keeps only its last rows)."""
    assert a.len == b.len
    for i, (ma, mb) in enumerate(zip(a.memories, b.memories)):
        start = max(getattr(ma, "base", 0), getattr(mb, "base", 0))
        ka, va = a.span(i, start, a.len)
        kb, vb = b.span(i, start, b.len)
        assert torch.equal(ka, kb) and torch.equal(va, vb), f"layer {i} from {start}"


@pytest.mark.parametrize("name,qtype", STEP_CASES, ids=lambda v: getattr(v, "name", v))
def test_prefill_split_any_way_equals_token_by_token(tmp_path_factory, name, qtype, isa):
    model = _model(tmp_path_factory, name, qtype)
    ids = IDS[:37]
    whole, c0 = _prefill(model, ids, [37])
    for chunks in ([1] * 37, [9, 1, 1, 6, 2, 18], [3, 34]):
        got, c1 = _prefill(model, ids, chunks)
        assert torch.equal(got, whole), f"{name} {qtype.name} {chunks} on {isa}"
        _same_cache(c1, c0)


@pytest.mark.parametrize("name", ["gemma3-window"])
def test_long_prompt_across_key_chunks(tmp_path_factory, name, isa):
    """Past 256 positions a query's keys span two attention chunks (merged in order), and
    prompts past native_chunk run as several calls: still the bits of one row at a time."""
    model = _model(tmp_path_factory, name, Q.Q8_0)
    ids = IDS[:300]
    whole, c0 = _prefill(model, ids, [300])
    model.native_chunk = 128
    try:
        got, c1 = _prefill(model, ids, [250, 1, 1, 48])
    finally:
        del model.native_chunk
    assert torch.equal(got, whole)
    _same_cache(c1, c0)
    step, c2 = _prefill(model, ids, [255] + [1] * 45)
    assert torch.equal(step, whole)
    _same_cache(c2, c0)


@pytest.mark.parametrize("name,qtype", [("llama", Q.Q4_1), ("gemma3-window", Q.Q8_0), ("qwen3-gqa", Q.F32)],
                         ids=lambda v: getattr(v, "name", v))
def test_batch_row_equals_stream_alone(tmp_path_factory, name, qtype, isa):
    check_batch_rows_equal_alone(_model(tmp_path_factory, name, qtype), IDS, isa, same_cache=_same_cache)


def check_batch_rows_equal_alone(model, ids, isa, same_cache=None):
    """Four streams of different lengths decoded in one forward_step_batch: each row equals
    that stream's own single step, bitwise (and, given same_cache, so do the caches)."""
    lens, nxt = (3, 11, 1, 6), [9, 17, 33, 65]
    batch = [model.init_cache(32) for _ in lens]
    alone = [model.init_cache(32) for _ in lens]
    for caches in (batch, alone):
        for c, n in zip(caches, lens):
            model.forward_step(c, ids[:n], 0)
    got = model.forward_step_batch(batch, nxt)
    for s, (c, t) in enumerate(zip(alone, nxt)):
        assert torch.equal(got[s], model.forward_step(c, [t], c.len)), f"stream {s} on {isa}"
        if same_cache:
            same_cache(batch[s], c)


def test_legacy_routes_stay_reachable():
    """The opt-out (FUCINA_INVARIANT=0) keeps the older per-m routes; set back to canon."""
    assert K.prefill_route() == "canon"
    K.set_prefill_route("int8")
    assert K.prefill_route() == "int8" and K.route(64, T.Q4_K) == "int8"
    K.set_prefill_route("canon")
    assert K.route(64, T.Q4_K) == "canon" and K.route(1, T.BF16) == "canon"


@pytest.mark.slow
def test_greedy_generate_repeats(smollm2_path):
    """The user-visible contract: the same greedy request returns the same text, also when
    the second call reuses the cached prefix and after an unrelated call."""
    import fucina
    llm = fucina.load(smollm2_path)
    first = llm.generate("The sky is", max_tokens=24, temperature=0)
    assert llm.generate("The sky is", max_tokens=24, temperature=0) == first
    llm.generate("Write a haiku about rust.", max_tokens=8)
    assert llm.generate("The sky is", max_tokens=24, temperature=0) == first
    # seeded sampling too, through the cached prefix
    s1 = llm.generate("The sky is", max_tokens=24, seed=7)
    assert llm.generate("The sky is", max_tokens=24, seed=7) == s1
