"""Native quantized matmul vs the reference path (dequantize + f64 matmul).

Random blocks of every native format (scale fields set to sane f16 values, every other
bit random), odd shapes, m = 1..n rows, on every ISA level this CPU supports.
The integer kernels quantize activations to int8 per 32 values; against activations
put through that same round trip they must agree to float rounding, and against the
exact f32 activations to the int8 quantization error.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import quants

from fucina.gguf import TYPE_SIZES, GGMLType as T
import fucina.kernels as K

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

FLOATS = {T.F32, T.F16, T.BF16}
# byte offsets of the f16 scale fields in each block (everything else is random bits)
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
              T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
              T.IQ4_NL: [0], T.IQ4_XS: [0], T.TQ1_0: [52], T.TQ2_0: [64], T.MXFP4: [],
              T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0], T.IQ1_S: [0],
              T.IQ1_M: []}
# byte offsets of the E8M0 scale bytes (2^(e - 128) each): kept near 2^-5 so products stay finite
E8M0_FIELDS = {T.MXFP4: [0]}
TYPES = sorted(K.NATIVE_TYPES, key=int)


def rand_weight(qt: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    bs, ts = TYPE_SIZES[qt]
    w = rng.standard_normal((n, k)).astype(np.float32)
    if qt == T.F32:
        return w.view(np.uint8).reshape(n, -1)
    if qt == T.F16:
        return w.astype(np.float16).view(np.uint8).reshape(n, -1)
    if qt == T.BF16:
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)
    raw = rng.integers(0, 256, (n * (k // bs), ts), dtype=np.uint8)
    for o in F16_FIELDS[qt]:
        d = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16)
        raw[:, o:o + 2] = d.view(np.uint8).reshape(-1, 2)
    for o in E8M0_FIELDS.get(qt, []):
        raw[:, o] = rng.integers(118, 126, raw.shape[0], dtype=np.uint8)
    if qt == T.IQ1_M:  # its f16 d lies in the top nibbles of the four scale words (bytes 49, 51, 53, 55)
        d = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16).view(np.uint16)
        for i in range(4):
            raw[:, 49 + 2 * i] = (raw[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qt: T, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(quants.dequantize(raw, qt), dtype=np.float64).reshape(n, k))


def check(qt: T, n: int, k: int, m: int, rng, lead=()) -> None:
    raw = rand_weight(qt, n, k, rng)
    W = reference(raw, qt, n, k)
    x = torch.from_numpy(rng.standard_normal((*lead, m, k)).astype(np.float32))   # seeded: the tolerance below is statistical
    y = K.matmul(torch.from_numpy(raw), qt, n, k, x)
    assert y.shape == (*lead, m, n) and y.dtype == torch.float32
    x2 = x.reshape(-1, k)
    if K.route(x2.shape[0], qt) == "bf16":  # both operands rounded to bf16, f32 accumulation
        xr = x2.bfloat16().double()
        W = W.float().bfloat16().double()
    elif qt in FLOATS:
        xr = x2
    else:
        xr = K.act_roundtrip(x2).reshape(-1, k)
    scale = xr.abs().double() @ W.abs().T + 1e-30
    y2 = y.reshape(-1, n).double()
    err_rt = ((y2 - xr.double() @ W.T).abs() / scale).max().item()
    err_true = ((y2 - x2.double() @ W.T).abs() / scale).max().item()
    # bf16 route: a decoded weight may round to the neighbouring bf16 of the reference's
    tol = 1e-4 if K.route(x2.shape[0], qt) == "bf16" else 2e-6
    assert err_rt < tol, f"{qt.name} n={n} k={k} m={m}: {err_rt:.2e} against the round-tripped input"
    assert err_true < 1e-2, f"{qt.name} n={n} k={k} m={m}: {err_true:.2e} against the f32 input"


def _has_bf16_route() -> bool:
    if not K.available():
        return False
    before = K.prefill_route()
    try:
        K.set_prefill_route("bf16")
        return True
    except K.KernelError:
        return False
    finally:
        K.set_prefill_route(before)


# 'canon' (the batch-invariant default) and the legacy opt-out routes (FUCINA_INVARIANT=0)
PREFILL_ROUTES = ["canon", "int8"] + (["bf16"] if _has_bf16_route() else [])


@pytest.fixture(params=PREFILL_ROUTES)
def prefill(request):
    before = K.prefill_route()
    K.set_prefill_route(request.param)
    yield request.param
    K.set_prefill_route(before)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_prefill_routes(prefill, qt):
    """m >= prefill_min_m() rows, on each prefill route this CPU has."""
    rng = np.random.default_rng(int(qt) * 3 + 1)
    bs = max(TYPE_SIZES[qt][0], 32)
    for n, k, m in [(5, bs, 8), (9, 3 * bs, 13), (6, 2 * bs, 31)]:
        check(qt, n, k, m, rng)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_every_format_every_isa(isa, qt):
    rng = np.random.default_rng(int(qt) * 7 + len(isa))
    bs = max(TYPE_SIZES[qt][0], 32)
    for n, k, m in [(1, bs, 1), (7, 3 * bs, 2), (13, 2 * bs, 3), (5, bs, 4), (33, 512, 5), (6, 256, 11)]:
        check(qt, n, k, m, rng)


@pytest.mark.parametrize("qt", sorted(set(TYPES) - FLOATS, key=int), ids=lambda t: t.name)
def test_int8_extreme_activations(isa, qt, prefill):
    """Every activation at +-127 after quantization, all of one sign or alternating in pairs:
    the largest int16 pair sums the dots can meet (codes up to 255 against 127), where a
    vpmaddubsw sum kept in int16 too long would overflow."""
    rng = np.random.default_rng(int(qt) + 5)
    bs = max(TYPE_SIZES[qt][0], 32)
    n, k = 21, 4 * bs
    raw = rand_weight(qt, n, k, rng)
    W = reference(raw, qt, n, k)
    pairs = torch.tensor([1.0, 1.0, -1.0, -1.0]).repeat(k // 4)
    for x in (torch.ones(1, k), -torch.ones(3, k), pairs.repeat(9, 1)):
        y = K.matmul(torch.from_numpy(raw), qt, n, k, x).double()
        if K.route(x.shape[0], qt) == "bf16":
            continue   # both operands rounded to bf16: test_prefill_routes covers it
        scale = x.abs().double() @ W.abs().T + 1e-30
        err = ((y - x.double() @ W.T).abs() / scale).max().item()
        assert err < 2e-6, f"{qt.name} m={x.shape[0]}: {err:.2e}"


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_decode_route_odd_block_counts(isa, qt):
    """m = 1..4 (the fused GEMVs on AVX-512) over 1..7 blocks per row, and rows not a multiple of 16."""
    rng = np.random.default_rng(int(qt) + 11)
    bs = max(TYPE_SIZES[qt][0], 32)
    for nblocks in (1, 2, 3, 5, 6, 7):
        for m in (1, 2, 3, 4):
            check(qt, 19, nblocks * bs, m, rng)
    if qt in FLOATS:  # float rows of any length
        for k in (1, 5, 37, 100):
            for m in (1, 3, 9):
                check(qt, 7, k, m, rng)


@pytest.mark.parametrize("qt", [T.Q2_K, T.Q3_K], ids=lambda t: t.name)
def test_decode_route_q2k_q3k(isa, qt):
    """m = 1 over Q2_K / Q3_K (the fused GEMV on AVX-512): 1..10 blocks per row, odd row
    counts, and rows split over 2 threads."""
    rng = np.random.default_rng(int(qt) + 23)
    for k in (256, 512, 768, 2560):
        for n in (1, 3, 17, 33):
            check(qt, n, k, 1, rng)
    n0 = K.get_threads()
    try:
        K.set_threads(2)
        check(qt, 301, 2560, 1, rng)
    finally:
        K.set_threads(n0)


@pytest.mark.parametrize("qt", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q6_K, T.F16],
                         ids=lambda t: t.name)
def test_m_one_to_n(qt):
    rng = np.random.default_rng(1)
    k = 512
    for m in range(1, 10):
        check(qt, 9, k, m, rng)
    check(qt, 9, k, 4, rng, lead=(2,))  # leading batch dims


@pytest.mark.parametrize("qt", [T.Q4_0, T.Q6_K, T.BF16], ids=lambda t: t.name)
def test_prefill_blocks(prefill, qt):
    """Enough rows that activations are processed in several L2-sized passes."""
    check(qt, 37, 4096, 45, np.random.default_rng(2))


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0, T.Q4_1, T.IQ4_XS, T.BF16], ids=lambda t: t.name)
def test_prefill_panels(prefill, qt):
    """Weight panels of 32 rows (partial panels past 16 and under 16 rows), activation
    tiles of 12 rows with every tail, several panels on 1 and 2 threads."""
    rng = np.random.default_rng(int(qt) + 5)
    bs = max(TYPE_SIZES[qt][0], 32)
    n0 = K.get_threads()
    try:
        for th in (1, 2):
            K.set_threads(th)
            for n, k, m in [(50, bs, 25), (64, 2 * bs, 12), (100, 3 * bs, 37), (33, 5 * bs, 8), (96, 2 * bs, 19)]:
                check(qt, n, k, m, rng)
        if qt == T.BF16:  # rows of any length
            for k in (37, 100, 130):
                check(qt, 40, k, 14, rng)
    finally:
        K.set_threads(n0)


def test_small_batches_on_two_threads():
    """The m = 2..4 fused route splits weight rows over threads like m = 1."""
    n0 = K.get_threads()
    K.set_threads(2)
    try:
        rng = np.random.default_rng(5)
        for qt in (T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_1):
            for m in (2, 3, 4):
                check(qt, 301, 1024, m, rng)
    finally:
        K.set_threads(n0)


def test_threads_agree():
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(rand_weight(T.Q4_K, 300, 1024, rng))
    x = torch.randn(3, 1024)
    n0 = K.get_threads()
    try:
        K.set_threads(1)
        a = K.matmul(raw, T.Q4_K, 300, 1024, x)
        K.set_threads(2)
        assert torch.get_num_threads() == 2
        b = K.matmul(raw, T.Q4_K, 300, 1024, x)
    finally:
        K.set_threads(n0)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decode_gemv_shares_and_steals_bitwise_at_any_thread_count():
    """The decode GEMV gives each thread a contiguous share of the tiles and lets a thread
    done with its own take the others' last tiles: whichever thread computes a tile, the
    rows come out bitwise as on one thread, with more threads than tiles too."""
    rng = np.random.default_rng(11)
    n0 = K.get_threads()
    try:
        for qt, n, k in [(T.Q4_K, 301, 1024), (T.Q8_0, 40, 4096), (T.Q6_K, 130, 2048)]:
            raw = torch.from_numpy(rand_weight(qt, n, k, rng))
            for m in (1, 3):
                x = torch.randn(m, k)
                K.set_threads(1)
                want = K.matmul(raw, qt, n, k, x)
                for th in (2, 3, 5, 8):
                    K.set_threads(th)
                    for _ in range(3):
                        assert torch.equal(K.matmul(raw, qt, n, k, x), want), (qt.name, m, th)
    finally:
        K.set_threads(n0)


def test_one_openmp_runtime():
    """The kernels share torch's libgomp: one thread pool, no oversubscription."""
    with open("/proc/self/maps") as f:
        libs = {m.group(0) for m in re.finditer(r"\S*libgomp[^/\s]*\.so[.\d]*", f.read())}
    assert len(libs) <= 1, libs


