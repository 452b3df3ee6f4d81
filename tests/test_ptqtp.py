"""PTQTP's solver (fucina.quant.ptqtp): planted ternary weights recovered exactly, error
falling with the plane count, deterministic, planes that are valid TQ2_0 tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fucina.errors import QuantError
from fucina.gguf import GGMLType as T
from fucina.quant import dequantize, quantize
from fucina.quant import ptqtp
from fucina.quant.ptqtp import candidates, fit, plane_bytes

needs_native_solver = pytest.mark.skipif(ptqtp._ptqtp is None, reason="native PTQTP solver not built")


def test_candidate_order_is_pinned():
    c = candidates(2).tolist()
    assert c[0] == [0, 0] and c[1:3] == [[0, 1], [0, -1]] and len(c) == 9
    assert len({tuple(r) for r in candidates(3).tolist()}) == 27


@pytest.mark.parametrize("solver", ["torch", pytest.param("native", marks=needs_native_solver)])
def test_planted_ternary_weights_recovered_exactly(solver):
    g = torch.Generator().manual_seed(1)
    t = torch.randint(-1, 2, (6, 512), generator=g).float()
    a = (torch.rand(6, 2, generator=g) * 0.1 + 0.01).half().float()   # f16-exact group scales
    W = (t.view(6, 2, 256) * a.unsqueeze(-1)).view(6, 512)
    f = fit(W, 1, solver=solver)
    assert torch.equal(f.trits[0].float(), t) and torch.equal(f.scales[0], a)
    assert torch.equal(f.weight(), W) and f.unconverged == 0


def test_error_falls_with_planes_below_absmean_and_is_deterministic():
    W = torch.randn(8, 256, generator=torch.Generator().manual_seed(2))
    absmean = dequantize(quantize(W, T.TQ2_0).reshape(-1), T.TQ2_0, W.numel()).reshape(W.shape)
    errs = [float((fit(W, k).weight() - W).norm() / W.norm()) for k in (1, 2, 3)]
    assert errs[2] < errs[1] < errs[0] < float((absmean - W).norm() / W.norm())
    a, b = fit(W, 2), fit(W, 2)
    assert torch.equal(a.trits, b.trits) and torch.equal(a.scales, b.scales)


def test_planes_are_tq2_0_tensors():
    W = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    f = fit(W, 2)
    total = torch.zeros_like(W)
    for p in range(2):
        raw = plane_bytes(f, p)
        assert raw.shape == (3, 2 * 66) and raw.dtype == np.uint8
        total += dequantize(raw.reshape(-1), T.TQ2_0, W.numel()).reshape(W.shape)
    assert torch.equal(total, f.weight())


def test_non_finite_weights_stay_out_of_the_fit():
    W = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    W[0, 5] = float("nan")
    f = fit(W, 2)
    assert (f.trits[:, 0, 5] == 0).all() and torch.isfinite(f.weight()).all()


@pytest.mark.parametrize("planes", [0, 4])
def test_plane_count_outside_one_to_three_is_an_error(planes):
    with pytest.raises(QuantError, match="1, 2 or 3 planes"):
        fit(torch.zeros(1, 256), planes)


def test_rows_must_split_into_groups():
    with pytest.raises(QuantError, match="256-value groups"):
        fit(torch.zeros(2, 100), 1)


@pytest.fixture(scope="module")
def fits():
    W = torch.randn(37, 512, generator=torch.Generator().manual_seed(5))
    return [fit(W, planes) for planes in (1, 2, 3)]


def test_fused_planes_equal_the_per_plane_sum_bitwise(fits, isa):
    """The native multi-plane kernel (one call, csrc/generic/ptqtp_impl.inc) against each
    plane's own TQ2_0 matmul summed in plane order, at every m of the decode GEMV (1-8),
    the multi-row and the prefill routes, on an odd row count; and m rows == m single rows."""
    import fucina.kernels as K
    from fucina.weights.ptqtp import PtqtpWeight

    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(6))
    for planes, f in zip((1, 2, 3), fits):
        w = PtqtpWeight.from_fit(f, "m")
        if K.available():
            assert w.kernel is not None and w.kernel.qtype == K.PTQTP_BASE + planes
        singles = torch.cat([w(x[i:i + 1]) for i in range(33)])
        for m in range(1, 34):
            got = w(x[:m])
            assert torch.equal(got, w.per_plane(x[:m])), (planes, m, isa)
            assert torch.equal(got, singles[:m]), (planes, m, isa)   # batch invariant
        ref = x.double() @ w.dequantize().double().T
        assert ((got.double() - ref).abs().max() / ref.abs().max()) < 2e-2


def test_fused_weights_stack_plane_by_plane(fits, isa):
    from fucina.weights.ptqtp import PtqtpWeight

    a, b = PtqtpWeight.from_fit(fits[1], "a"), PtqtpWeight.from_fit(fits[1], "b")
    fused = PtqtpWeight.fuse([a, b])
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    assert torch.equal(fused(x), torch.cat([a(x), b(x)], dim=-1))
    assert PtqtpWeight.fuse([a, PtqtpWeight.from_fit(fits[0], "c")]) is None   # plane counts differ


def test_a_plane_count_outside_one_to_three_is_refused_by_the_weight():
    from fucina.weights.ptqtp import PtqtpWeight

    with pytest.raises(QuantError, match="1, 2 or 3 planes"):
        PtqtpWeight([], 1, 256)


@needs_native_solver
@pytest.mark.parametrize("planes,tie", [(1, False), (2, False), (3, False), (2, True)])
def test_native_solver_matches_the_torch_formulation(planes, tie):
    """The same alternation: identical trits; scales identical but for a rare last f16 bit
    (the two round their ridge sums differently); the thread count changes nothing."""
    W = torch.randn(24, 512, generator=torch.Generator().manual_seed(7)) * 0.05
    W[3, 7] = 1.5                                   # an outlier group
    ref = fit(W, planes, tie=tie, solver="torch")
    one = fit(W, planes, tie=tie, solver="native", threads=1)
    two = fit(W, planes, tie=tie, solver="native", threads=2)
    assert torch.equal(one.trits, two.trits) and torch.equal(one.scales, two.scales)
    assert one.iterations == ref.iterations and one.unconverged == ref.unconverged
    same = (one.scales == ref.scales).float().mean().item()
    assert same >= 0.98, same
    if same == 1.0:
        assert torch.equal(one.trits, ref.trits)
    err_ref = float((ref.weight() - W).norm() / W.norm())
    err = float((one.weight() - W).norm() / W.norm())
    assert abs(err - err_ref) <= 1e-4 * err_ref


def test_unknown_solver_is_an_error():
    with pytest.raises(QuantError, match="solver"):
        fit(torch.zeros(1, 256), 1, solver="gpu")
