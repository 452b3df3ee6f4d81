"""TQ2_0 in 8-row groups (fucina.kernels.tq2_interleave, csrc/generic/tq2x8_impl.inc): the
layout round-trips, and every route on every ISA (the AVX2 decode GEMV for 1..8 rows, the
panel route past them, AVX-512 and the scalar unit through panels) gives the bits of the
TQ2_0 rows it came from, on row counts that are not a multiple of 8; a model loaded at an
AVX2 level computes on the groups and gives the same logits as its rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fucina.kernels as K
from fucina.gguf import GGMLType as T
from test_batch_invariance import canonical_route  # noqa: F401  (autouse: the canonical route)
from test_kernels import rand_weight

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

AVX2 = [i for i in ("avx2", "avx2vnni") if i in K.supported_isas()]


def _raw(n: int, k: int, seed: int) -> torch.Tensor:
    """random qs bytes (every 2-bit field 0..3: ggml reads a 3 as 2 d) and f16 scales"""
    return torch.from_numpy(rand_weight(T.TQ2_0, n, k, np.random.default_rng(seed)))


@pytest.mark.parametrize("n,k", [(1, 256), (7, 256), (8, 512), (9, 256), (17, 768), (24, 256)])
def test_interleave_round_trips(n, k):
    raw = _raw(n, k, n + k)
    x8 = K.tq2_interleave(raw, n)
    g = -(-n // 8) * 8
    assert tuple(x8.shape) == (g, raw.shape[1]) and x8.dtype is torch.uint8
    assert torch.equal(K.tq2_deinterleave(x8, n), raw)
    assert int(K.tq2_deinterleave(x8, g)[n:].count_nonzero()) == 0   # the padding rows
    # the documented places: row r's qs dword e and scale of superblock s in group 0
    nsb = k // 256
    for r, s, e in ((0, 0, 0), (min(n, 8) - 1, nsb - 1, 15), (min(n, 8) // 2, 0, 9)):
        grp = x8[:8].reshape(-1)
        assert torch.equal(grp[512 * s + 32 * e + 4 * r:][:4], raw[r, 66 * s + 4 * e:][:4])
        assert torch.equal(grp[512 * nsb + 16 * s + 2 * r:][:2], raw[r, 66 * s + 64:][:2])
    with pytest.raises(K.KernelError):
        K.tq2_interleave(raw[:, :65].contiguous(), n)


def _x8_matmul(x8, n, k, x):
    y = torch.empty(x.shape[0], n)
    K._native.matmul(K.TQ2_X8, x8.data_ptr(), k // 256 * 66, n, k, x.data_ptr(), x.shape[0], y.data_ptr(), n)
    return y


@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (9, 256), (20, 768), (37, 1024)])
def test_groups_equal_rows_bitwise(n, k, isa):
    """m = 1..8 (the GEMV on AVX2), 9 and 20 (panels): == TQ2_0 rows on this ISA == each
    activation row alone == the scalar unit's rows; close to the torch reference."""
    raw = _raw(n, k, 7 * n + k)
    x8 = K.tq2_interleave(raw, n)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(n))
    K.set_isa("scalar")
    try:
        ref = K.matmul(raw, T.TQ2_0, n, k, x)
    finally:
        K.set_isa(isa)
    alone = torch.cat([_x8_matmul(x8, n, k, x[i:i + 1].contiguous()) for i in range(20)])
    assert torch.equal(alone, ref), isa
    for m in (*range(1, 9), 9, 20):
        got = _x8_matmul(x8, n, k, x[:m].contiguous())
        assert torch.equal(got, K.matmul(raw, T.TQ2_0, n, k, x[:m])), f"n={n} k={k} m={m} on {isa}"
        assert torch.equal(got, ref[:m]), f"n={n} k={k} m={m} on {isa}"
    from fucina.quant import dequantize
    w = dequantize(raw.reshape(-1), T.TQ2_0, n * k).reshape(n, k)
    want = K.act_roundtrip(x).reshape(x.shape) @ w.T
    torch.testing.assert_close(ref, want, rtol=1e-4, atol=1e-3 * float(want.abs().max()))