def linear_weight(qt: T, n: int, k: int, seed: int):
    from fucina.weights import LinearWeight
    raw = rand_weight(qt, n, k, np.random.default_rng(seed))
    w = LinearWeight(torch.from_numpy(raw.reshape(-1).copy()), qt, n, k, "w")
    K.attach(w)
    assert w.kernel is not None
    return w, raw


def test_attach_routes_linear_weight():
    n, k = 17, 256
    w, raw = linear_weight(T.Q4_K, n, k, 4)
    x = torch.randn(2, 3, k)
    y = w.linear(x)
    ref = (x.reshape(-1, k).double() @ reference(raw, T.Q4_K, n, k).T).reshape(2, 3, n)
    assert (y.double() - ref).abs().max().item() < 0.02 * ref.abs().max().item()
    # fused weights get a kernel too, equal to the parts
    f = type(w).fuse([w, w], "ww")
    assert f.kernel is not None
    torch.testing.assert_close(f.linear(x), torch.cat([y, y], dim=-1))


def test_grad_through_kernel():
    n, k = 8, 64
    w, raw = linear_weight(T.Q8_0, n, k, 5)
    x = torch.randn(3, k, requires_grad=True)
    w.linear(x).sum().backward()
    torch.testing.assert_close(x.grad, reference(raw, T.Q8_0, n, k).float().sum(0).expand(3, k))


