"""The scale-tied PTQTP fit (K=2, plane scales 3 s and s) and its folded serving: planted
9-level weights recovered exactly, planes that are plain TQ2_0 with their scales tied in
f16, the folded kernel (FK_PTQTP_FOLD, one dot a block) == its Python reference, == the
scalar unit, m rows == m single rows bitwise at every ISA level; the `--tie` file's layout,
its reload to the same logits bitwise, and typed errors for a file whose planes are not tied."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import fucina.kernels as K
from fucina.cli import main as cli
from fucina.cli.quantize import _copy_verbatim, decorate
from fucina.errors import GGUFError, QuantError
from fucina.gguf import GGMLType as T, GGUFFile
from fucina.gguf.ptqtp import TIE_KEY, plane_name
from fucina.models import load_model
from fucina.quant import dequantize
from fucina.quant.ptqtp import fit, fold_bytes, fold_dequantize, plane_bytes, tie_round, unfold_planes
from fucina.weights.ptqtp import PtqtpWeight
from test_ptqtp_gguf import _logits, src  # noqa: F401  (a 2-layer Qwen3-shaped F32 model)


def _planted(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(-4, 5, (rows, k), generator=g).float()
    s = tie_round(torch.rand(rows, k // 256, generator=g) * 0.05 + 0.005)
    return (c.view(rows, -1, 256) * s.unsqueeze(-1)).view(rows, k), s


@pytest.mark.parametrize("solver", ["torch", "auto"])
def test_planted_nine_level_weights_recovered_exactly(solver):
    W, s = _planted(5, 512, 1)
    f = fit(W, 2, tie=True, solver=solver)
    assert f.tied and f.unconverged == 0
    assert torch.equal(f.weight(), W)
    assert torch.equal(f.scales[1], s) and torch.equal(f.scales[0], 3 * s)


def test_tied_planes_are_tq2_0_with_tied_f16_scales_and_fold_losslessly():
    W = torch.randn(6, 768, generator=torch.Generator().manual_seed(2))
    f = fit(W, 2, tie=True)
    assert torch.equal(f.scales[0], 3 * f.scales[1])
    assert torch.equal(f.scales[1].half().float(), f.scales[1]) and torch.equal(f.scales[0].half().float(), f.scales[0])
    p0, p1 = plane_bytes(f, 0), plane_bytes(f, 1)
    total = sum(dequantize(p.reshape(-1), T.TQ2_0, W.numel()).reshape(W.shape) for p in (p0, p1))
    assert torch.equal(total, f.weight())
    folded = fold_bytes(p0, p1, 6)
    assert folded.shape == (6, 3 * 130)
    assert torch.equal(fold_dequantize(folded, 6, 768), f.weight())   # s c: the planes' sum exactly
    u0, u1 = unfold_planes(folded, 6)
    assert np.array_equal(u0, p0) and np.array_equal(u1, p1)


def test_tied_error_near_the_free_fit_below_one_plane_and_deterministic():
    W = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    err = {k: float((f.weight() - W).norm() / W.norm())
           for k, f in (("K1", fit(W, 1)), ("K2", fit(W, 2)), ("tied", fit(W, 2, tie=True)))}
    assert err["tied"] < err["K1"] and err["tied"] < 1.1 * err["K2"], err
    a, b = fit(W, 2, tie=True), fit(W, 2, tie=True)
    assert torch.equal(a.trits, b.trits) and torch.equal(a.scales, b.scales)


def test_tie_takes_two_planes_and_tied_scales():
    with pytest.raises(QuantError, match="takes 2 planes"):
        fit(torch.zeros(1, 256), 3, tie=True)
    f = fit(torch.randn(2, 256), 2)   # free scales: not tied
    with pytest.raises(QuantError, match="not tied at 3 to 1"):
        fold_bytes(plane_bytes(f, 0), plane_bytes(f, 1), 2, "m")
    with pytest.raises(QuantError, match="has 2 planes, not 3"):
        PtqtpWeight([plane_bytes(f, 0)] * 3, 2, 256, "m", tied=True)


def _fold_matmul(raw: torch.Tensor, n: int, k: int, x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], n)
    K._native.matmul(K.PTQTP_FOLD, raw.data_ptr(), raw.shape[1], n, k, x.data_ptr(), x.shape[0], y.data_ptr(), n)
    return y


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
def test_folded_kernel_equals_reference_scalar_and_rows_alone(isa):
    """Any nibbles (the format reads 9..15 as they are), odd row counts, 1..5 groups a row:
    every m of the decode GEMV (1-8) and the panel route (9+) against the f64 reference,
    the scalar unit's bits, and each row alone."""
    rng = np.random.default_rng(7)
    for n, groups in ((1, 1), (9, 2), (19, 3), (33, 5)):
        k = 256 * groups
        raw = rng.integers(0, 256, (n * groups, 130), dtype=np.uint8)
        raw[:, 128:130] = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
        raw = torch.from_numpy(raw.reshape(n, -1).copy())
        x = torch.randn(12, k, generator=torch.Generator().manual_seed(n))
        singles = torch.cat([_fold_matmul(raw, n, k, x[i:i + 1].contiguous()) for i in range(12)])
        K.set_isa("scalar")
        try:
            scalar = _fold_matmul(raw, n, k, x)
        finally:
            K.set_isa(isa)
        xr, W = K.act_roundtrip(x).reshape(-1, k).double(), fold_dequantize(raw.numpy(), n, k).double()
        ref, scale = xr @ W.T, xr.abs() @ W.abs().T
        for m in range(1, 13):
            got = _fold_matmul(raw, n, k, x[:m].contiguous())
            assert torch.equal(got, singles[:m]) and torch.equal(got, scalar[:m]), (n, k, m, isa)
        assert ((singles.double() - ref).abs() / (scale + 1e-30)).max() < 2e-6


