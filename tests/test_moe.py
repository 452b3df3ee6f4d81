"""Mixture-of-experts: the routing and expert math (models/moe.py), the zero-copy expert
stacks, the native MoE ffn of the layer step against the torch path, and batch
invariance through it (a row's logits never depend on the rows computed with it)."""
import gguf
import numpy as np
import pytest
import torch

import fucina.kernels as K
from fucina.errors import FucinaError, GGUFError
from fucina.kernels import KernelError
from fucina.models import load_model, moe
from synth import chunked_logits, write_model
from test_batch_invariance import check_batch_rows_equal_alone

Q = gguf.GGMLQuantizationType
GEOMETRY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, experts=8, experts_used=3, moe_ffn=64)
IDS = [(7 * i * i + 3 * i + 5) % 250 + 1 for i in range(60)]
_MODELS: dict = {}


def _model(tmp_path_factory, qtype):
    if qtype not in _MODELS:
        path = write_model(tmp_path_factory.mktemp("moe") / "m.gguf", "qwen3moe", qtype=qtype, **GEOMETRY)
        _MODELS[qtype] = load_model(path)
    return _MODELS[qtype]


def _prefill(model, chunks, native=True):
    return chunked_logits(model, IDS, chunks, native)


def test_routing_softmax_topk_renormalised():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    ids, w = moe.Routing(4, 2)(logits)
    assert ids.tolist() == [[1, 2], [0, 3]]
    p = torch.softmax(logits, -1)
    want = torch.stack([p[0, [1, 2]], p[1, [0, 3]]])
    assert torch.allclose(w, want / want.sum(-1, keepdim=True))
    _, raw = moe.Routing(4, 2, norm=False)(logits)
    assert torch.allclose(raw, want)
    _, scaled = moe.Routing(4, 2, scale=2.5)(logits)
    assert torch.allclose(scaled, 2.5 * want / want.sum(-1, keepdim=True))
    with pytest.raises(FucinaError):
        moe.Routing(4, 5)
    with pytest.raises(FucinaError):
        moe.Routing(4, 2, gating="nope")


def test_mix_equals_dense_reference(tmp_path_factory):
    """Grouped by expert == each row's experts one at a time, on dequantized weights."""
    model = _model(tmp_path_factory, Q.F32)
    L = model.layers[0]
    x = torch.randn(5, model.config.n_embd)
    ids, w = model.config.routing(L.router(x))
    got = moe.mix(x, ids, w, L.experts, torch.nn.functional.silu)
    want = torch.zeros_like(got)
    for r in range(x.shape[0]):
        for e, we in zip(ids[r].tolist(), w[r].tolist()):
            g = x[r] @ L.experts.gate.expert(e).dequantize().T
            u = x[r] @ L.experts.up.expert(e).dequantize().T
            want[r] += we * (torch.nn.functional.silu(g) * u) @ L.experts.down.expert(e).dequantize().T
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(FucinaError):
        moe.mix(x, ids + 100, w, L.experts, torch.nn.functional.silu)


def test_expert_stacks_are_views_of_the_mapping(tmp_path_factory):
    model = _model(tmp_path_factory, Q.Q8_0)
    stack = model.layers[1].experts.down
    t = model.gguf.tensors["blk.1.ffn_down_exps.weight"]
    assert stack.shape == (8, 64, 64) and stack.qtype == gguf.GGMLQuantizationType.Q8_0
    base = np.asarray(t.data).ctypes.data
    assert stack.whole.raw.data_ptr() == base                 # no copy of the stack
    assert stack.expert(3).raw.data_ptr() == base + 3 * 64 * stack.whole.raw.shape[1]
    assert stack.expert(3) is stack.expert(3)


def test_bad_expert_metadata_is_typed(tmp_path):
    path = write_model(tmp_path / "bad.gguf", "qwen3moe", **dict(GEOMETRY, experts_used=9))
    with pytest.raises(GGUFError):
        load_model(path)


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_native_moe_matches_torch(tmp_path_factory, qtype):
    model = _model(tmp_path_factory, qtype)
    assert model.native_plan is not None
    chunks = [9, 1, 1, 6, 1, 2]
    got, want = _prefill(model, chunks), _prefill(model, chunks, native=False)
    if qtype == Q.F32:
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
    else:
        assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.9999


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_moe_prefill_split_any_way_equals_token_by_token(tmp_path_factory, qtype, isa):
    model = _model(tmp_path_factory, qtype)
    whole = _prefill(model, [60])   # 60 rows: the experts in turn; <= 42: one thread per expert
    for chunks in ([1] * 60, [9, 1, 1, 6, 2, 41], [3, 57]):
        assert torch.equal(_prefill(model, chunks), whole), f"{chunks} on {isa}"


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_moe_decode_in_batch_equals_alone(tmp_path_factory, qtype, isa):
    check_batch_rows_equal_alone(_model(tmp_path_factory, qtype), IDS, isa)


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
def test_plan_rejects_inconsistent_moe_layers(tmp_path_factory):
    model = _model(tmp_path_factory, Q.F32)
    c, L = model.config, model.layers[0]
    layer = model.plan_layer(0, L)
    for bad in (dict(layer, n_expert_used=9),                 # more used than there are
                dict(layer, n_expert=4),                      # stacks hold 8 experts
                dict(layer, n_ff_exp=32),                     # stacks hold 64 rows each
                dict(layer, gate_exps=L.router),              # a stack of the wrong shape
                dict(layer, gate_inp=L.wo),                   # a router of the wrong shape
                dict(layer, down_exps=None),
                dict(layer, moe_norm=2)):
        with pytest.raises(KernelError):
            K.DecoderPlan.build(n_embd=c.n_embd, n_ff=c.n_ff, n_rot=c.n_rot, neox=True, act="silu",
                                eps=1e-6, scale=0.25, layers=[bad])
