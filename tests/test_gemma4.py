"""Gemma 4: per-layer geometry, shared-KV layers, per-layer embeddings, soft-cap; against
llama.cpp b11434 on random-weight files the tests write (oracle tests skip without it)."""
import gguf
import numpy as np
import pytest
import torch

import fucina.kernels as K
import oracle as oracle_mod
from conftest import VOCAB_DIR
from fucina.errors import GGUFError
from fucina.models import load_model
from fucina.models.cache import AliasKV, WindowKV
from fucina.text.evaluate import greedy, teacher_forced_logits
from synth_gemma4 import write_gemma4

Q = gguf.GGMLQuantizationType

# an E-model-like geometry in miniature: global layers head_dim 64, local 32 with their own
# rotary width and base, per-layer KV heads and FFN widths, the last two layers sharing KV,
# per-layer embeddings, output scales, soft-cap 30
GEOMETRY = dict(layers=6, hidden=128, heads=4, kv_heads=[2, 1, 2, 1, 2, 1], head_dim=64, head_dim_swa=32,
                ffn=[128, 128, 128, 256, 256, 256], window=16, shared=2, seed=5)
IDS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 33, 200, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def _cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_gemma4(tmp_path_factory.mktemp("g4") / "g4.gguf", **GEOMETRY))


def test_layer_geometry(model):
    c = model.config
    assert [s.head_dim for s in c.layers] == [32, 64] * 3
    assert [s.n_head_kv for s in c.layers] == [2, 1] * 3
    assert [s.window for s in c.layers] == [16, 0] * 3
    assert [s.rope for s in c.layers] == [1, 0] * 3
    assert [c.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]   # last local / global writer
    assert model.rope.n_rot == 64 and model.rope_local.n_rot == 32
    # proportional rotary: the factors leave the upper half of a global head unrotated
    assert float(model.rope.inv_freq[-1]) < 1e-20 < float(model.rope.inv_freq[15])
    assert [L.wo.shape[1] for L in model.layers] == [128, 256] * 3
    assert [L.down.shape[1] for L in model.layers] == [128] * 3 + [256] * 3


def test_shared_layers_alias_their_source(model):
    cache = model.init_cache(64)
    kinds = [type(m) for m in cache.memories]
    assert kinds[4] is AliasKV and kinds[5] is AliasKV and kinds[0] is WindowKV
    assert cache.memories[4].target is cache.memories[2] and cache.memories[5].target is cache.memories[3]
    assert model.kv_bytes(64) == cache.nbytes()


def test_cached_equals_cacheless_past_the_window(model):
    """Prefill in pieces and decode token by token across the 16-token window."""
    want = model.forward_step_all_logits(model.init_cache(64), IDS, 0)
    cache = model.init_cache(64)
    got = [model.forward_step_all_logits(cache, IDS[:10], 0)]
    for i, t in enumerate(IDS[10:], 10):
        got.append(model.forward_step_all_logits(cache, [t], i))
    assert _cos(torch.cat(got).numpy(), want.numpy()).min() > 0.9999


def test_batch_decode_equals_single(model):
    prompts = [IDS[:18], IDS[3:9]]
    caches = [model.init_cache(64) for _ in prompts]
    for c, p in zip(caches, prompts):
        model.forward_step(c, p, 0)
    batch = model.forward_step_batch(caches, [7, 9]).numpy()
    single = [model.forward_last_logits(p + [t]).numpy() for p, t in zip(prompts, [7, 9])]
    assert _cos(batch, np.stack(single)).min() > 0.9999


def test_softcap_bounds_logits(model):
    logits = model.forward_last_logits(IDS)
    assert logits.abs().max() < 30.0


class _ZeroRows:
    def rows(self, ids):
        return torch.zeros(len(ids), 32 * 6)


def test_per_layer_embeddings_matter(model, monkeypatch):
    """Zeroing the per-layer token table changes the logits (the PLE path is not skipped)."""
    a = model.forward_last_logits(IDS)
    monkeypatch.setattr(model, "ple_embd", _ZeroRows())
    b = model.forward_last_logits(IDS)
    assert _cos(a.numpy(), b.numpy()) < 0.999


def test_k_as_v_without_attn_v(tmp_path):
    m = load_model(write_gemma4(tmp_path / "kv.gguf", v_proj=False, layers=3))
    assert all(L.wv is None for L in m.layers)
    assert torch.isfinite(m.forward_last_logits(IDS)).all()


def test_bad_shared_geometry_is_typed(tmp_path):
    # the last KV layer local: a shared global layer would read a local layer's rows
    p = write_gemma4(tmp_path / "bad.gguf", layers=4, shared=1, pattern=[False, True, True, False])
    with pytest.raises(GGUFError, match="shared-KV layer 3"):
        load_model(p)


