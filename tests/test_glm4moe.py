"""glm4moe on random-weight GGUFs written by tests/synth_glm4moe.py: the trunk is
block_count - nextn_predict_layers blocks, the NextN block is checked when present, and,
live, the quantized file's logits are at least as close to the exact model as llama.cpp's
with the same greedy continuation (the native layer step serving). The native step against
the torch blocks, batch invariance on every ISA, the expert store through the plan, and the
plan's checks of the routing fields."""
import dataclasses

import gguf
import numpy as np
import pytest
import torch

import fucina.kernels as K
import oracle as oracle_mod
from fucina.errors import GGUFError
from fucina.gguf import GGUFFile
from fucina.models import load_model, mtp, registry
from fucina.text.evaluate import greedy
from parity_cases import TEXT
from synth_glm4moe import write_glm4moe
from test_batch_invariance import check_batch_rows_equal_alone, check_split_equals_whole
from test_moe_shared import IDS as NATIVE_IDS, _run as _logits, check_streamed_equals_resident

needs_native = pytest.mark.skipif(not K.available(), reason="native kernels not built")

IDS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 33, 200]


def test_trunk_excludes_the_nextn_blocks(tmp_path):
    m = load_model(write_glm4moe(tmp_path / "m.gguf", layers=3, nextn=1))
    c = m.config
    assert (c.n_block, c.n_layer, len(m.layers), len(c.layers)) == (4, 3, 3, 3)
    assert [s.ffn for s in c.layers] == ["dense", "moe", "moe"] and c.n_rot == c.head_dim // 2
    assert m.init_cache(8).memories.__len__() == 3


def test_trunk_only_file_loads_and_matches(tmp_path):
    """A file that says nextn_predict_layers = 1 but dropped the block (llama.cpp's trunk-only
    case) computes the same logits as the full file (the same seed writes the same trunk)."""
    full = load_model(write_glm4moe(tmp_path / "a.gguf", seed=4))
    trunk = load_model(_drop(write_glm4moe(tmp_path / "b.gguf", seed=4), "blk.3.", tmp_path))
    a = full.forward_step_all_logits(full.init_cache(16), IDS, 0)
    b = trunk.forward_step_all_logits(trunk.init_cache(16), IDS, 0)
    assert (a == b).all()


def test_bad_files_raise(tmp_path):
    with pytest.raises(GGUFError, match="shared experts"):
        registry.check(GGUFFile(_drop(write_glm4moe(tmp_path / "a.gguf", layers=2), "blk.1.ffn_up_shexp.", tmp_path)))
    with pytest.raises(GGUFError, match="nextn_predict_layers"):
        registry.check(GGUFFile(write_glm4moe(tmp_path / "b.gguf", layers=0, nextn=2, dense_lead=0)))


