"""The AVX-VNNI level (isa/avx2vnni.cpp: the AVX2 unit with vpdpbusd for its int8 dots) gives
the AVX2 unit's bits: the same int32 sums, so the same outputs, on every route and format."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import fucina.kernels as K
from fucina.gguf import TYPE_SIZES
from fucina.models import load_model
from synth import write_model
from test_kernels import TYPES, rand_weight

Q = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif("avx2vnni" not in K.supported_isas(), reason="CPU without AVX-VNNI")

SUPER = {t for t in TYPES if TYPE_SIZES[t][0] == 256}  # 256-element blocks


@pytest.fixture
def restore_kernels():
    isa, route = K.isa(), K.prefill_route()
    yield
    K.set_isa(isa)
    K.set_prefill_route(route)


def _on_both(fn):
    """fn() on AVX2, then on AVX2 + VNNI"""
    out = []
    for isa in ("avx2", "avx2vnni"):
        K.set_isa(isa)
        out.append(fn())
    return out


@pytest.mark.parametrize("route", ["canon", "int8"])
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_matmul_same_bits_as_avx2(qt, route, restore_kernels):
    """decode GEMV (m <= 4), panel / tile routes (6, 17, 41 rows), on the canonical and the
    legacy int8 route; the weights' random bytes reach every decoded value, 0..255 included"""
    K.set_prefill_route(route)
    rng = np.random.default_rng(300 + int(qt))
    n, k = 37, (768 if qt in SUPER else 608)
    raw = torch.from_numpy(rand_weight(qt, n, k, rng))
    x = torch.randn(41, k, generator=torch.Generator().manual_seed(int(qt))) * 3
    for m in (1, 2, 3, 4, 6, 17, 41):
        a, b = _on_both(lambda: K.matmul(raw, qt, n, k, x[:m]))
        assert torch.equal(a, b), f"{qt.name} m={m} route {route}"


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_0], ids=lambda t: t.name)
def test_step_same_bits_as_avx2(tmp_path, qtype, restore_kernels):
    """the native step (prefill, one-token step, a batch of streams) on a synthetic model"""
    K.set_prefill_route("canon")
    path = write_model(tmp_path / "m.gguf", "llama", qtype=qtype, hidden=64, heads=4, kv_heads=2, head_dim=16,
                       layers=2)
    model = load_model(path)
    assert model.native_plan is not None
    ids = [(7 * i * i + 3 * i + 5) % 250 + 1 for i in range(23)]

    def run():
        c = model.init_cache(64)
        prefill = model.forward_step_all_logits(c, ids[:20], 0)
        step = model.forward_step(c, ids[20:21], 20)
        streams = [model.init_cache(32) for _ in range(3)]
        for j, s in enumerate(streams):
            model.forward_step(s, ids[:j + 1], 0)
        return prefill, step, model.forward_step_batch(streams, ids[21:23] + [5])

    a, b = _on_both(run)
    for name, x, y in zip(("prefill", "step", "batch"), a, b):
        assert torch.equal(x, y), name


def test_default_order_and_forcing():
    """avx2vnni sits between avx512 and avx2; FUCINA_ISA=avx2 (set_isa) still forces plain AVX2"""
    isas = K.supported_isas()
    assert isas.index("avx2vnni") < isas.index("avx2")
    before = K.isa()
    try:
        K.set_isa("avx2")
        assert K.isa() == "avx2"
        K.set_isa("avx2vnni")
        assert K.isa() == "avx2vnni"
    finally:
        K.set_isa(before)


def test_fucina_isa_env_forces_plain_avx2():
    env = dict(os.environ, FUCINA_ISA="avx2")
    out = subprocess.run([sys.executable, "-c", "import fucina.kernels as K; print(K.isa())"], env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["avx2"]