MOE = dict(GEOMETRY, experts=8, experts_used=2, moe_ffn=64)


def test_moe_layers_route_beside_the_shared_expert(tmp_path):
    """The 26B-A4B shape: every layer's dense FFN plus routed experts; the routed part
    counts, the fused gate_up stack gives the same logits as separate stacks on the native
    step (strided views of it) and on the torch blocks."""
    m = load_model(write_gemma4(tmp_path / "moe.gguf", **MOE))
    fused = load_model(write_gemma4(tmp_path / "fused.gguf", **MOE, fused_experts=True))
    assert m.config.routing.k == 2 and (m.native_plan is None) == (fused.native_plan is None) == (not K.available())
    assert m.layers[0].experts.n_expert == 8 and m.layers[0].expert_scale.shape == (8,)
    assert torch.equal(fused.forward_last_logits(IDS), m.forward_last_logits(IDS))
    m.use_native_step = fused.use_native_step = False
    a = m.forward_last_logits(IDS)
    assert torch.equal(fused.forward_last_logits(IDS), a)
    for L in m.layers:
        L.expert_scale = torch.zeros(8)          # the routed experts' outputs weighted 0
    assert _cos(m.forward_last_logits(IDS).numpy(), a.numpy()) < 0.999


def test_fused_expert_stack_refuses_streaming_with_a_typed_error(tmp_path):
    from fucina.errors import InvalidArgument
    from fucina.models.expert_store import stream_experts
    fused = load_model(write_gemma4(tmp_path / "fused.gguf", **MOE, fused_experts=True))
    with pytest.raises(InvalidArgument, match="fused tensor"):
        stream_experts(fused, "50%")
    assert getattr(fused, "expert_store", None) is None


def test_moe_without_expert_count_is_typed(tmp_path):
    p = write_gemma4(tmp_path / "moe.gguf", layers=3, extra_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, 64))})
    with pytest.raises(GGUFError, match="expert_count"):
        load_model(p)


# the dense geometry (no per-layer inputs, no shared KV, one FFN width)
DENSE = dict(GEOMETRY, ffn=128, shared=0, ple=0)


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
@pytest.mark.parametrize("geometry,v_proj", [("e-model", True), ("e-model", False), ("dense", False)])
def test_native_step_equals_torch_blocks(tmp_path, geometry, v_proj):
    """The native step (prefill, then decode past the window) against the torch blocks."""
    kw = GEOMETRY if geometry == "e-model" else DENSE
    model = load_model(write_gemma4(tmp_path / "g.gguf", **kw, v_proj=v_proj))
    assert model.native_plan is not None
    ids = IDS + IDS[:16]                          # 40 positions: past the 16-token window
    native = teacher_forced_logits(model, ids).numpy()
    cache = model.init_cache(64)
    model.forward_step(cache, ids[:30], 0)
    steps = [model.forward_step(cache, [t], 30 + j).numpy() for j, t in enumerate(ids[30:])]
    model.use_native_step = False
    try:
        torch_path = teacher_forced_logits(model, ids).numpy()
    finally:
        model.use_native_step = True
    assert _cos(native, torch_path).min() > 0.999
    assert _cos(np.stack(steps), torch_path[30:]).min() > 0.999


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
def test_e_model_plan_reads_shared_rows(model):
    """Per-layer inputs, shared KV and per-layer FFN widths all run in the native step: the
    shared layers own no rows (their cache memories are aliases) and decode takes it."""
    plan = model.native_plan
    assert plan is not None and plan.x_width == 128 + 6 * 32
    assert plan.geometry[4:] == [(0, 0), (0, 0)] and plan.geometry[2] == (2, 32)
    cache = model.init_cache(64)
    assert model._native_cache(cache) is not None
    model.forward_step(cache, IDS[:5], 0)
    assert cache.len == 5


@pytest.fixture(scope="module")
def model_q8(tmp_path_factory):
    return load_model(write_gemma4(tmp_path_factory.mktemp("g4q") / "g4.gguf", **GEOMETRY, qtype=Q.Q8_0))


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
def test_e_model_prefill_split_any_way_equals_token_by_token(model_q8, isa):
    """The batch invariance the step claims, on the E geometry: a prompt past the window
    split any way gives the bits of one row at a time, and batch decode rows equal their
    stream's own step (check_batch_rows_equal_alone)."""
    from test_batch_invariance import check_batch_rows_equal_alone
    ids = IDS + IDS[:13]
    whole = model_q8.forward_step_all_logits(model_q8.init_cache(64), ids, 0)
    for chunks in ([1] * len(ids), [9, 1, 1, 6, 2, 18]):
        cache, got, pos = model_q8.init_cache(64), [], 0
        for n in chunks:
            got.append(model_q8.forward_step_all_logits(cache, ids[pos:pos + n], pos))
            pos += n
        assert torch.equal(torch.cat(got), whole), f"{chunks} on {isa}"
    check_batch_rows_equal_alone(model_q8, IDS, isa)