def _drop(path, prefix, d):
    """A copy of `path` without the tensors whose names start with `prefix`."""
    r = gguf.GGUFReader(str(path))
    out = d / "dropped.gguf"
    w = gguf.GGUFWriter(str(out), "glm4moe")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = field.types[0]
        w.add_key_value(key, field.contents(), vt, sub_type=field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if not t.name.startswith(prefix):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(out)


def test_batch_rows_equal_rows_alone(tmp_path):
    m = load_model(write_glm4moe(tmp_path / "m.gguf", seed=2))
    caches = [m.init_cache(16) for _ in range(2)]
    for c, ids in zip(caches, ([5, 6, 7], [9, 10])):
        m.forward_step(c, ids, 0)
    got = m.forward_step_batch(caches, [11, 12])
    for r, (ids, t) in enumerate((([5, 6, 7], 11), ([9, 10], 12))):
        alone = m.init_cache(16)
        want = m.forward_step(alone, ids + [t], 0)
        assert (got[r] - want).abs().max() < 1e-4


@pytest.mark.slow
@pytest.mark.oracle
def test_live_quantized_closer_to_exact_than_llama_cpp(oracle, qwen3_vocab, tmp_path):
    """Q8_0 random weights with a NextN block (llama.cpp skips it): ours and llama.cpp's
    logits against the exact model (f32 arithmetic, our torch path): ours at least as close
    (per-position median of 1 - cos: a flipped sigmoid-routed expert moves one position by
    0.1-0.5 on either side, see test_deepseek2), and the greedy continuations equal."""
    path = write_glm4moe(tmp_path / "m.gguf", vocab=qwen3_vocab, qtype=gguf.GGMLQuantizationType.Q8_0, seed=3,
                         router_scale=12.0)
    ids, ours, ref, exact, model = oracle_mod.versus_exact(path, TEXT, tmp_path)

    def err(a):
        d = 1 - (a * exact).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(exact, axis=1)
        return float(np.median(d))
    assert err(ours) <= 1.05 * err(ref), (err(ours), err(ref))
    assert greedy(model, ids, 4) == oracle_mod.greedy_tokens(path, ids, 4, tmp_path)


def test_expert_streaming_same_output(tmp_path):
    """--moe-ram: the routed stacks stream from the file under a budget, same tokens."""
    from fucina.text.api import load

    path = write_glm4moe(tmp_path / "m.gguf", seed=1)
    want = load(path, n_ctx=64).generate("hello", max_tokens=8, temperature=0)
    assert load(path, n_ctx=64, moe_ram="70%").generate("hello", max_tokens=8, temperature=0) == want


# ---- the native layer step (sigmoid routing with the selection bias, the plain shared expert) ----
Q = gguf.GGMLQuantizationType


def _close(native, ref):
    torch.testing.assert_close(native, ref, rtol=1e-3, atol=1e-3)
    assert torch.nn.functional.cosine_similarity(native.double(), ref.double(), dim=-1).min() > 0.999


@needs_native
@pytest.mark.parametrize("kw", [dict(), dict(qk_norm=False, shared=2, dense_lead=0, rot=16),
                                dict(biases=False, shared=0, norm_topk=False, routed_scale=0.0), "k-bias-only"],
                         ids=["default", "no-qk-norm-2-shared-full-rope", "plain", "k-bias-only"])
def test_native_step_equals_torch_blocks(tmp_path, kw):
    """F32 weights (a quantized file's float noise can flip an activation's int8 rounding):
    the plan (leading dense layers, partial NEOX RoPE, biases, sigmoid routing with the
    selection bias, shared experts) against the torch blocks, the tolerance the other
    families' plan tests use."""
    if kw == "k-bias-only":   # each bias optional, as llama.cpp loads them: the absent ones add zeros
        (tmp_path / "v").mkdir()
        path = _drop(_drop(write_glm4moe(tmp_path / "m.gguf", seed=3), "blk.0.attn_q.bias", tmp_path),
                     "blk.0.attn_v.bias", tmp_path / "v")
    else:
        path = write_glm4moe(tmp_path / "m.gguf", seed=3, **kw)
    m = load_model(path)
    assert m.native_plan is not None and m.native_plan.n_layer == 3
    _close(_logits(m, True), _logits(m, False))


@needs_native
def test_the_selection_bias_and_gating_count(tmp_path):
    """The selection bias zeroed, then softmax gating: each moves the logits, and the plan
    still equals the torch blocks. (A router scale that saturates the sigmoids to 1.0 would
    leave ties among them, which torch's topk and the plan may break differently.)"""
    m = load_model(write_glm4moe(tmp_path / "m.gguf", seed=5))
    before = _logits(m, True)
    for L in m.layers[1:]:
        L.exp_bias = torch.zeros_like(L.exp_bias)
    m.native_plan = m.build_plan()
    unbiased = _logits(m, True)
    assert not torch.allclose(before, unbiased, rtol=1e-2, atol=1e-2)
    _close(unbiased, _logits(m, False))
    m.routing = dataclasses.replace(m.routing, gating="softmax")
    for L in m.layers[1:]:
        L.exp_bias = torch.linspace(-0.02, 0.02, m.config.n_expert)
    m.native_plan = m.build_plan()
    softmax = _logits(m, True)
    assert not torch.allclose(softmax, unbiased, rtol=1e-2, atol=1e-2)
    _close(softmax, _logits(m, False))


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    return load_model(write_glm4moe(tmp_path_factory.mktemp("glm") / "m.gguf", seed=6, qtype=Q.Q8_0))


@needs_native
def test_native_prompt_split_any_way_equals_one_call(q8_model, isa):
    """Decode, verify and prefill rows are one arithmetic: a prompt split any way gives the
    bits of one call, and the same cache."""
    check_split_equals_whole(q8_model, NATIVE_IDS[:37], ([1] * 37, [9, 1, 1, 6, 2, 18]), isa, capacity=64)


@needs_native
def test_native_batch_rows_equal_streams_alone(q8_model, isa):
    check_batch_rows_equal_alone(q8_model, NATIVE_IDS, isa)


@needs_native
def test_native_streamed_experts_equal_resident(tmp_path):
    """--moe-ram under a budget that evicts: the rebuilt plan calls the store, the same bits;
    the NextN block's plan (its experts not streamed) builds beside it."""
    m = check_streamed_equals_resident(write_glm4moe(tmp_path / "m.gguf", seed=1, qtype=Q.Q8_0))
    assert mtp.attach_from(m, True).block.native_plan is not None


@needs_native
def test_plan_checks_the_routing_fields(tmp_path):
    m = load_model(write_glm4moe(tmp_path / "m.gguf", seed=2))
    spec = m.native_plan._spec
    dense, moe_layer = spec["layers"][0], spec["layers"][1]

    def build(*layers):
        return K.DecoderPlan.build(**dict(spec, layers=list(layers)))
    assert build(dense, moe_layer) is not None
    with pytest.raises(K.KernelError, match="exp_probs_b"):
        build(dense, dict(moe_layer, exp_probs_b=torch.zeros(m.config.n_expert + 1)))
    with pytest.raises(K.KernelError, match="layer 0"):     # sigmoid routing on a dense ffn
        build(dict(dense, moe_sigmoid=1), moe_layer)
    with pytest.raises(K.KernelError, match="layer 1"):     # and beside gpt-oss's gating
        build(dense, dict(moe_layer, moe_weight_softmax=1))
    with pytest.raises(K.KernelError, match="layer 1"):
        build(dense, dict(moe_layer, moe_sigmoid=2))