def test_tied_weight_serves_folded(isa):
    W = torch.randn(37, 512, generator=torch.Generator().manual_seed(5))
    f = fit(W, 2, tie=True)
    w = PtqtpWeight.from_fit(f, "m")
    assert w.tied and w.folded is not None and w.stacked is None
    if K.available():
        assert w.kernel is not None and w.kernel.qtype == K.PTQTP_FOLD
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(6))
    singles = torch.cat([w(x[i:i + 1]) for i in range(20)])
    for m in (1, 2, 5, 8, 9, 20):
        assert torch.equal(w(x[:m]), singles[:m]), m
    if K.available():
        assert ((singles.double() - w.fold_reference(x)).abs().max()
                < 2e-6 * singles.abs().max())
    assert torch.equal(w.dequantize(), f.weight())
    # the per-plane sum: the same weights, another rounding (not the canonical result)
    assert (w.per_plane(x) - singles).abs().max() < 1e-4 * singles.abs().max()
    a, b = PtqtpWeight.from_fit(f, "a"), PtqtpWeight.from_fit(fit(W, 2), "b")
    fused = PtqtpWeight.fuse([a, PtqtpWeight.from_fit(f, "c")])
    assert fused.tied and torch.equal(fused(x), torch.cat([a(x), a(x)], dim=-1))
    assert PtqtpWeight.fuse([a, b]) is None   # tied with untied: not one weight


@pytest.fixture(scope="module")
def tied_file(src, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("t") / "tied.gguf")
    decorate(src, out, 2, only=["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
                                "blk.1.ffn_up.weight"], tie=True)
    return out


def test_tied_file_reloads_folded_to_the_in_memory_logits_bitwise(src, tied_file):
    from fucina.models import llama

    b = GGUFFile(tied_file)
    assert b.metadata[TIE_KEY] == 1
    name = "blk.0.attn_q.weight"
    f = fit(GGUFFile(src).tensors[name].data.view(np.float32).reshape(256, -1), 2, tie=True)
    for p in range(2):
        assert np.array_equal(b.tensors[plane_name(name, p)].data.reshape(f.trits.shape[1], -1), plane_bytes(f, p))
    loaded = load_model(tied_file)
    L0, L1 = loaded.layers
    assert L0.wq.tied and L0.wqkv.tied and L1.up.tied and not isinstance(L0.wo, PtqtpWeight)
    if K.available():
        assert L0.wqkv.kernel.qtype == K.PTQTP_FOLD and loaded.native_plan is not None
    ref = load_model(src)
    for L, attrs in ((ref.layers[0], ("wq", "wk", "wv")), (ref.layers[1], ("up",))):
        for attr in attrs:
            w = getattr(L, attr)
            setattr(L, attr, PtqtpWeight.from_fit(fit(w.dequantize(), 2, tie=True), w.name))
    ref.layers[0].wqkv = llama.fuse(None, [ref.layers[0].wq, ref.layers[0].wk, ref.layers[0].wv])
    ref.layers[1].w_gate_up = llama.fuse(None, [ref.layers[1].gate, ref.layers[1].up])
    ref.native_plan = ref.build_plan()
    assert torch.equal(_logits(loaded), _logits(ref))


def test_a_tie_key_over_untied_planes_is_an_error(src, tmp_path):
    from fucina.train.export import _copy_metadata, write_and_move

    free = str(tmp_path / "free.gguf")
    decorate(src, free, 2, only=["blk.0.attn_q.weight"])
    f = GGUFFile(free)
    bad = str(tmp_path / "bad.gguf")
    w = gguf.GGUFWriter(bad + ".tmp", f.architecture)
    _copy_metadata(free, w, None)
    w.add_uint32(TIE_KEY, 1)
    for name, t in f.tensors.items():
        _copy_verbatim(w, name, t)
    write_and_move(w, bad + ".tmp", bad)
    with pytest.raises(GGUFError, match="blk.0.attn_q.weight.*not tied at 3 to 1"):
        load_model(bad)


def test_tie_needs_ptqtp_two(src, tmp_path, capsys):
    with pytest.raises(QuantError, match="--tie takes --ptqtp 2"):
        decorate(src, str(tmp_path / "o.gguf"), 3, tie=True)
    assert cli.main(["quantize", src, str(tmp_path / "o.gguf"), "--type", "Q8_0", "--tie"]) != 0
    assert "--tie is for --ptqtp 2" in capsys.readouterr().err