# -- llama.cpp ------------------------------------------------------------------------------

def _oracle_model(tmp_path, qtype=Q.F32, **kw):
    if not (VOCAB_DIR / "vocab-qwen3.gguf").exists():
        pytest.skip("shared Qwen3 vocab not present")
    return write_gemma4(tmp_path / f"g4-{qtype.name}.gguf", **{**GEOMETRY, **kw}, qtype=qtype,
                        vocab=str(VOCAB_DIR / "vocab-qwen3.gguf"))


def _tokens(path, tmp_path, text):
    f = tmp_path / "p.txt"
    f.write_text(text)
    out = oracle_mod.run("llama-tokenize", "-m", path, "-f", str(f), "--ids", "--log-disable")
    return [int(x) for x in out.strip().strip("[]").split(",")]


def _llama_logits(path, ids, tmp_path):
    out = tmp_path / "ref.f32"
    oracle_mod.run("llama-logits", str(path), ",".join(map(str, ids)), str(out))
    return np.fromfile(out, dtype="<f4").reshape(len(ids), -1)


def _exact(path, ids):
    """The exact model: the same weights in f32 arithmetic (our reference path)."""
    K.set_enabled(False)
    try:
        return teacher_forced_logits(load_model(path), ids).numpy()
    finally:
        K.set_enabled(True)


@pytest.mark.slow
@pytest.mark.oracle
def test_live_f32_matches_llama_cpp_past_the_window(oracle, tmp_path):
    """F32 weights: every position agrees with llama.cpp (its GELU rounds inputs to f16,
    the only arithmetic difference), over a prompt 4x the 16-token window."""
    from parity_cases import TEXT
    path = _oracle_model(tmp_path)
    ids = _tokens(path, tmp_path, TEXT)
    assert len(ids) > 3 * GEOMETRY["window"]
    ref = _llama_logits(path, ids, tmp_path)
    ours = teacher_forced_logits(load_model(path), ids).numpy()
    cos = _cos(ref, ours)
    assert cos.min() >= 0.9999, cos.min()   # measured 0.99999 when written
    assert (ref.argmax(1) == ours.argmax(1)).mean() >= 0.98


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("qtype", [Q.Q8_0])
def test_live_quantized_closer_to_exact_than_llama_cpp(oracle, tmp_path, qtype):
    from parity_cases import TEXT
    path = _oracle_model(tmp_path, qtype)
    ids = _tokens(path, tmp_path, TEXT)
    ref = _llama_logits(path, ids, tmp_path)
    ours = teacher_forced_logits(load_model(path), ids).numpy()
    exact = _exact(path, ids)
    ours_err, llama_err = 1 - _cos(ours, exact).mean(), 1 - _cos(ref, exact).mean()
    assert ours_err <= 1.05 * llama_err, (ours_err, llama_err)


@pytest.mark.slow
@pytest.mark.oracle
def test_live_greedy_equals_llama_cpp(oracle, tmp_path):
    """16 greedy tokens past the window: llama.cpp's argmax at each step (one llama-logits
    call per step) equals ours."""
    from parity_cases import TEXT
    path = _oracle_model(tmp_path)
    ids = _tokens(path, tmp_path, TEXT)
    seq, theirs = list(ids), []
    for _ in range(16):
        out = tmp_path / "l.f32"
        oracle_mod.run("llama-logits", path, ",".join(map(str, seq)), str(out), "--last", "1")
        t = int(np.argmax(np.fromfile(out, dtype="<f4")))
        theirs.append(t)
        seq.append(t)
    assert greedy(load_model(path), ids, 16) == theirs


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("fused", [False, True], ids=["gate-up", "fused-gate-up"])
def test_live_moe_matches_llama_cpp(oracle, tmp_path, fused):
    """The MoE variant (shared expert, scaled router input, per-expert output scales, 8
    experts of which 2 per token; separate or fused gate/up stacks) against llama.cpp."""
    from parity_cases import TEXT
    path = _oracle_model(tmp_path, experts=8, experts_used=2, moe_ffn=64, fused_experts=fused)
    ids = _tokens(path, tmp_path, TEXT)
    ref = _llama_logits(path, ids, tmp_path)
    ours = teacher_forced_logits(load_model(path), ids).numpy()
    cos = _cos(ref, ours)
    # measured when written: median 0.999998, min 0.99986 (llama.cpp's GELU rounds to f16)
    assert cos.min() >= 0.9995 and np.median(cos) >= 0.99999, (cos.min(), np.median(cos))
    assert (ref.argmax(1) == ours.argmax(1)).mean() >= 0.95