def test_bad_calls_raise_typed_errors():
    raw = torch.zeros(4, 18, dtype=torch.uint8)
    x = torch.randn(2, 32)
    with pytest.raises(K.KernelError):
        K.matmul(raw, T.Q4_0, 4, 33, x)                     # k not a block multiple
    with pytest.raises(K.KernelError):
        K.matmul(raw, T.Q4_0, 5, 32, x)                     # rows do not match the bytes
    with pytest.raises(K.KernelError):
        K.matmul(raw, T.Q4_0, 4, 32, torch.randn(2, 64))    # input features
    with pytest.raises(K.KernelError):
        K.matmul(raw, T.Q4_0, 4, 32, torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(K.KernelError):
        K.matmul(raw.float(), T.Q4_0, 4, 32, x)             # not bytes
    with pytest.raises(K.KernelError):
        K.matmul(torch.zeros(18, 8, dtype=torch.uint8).T, T.Q4_0, 8, 32, x)  # strided bytes
    with pytest.raises(K.KernelError):
        K.matmul(raw, T.Q8_K, 4, 256, x)                    # no native route
    with pytest.raises(K.KernelError):
        K.set_threads(0)
    with pytest.raises(K.KernelError):
        K.set_isa("sse9")
    # the C layer refuses inconsistent raw calls by itself too
    with pytest.raises(ValueError):
        K._native.matmul(int(T.Q4_0), raw.data_ptr(), 17, 4, 32, x.data_ptr(), 2, 0, 4)
    # empty batch is fine
    assert K.matmul(raw, T.Q4_0, 4, 32, torch.randn(0, 32)).shape == (0, 4)
    # strided / f64 input is accepted (copied)
    y = K.matmul(raw, T.Q4_0, 4, 32, torch.randn(32, 2, dtype=torch.float64).T)
    assert y.shape == (2, 4)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_rows_equal_reference_dequant(isa, qt):
    """Embedding lookups through the kernel equal the reference dequantization."""
    k = 512 if qt not in FLOATS else 40
    w, raw = linear_weight(qt, 9, k, 3)
    ids = torch.tensor([8, 0, 3, 3])
    got = w.kernel.rows(ids)
    want = reference(raw, qt, 9, k)[ids].float()
    torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-7 * want.abs().max().item())
    with pytest.raises(K.KernelError):
        w.kernel.rows(torch.tensor([9]))
    with pytest.raises(K.KernelError):
        w.kernel.rows(torch.tensor([-1]))