@pytest.mark.skipif(not AVX2, reason="no AVX2 on this CPU")
def test_gemv_probe_takes_groups():
    before = K.isa()
    try:
        for name in AVX2:
            K.set_isa(name)
            assert K._native.gemv_rows(K.TQ2_X8) == 8
    finally:
        K.set_isa(before)


@pytest.mark.skipif(not AVX2, reason="no AVX2 on this CPU")
def test_weight_interleaves_at_avx2_only_and_keeps_rows():
    from fucina.weights import LinearWeight
    n, k = 13, 512
    raw = _raw(n, k, 5)
    before = K.isa()
    try:
        for name in K.supported_isas():
            K.set_isa(name)
            w = LinearWeight(raw.clone(), T.TQ2_0, n, k, "w")
            K.attach(w)
            assert K.interleave(w) == (name in AVX2)
            assert torch.equal(w.raw, raw)    # the weight keeps its TQ2_0 rows
        K.set_isa(AVX2[0])
        w = LinearWeight(raw.clone(), T.TQ2_0, n, k, "w")
        K.attach(w)
        canon = w(torch.randn(3, k, generator=torch.Generator().manual_seed(1)))
        ids = torch.tensor([0, 12, 7, 8, 3, 12])
        rows = w.rows(ids)
        assert K.interleave(w) and w.kernel.qtype == K.TQ2_X8
        assert torch.equal(w(torch.randn(3, k, generator=torch.Generator().manual_seed(1))), canon)
        assert torch.equal(w.rows(ids), rows)
        with pytest.raises(K.KernelError):
            w.kernel.rows(torch.tensor([13]))
        with pytest.raises(Exception):
            w.rows(torch.tensor([-1]))
    finally:
        K.set_isa(before)


@pytest.fixture(scope="module")
def tq2_model_path(tmp_path_factory):
    import gguf
    from synth import write_model
    # 260 ffn rows (gate/up fused: 520) and 36 kv rows: groups with a tail
    return str(write_model(tmp_path_factory.mktemp("tq2x8") / "t.gguf", "qwen3",
                           qtype=gguf.GGMLQuantizationType.TQ2_0, hidden=256, heads=4, kv_heads=2,
                           head_dim=64, ffn=512, layers=2, seed=11))


@pytest.mark.skipif(not AVX2, reason="no AVX2 on this CPU")
def test_model_on_groups_gives_the_rows_logits(tq2_model_path, monkeypatch):
    """load_model at AVX2 repacks the layer weights (the native plan computes on them):
    prefill, decode and a 3-row verify give the logits of the same model on its rows."""
    from fucina.models import load_model
    before = K.isa()
    try:
        K.set_isa(AVX2[0])
        monkeypatch.setenv("FUCINA_TQ2_X8", "0")
        rows = load_model(tq2_model_path)
        monkeypatch.delenv("FUCINA_TQ2_X8")
        grp = load_model(tq2_model_path)
        L = grp.layers[0]
        assert L.wqkv.kernel.qtype == K.TQ2_X8 and L.w_gate_up.kernel.qtype == K.TQ2_X8
        assert rows.layers[0].wqkv.kernel.qtype == int(T.TQ2_0)
        assert L.wq.kernel.qtype == int(T.TQ2_0)   # a fused weight's parts are left as they are
        # the fused weight's stacked rows are dropped; raw rebuilds them from the groups
        from fucina.errors import FucinaError
        from fucina.weights.tq2x8 import GroupedWeight
        R = rows.layers[0]
        assert isinstance(L.w_gate_up, GroupedWeight) and "raw" not in vars(L.w_gate_up)
        assert torch.equal(L.w_gate_up.raw, R.w_gate_up.raw) and L.w_gate_up.nbytes == R.w_gate_up.nbytes
        assert torch.equal(L.wqkv.dequantize(), R.wqkv.dequantize())
        with pytest.raises(FucinaError, match="8-row groups"):
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
