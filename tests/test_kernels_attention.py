"""Native decode attention over the f16 KV cache vs the torch reference path.

One query row, K/V rows f16 [n, kv_heads, d] (whole caches and window slices of a
larger cache), GQA groups 1/3/4/8, n = 1..3000, head_dim 64/128/256 (and 80: the
runtime-d path), on every ISA level this CPU supports, with 1 and 2 threads.
"""
from __future__ import annotations

import math

import pytest
import torch

import fucina.kernels as K
from fucina.models import base
from fucina.models.base import attention
from fucina.models.cache import KVCache

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")


@pytest.fixture(params=[1, 2])
def threads(request):
    before = K.get_threads()
    K.set_threads(request.param)
    yield request.param
    K.set_threads(before)


def reference(q, k, v, scale):
    """f64 softmax(q k^T) v, GQA by group."""
    _, n_head, d = q.shape
    kvh = k.shape[1]
    qd = q.double().view(kvh, n_head // kvh, d)
    s = torch.bmm(qd, k.double().permute(1, 2, 0)) * scale
    return torch.bmm(torch.softmax(s, -1), v.double().transpose(0, 1)).reshape(1, n_head * d).float()


def torch_path(q, k, v, scale):
    """base._decode_attention with the native route off: the reference the model used before."""
    K.set_enabled(False)
    try:
        return base._decode_attention(q, k, v, scale)
    finally:
        K.set_enabled(True)


def rand(n, n_head, kvh, d, gen, spread=1.0):
    q = torch.randn(1, n_head, d, generator=gen) * spread
    k = torch.randn(n, kvh, d, generator=gen).half()
    v = torch.randn(n, kvh, d, generator=gen).half()
    return q, k, v


CASES = [  # (n, n_head, kv_heads, head_dim)
    (1, 9, 3, 64), (2, 4, 4, 64), (15, 9, 3, 64), (16, 9, 3, 64), (17, 8, 2, 128),
    (100, 16, 2, 128), (257, 32, 8, 64), (1000, 24, 3, 64), (2048, 9, 3, 64),
    (3000, 16, 8, 128), (513, 8, 1, 256), (77, 8, 8, 256), (33, 6, 2, 80), (1200, 12, 4, 80),
]


@pytest.mark.parametrize("n,n_head,kvh,d", CASES)
def test_matches_reference(isa, threads, n, n_head, kvh, d):
    gen = torch.Generator().manual_seed(n * 31 + n_head * 7 + d)
    q, k, v = rand(n, n_head, kvh, d, gen, spread=2.0)
    scale = 1.0 / math.sqrt(d)
    out = K.decode_attention(q, k, v, scale)
    assert out.shape == (1, n_head * d) and out.dtype == torch.float32
    ref = reference(q, k, v, scale)
    err = (out - ref).abs().max().item()
    assert err < 2e-5, f"{isa} n={n} heads {n_head}/{kvh} d={d}: {err:.2e}"
    assert (out - torch_path(q, k, v, scale)).abs().max().item() < 2e-5


@pytest.mark.parametrize("n,n_head,kvh,d", [(2, 8, 4, 128), (3, 16, 8, 128), (16, 16, 8, 128), (40, 9, 3, 64),
                                            (300, 32, 8, 64)])
def test_threads_give_the_same_bits(isa, n, n_head, kvh, d):
    """Two threads split the (kv head, key chunk) tasks from a few rows on (the rows are cold
    in decode); a task and the merge order do not depend on the split."""
    gen = torch.Generator().manual_seed(n + 7 * d)
    q, k, v = rand(n, n_head, kvh, d, gen, spread=2.0)
    before = K.get_threads()
    try:
        outs = []
        for th in (1, 2, 3):
            K.set_threads(th)
            outs.append(K.decode_attention(q, k, v, 1.0 / math.sqrt(d)))
    finally:
        K.set_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_random_shapes(isa):
    gen = torch.Generator().manual_seed(7)
    for _ in range(40):
        kvh = int(torch.randint(1, 9, (1,), generator=gen))
        group = [1, 3, 4, 8][int(torch.randint(0, 4, (1,), generator=gen))]
        d = [64, 128, 256][int(torch.randint(0, 3, (1,), generator=gen))]
        n = int(torch.randint(1, 3001, (1,), generator=gen))
        q, k, v = rand(n, kvh * group, kvh, d, gen, spread=3.0)
        out = K.decode_attention(q, k, v, 0.125)
        err = (out - reference(q, k, v, 0.125)).abs().max().item()
        assert err < 2e-5, f"n={n} heads {kvh * group}/{kvh} d={d}: {err:.2e}"


def test_peaked_and_extreme_scores(isa, threads):
    """Large logits (one key dominates; others underflow to 0) stay finite and exact."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = rand(700, 8, 2, 64, gen, spread=40.0)
    out = K.decode_attention(q, k, v, 1.0)
    assert torch.isfinite(out).all()
    assert (out - reference(q, k, v, 1.0)).abs().max().item() < 2e-4


def test_window_slice_of_cache(isa, threads):
    """k/v as a row slice [start:n] of a bigger contiguous cache, and through attention()."""
    gen = torch.Generator().manual_seed(11)
    cap, kvh, d, n_head = 4096, 4, 128, 16
    kc = torch.randn(cap, kvh, d, generator=gen).half()
    vc = torch.randn(cap, kvh, d, generator=gen).half()
    q = torch.randn(1, n_head, d, generator=gen)
    for start, n in [(0, 1), (5, 6), (300, 2348), (1000, 4096)]:
        k, v = kc[start:n], vc[start:n]
        out = K.decode_attention(q, k, v, 0.09)
        assert (out - reference(q, k, v, 0.09)).abs().max().item() < 2e-5

    cache = KVCache(1, [kvh], [d], 3000, dtype=torch.float16)
    cache.append(0, kc[:2500], vc[:2500])
    for window in (0, 1, 64, 1000):
        out = attention(q, cache, 0, 2499, 0.09, window=window)
        start = max(0, 2499 - window + 1) if window else 0
        ref = reference(q, kc[start:2500], vc[start:2500], 0.09)
        assert (out - ref).abs().max().item() < 2e-5


def test_routing():
    """_decode_attention takes the kernel for f16 caches, torch for f32 (q8 cache) or grad."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = rand(50, 8, 2, 64, gen)
    assert K.decode_attention_ok(q, k, v)
    assert not K.decode_attention_ok(q, k.float(), v.float())
    assert not K.decode_attention_ok(q.requires_grad_(), k, v)
    q = q.detach()
    out32 = base._decode_attention(q, k.float(), v.float(), 0.1)
    out16 = base._decode_attention(q, k, v, 0.1)
    assert (out32 - out16).abs().max().item() < 2e-5
    # a strided k (heads sliced out of a wider cache) is not contiguous: torch path
    wide = torch.randn(50, 4, 64, generator=gen).half()
    assert not K.decode_attention_ok(q, wide[:, :2], wide[:, 2:])
    assert (base._decode_attention(q, wide[:, :2], wide[:, 2:], 0.1)
            - reference(q, wide[:, :2], wide[:, 2:], 0.1)).abs().max().item() < 2e-5
    # non-contiguous q is made contiguous
    qt = torch.randn(1, 64, 8, generator=gen).transpose(1, 2)
    assert (K.decode_attention(qt, k, v, 0.1) - reference(qt, k, v, 0.1)).abs().max().item() < 2e-5


@pytest.mark.parametrize("args,msg", [
    ((torch.zeros(1, 8, 64), torch.zeros(5, 2, 64), torch.zeros(5, 2, 64).half()), "f16"),
    ((torch.zeros(1, 8, 64).half(), torch.zeros(5, 2, 64).half(), torch.zeros(5, 2, 64).half()), "f32"),
    ((torch.zeros(2, 8, 64), torch.zeros(5, 2, 64).half(), torch.zeros(5, 2, 64).half()), "shapes"),
    ((torch.zeros(1, 8, 64), torch.zeros(5, 2, 64).half(), torch.zeros(6, 2, 64).half()), "shapes"),
    ((torch.zeros(1, 8, 64), torch.zeros(5, 3, 64).half(), torch.zeros(5, 3, 64).half()), "unsupported"),
    ((torch.zeros(1, 8, 72), torch.zeros(5, 2, 72).half(), torch.zeros(5, 2, 72).half()), "unsupported"),
    ((torch.zeros(1, 8, 64), torch.zeros(0, 2, 64).half(), torch.zeros(0, 2, 64).half()), "unsupported"),
    ((torch.zeros(1, 8, 64), torch.zeros(5, 4, 64).half()[:, :2], torch.zeros(5, 2, 64).half()), "contiguous"),
    ((torch.zeros(8, 64), torch.zeros(5, 2, 64).half(), torch.zeros(5, 2, 64).half()), "3-d"),
    (("q", torch.zeros(5, 2, 64).half(), torch.zeros(5, 2, 64).half()), "3-d"),
])
def test_rejects_bad_input(args, msg):
    with pytest.raises(K.KernelError, match=msg):
        K.decode_attention(*args, 0.1)