# -- first_max: the greedy choice (numpy's argmax order) -----------------------------------

def _first_max_rows_cases():
    rng = np.random.default_rng(7)
    for n in (1, 2, 15, 16, 17, 63, 64, 65, 1000, 49152, 262144 + 3):
        x = rng.standard_normal(n).astype(np.float32)
        yield f"{n}-random", x
        t = np.round(x * 2) / 2                               # many ties at the top
        yield f"{n}-ties", t
        z = np.zeros(n, np.float32)
        z[rng.integers(n, size=2)] = -0.0                     # signed zeros are equal
        yield f"{n}-zeros", z
        yield f"{n}-all-minus-inf", np.full(n, -np.inf, np.float32)
        p = x.copy()
        p[rng.integers(n, size=2)] = np.inf
        yield f"{n}-plus-inf", p
        for where in {0, n // 2, n - 1}:
            q = x.copy()
            q[where] = np.nan                                 # a NaN anywhere ranks highest
            if n > 1:
                q[n - 1 - where] = np.nan                     # the first one wins
            yield f"{n}-nan-{where}", q


@pytest.mark.skipif(K._native is None, reason="native kernels not built")
@pytest.mark.parametrize("name,x", list(_first_max_rows_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_first_max_is_numpys_argmax(name, x):
    want = int(np.argmax(x))
    i, v = K.first_max(torch.from_numpy(x))
    assert i == want
    assert (v != v and x[want] != x[want]) or v == x[want]
    rows = np.stack([x, x[::-1].copy(), np.roll(x, 5)])
    assert K.first_max_rows(torch.from_numpy(rows)) == [int(j) for j in np.argmax(rows, axis=-1)]


def test_first_max_takes_any_row_and_rejects_a_bad_call():
    x = torch.randn(8, 100)
    col = x[:, 3]                                            # not contiguous: numpy's path
    assert K.first_max(col)[0] == int(np.argmax(col.numpy()))
    assert K.first_max(x[2].double())[0] == int(np.argmax(x[2].numpy()))
    if K._native is not None:
        with pytest.raises(ValueError, match="argmax_rows"):
            K._native.argmax_rows(0, 1, 100)                 # validated before any read
        with pytest.raises(ValueError, match="argmax_rows"):
            K._native.argmax_rows(x.data_ptr(), 1, 0)


def test_missing_extension_is_reported_once(monkeypatch):
    """A native module that fails to import (a broken or foreign build) leaves every matmul
    on the reference path: the loader warns once, with the import error, and `status()`
    (shown by `fucina bench`) says so."""
    import warnings

    monkeypatch.setattr(K, "_native", None)
    monkeypatch.setattr(K, "_native_error", "undefined symbol: g_x")
    monkeypatch.setattr(K, "_warned_missing", False)
    assert not K.available()
    assert "undefined symbol: g_x" in K.status() and K.status().startswith("reference")
    with pytest.warns(RuntimeWarning, match="undefined symbol: g_x.*pip install -e"):
        K.warn_if_missing()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K.warn_if_missing()          # once per process


def test_kernels_status_names_the_isa_or_the_opt_out(monkeypatch):
    if K._native is None:
        pytest.skip("native extension not built")
    assert K.status().split("+")[0] == K.isa() and K.unavailable_reason() is None
    monkeypatch.setattr(K, "_enabled", False)
    assert K.status() == "reference (FUCINA_KERNELS=0)"
    monkeypatch.setattr(K, "_warned_missing", False)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K.warn_if_missing()          # a choice, not a fault: no warning
