"""The native layer step (kernels.DecoderPlan) against the torch blocks it replaces.

On F32 weights both paths do the same float arithmetic (the matmuls run f32 tiles), so
logits and cache rows agree to rounding; on quantized weights the int8 activation
rounding makes any two schedules differ slightly, as in test_models."""
import gguf
import pytest
import torch

import fucina.kernels as K
from fucina.errors import ContextFull
from fucina.kernels import KernelError
from fucina.models import load_model
from synth import write_model

Q = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

CASES = {
    # name: (arch, kwargs)
    "llama-d16": ("llama", dict(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2)),
    "llama-d64-mha": ("llama", dict(hidden=128, heads=2, kv_heads=2, head_dim=64, layers=2)),
    "qwen3-d128-gqa": ("qwen3", dict(hidden=64, heads=4, kv_heads=1, head_dim=128, layers=2)),
    "gemma3-d32-window": ("gemma3", dict(hidden=64, heads=4, kv_heads=2, head_dim=32, layers=6,
                                         sliding_window=5)),
    "gemma3-d256": ("gemma3", dict(hidden=64, heads=2, kv_heads=1, head_dim=256, layers=3,
                                   sliding_window=7)),
    # 8 query heads per kv head and a head size with no specialised kernel (48)
    "qwen3-d48-g8": ("qwen3", dict(hidden=64, heads=8, kv_heads=1, head_dim=48, layers=2)),
    "gemma3-d48-window3": ("gemma3", dict(hidden=96, heads=4, kv_heads=4, head_dim=48, layers=3,
                                          sliding_window=3)),
}

IDS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 33, 200, 11, 12, 13, 14, 150, 151, 152, 9,
       77, 31, 6, 190, 45, 2, 88, 123, 61, 19, 240, 4, 56, 71, 10, 133, 29, 97, 180, 15]


def _model(tmp_path_factory, name, qtype):
    arch, kw = CASES[name]
    path = write_model(tmp_path_factory.mktemp(name) / "m.gguf", arch, qtype=qtype, **kw)
    return load_model(path)


def _run(model, native: bool, chunks):
    model.use_native_step = native
    try:
        cache = model.init_cache(64)
        out, pos = [], 0
        for n in chunks:
            out.append(model.forward_step_all_logits(cache, IDS[pos:pos + n], pos))
            pos += n
        return torch.cat(out), cache
    finally:
        model.use_native_step = True


def _held(cache, i):
    """Layer i's K and V rows still held (a window memory keeps only recent positions)."""
    return cache.span(i, cache.memories[i].base, cache.len)


def _same_rows(c1, c0):
    for i in range(c0.n_layers):          # the same K/V rows, to f16 rounding
        for a, b in zip(_held(c1, i), _held(c0, i)):
            assert torch.allclose(a.float(), b.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", sorted(CASES))
def test_f32_native_equals_torch(tmp_path_factory, name, isa):
    model = _model(tmp_path_factory, name, Q.F32)
    assert model.native_plan is not None
    chunks = [9, 1, 1, 6, 1, 2]          # prefill, decode steps, a second prefill past the window
    got, c1 = _run(model, True, chunks)
    want, c0 = _run(model, False, chunks)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    _same_rows(c1, c0)


@pytest.mark.parametrize("name", ["llama-d16", "qwen3-d128-gqa", "gemma3-d32-window"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])
def test_quantized_native_close_to_torch(tmp_path_factory, name, qtype):
    arch, kw = CASES[name]
    if qtype == Q.Q4_K:  # K-quants need rows of 256 (the attention output's too)
        kw = dict(kw, hidden=256, ffn=256, head_dim=64 if arch != "qwen3" else 128)
    path = write_model(tmp_path_factory.mktemp(name) / "q.gguf", arch, qtype=qtype, **kw)
    model = load_model(path)
    got, _ = _run(model, True, [12, 1, 1])
    want, _ = _run(model, False, [12, 1, 1])
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.999, cos.min()


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_mixed_types_take_separate_weights(tmp_path_factory, qtype):
    """Q/K/V of different types cannot be fused: the step writes each into its slice of a
    wider output (every matmul route honours the output row stride: m = 1, 2..7, >= 8)."""
    model = _model(tmp_path_factory, "qwen3-d128-gqa", qtype)
    for L in model.layers:   # unfuse, as a mixed-type file would load
        L.wqkv, L.w_gate_up = None, None
    model.native_plan = model.build_plan()
    got, _ = _run(model, True, [12, 3, 1])
    want, _ = _run(model, False, [12, 3, 1])
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > (0.99999 if qtype == Q.F32 else 0.999), cos.min()


def test_q8_cache_keeps_torch_path(tmp_path_factory):
    model = _model(tmp_path_factory, "llama-d64-mha", Q.F32)
    cache = model.init_cache(16, cache_type="q8_0")
    assert model._native_cache(cache) is None
    model.forward_step(cache, IDS[:4], 0)
    assert cache.len == 4


def test_step_errors_are_typed(tmp_path_factory):
    model = _model(tmp_path_factory, "llama-d16", Q.F32)
    cache = model.init_cache(8)
    with pytest.raises(ContextFull):
        model.forward_step(cache, IDS[:9], 0)
    assert cache.len == 0
    plan, ptrs = model.native_plan, model._native_cache(cache)
    tables = [model.rope.table(16)]
    x = torch.zeros(2, model.config.n_embd)
    with pytest.raises(KernelError):          # past the capacity
        plan.run(x, ptrs, 7, tables)
    with pytest.raises(KernelError):          # wrong width
        plan.run(torch.zeros(2, 3), ptrs, 0, tables)
    with pytest.raises(KernelError):          # RoPE table too short for the positions
        plan.run(x, ptrs, 0, [t[:1] for t in tables])
    with pytest.raises(KernelError):          # not a pointer table of this plan
        plan.run(x, ptrs.ptrs, 0, tables)
    other = K.KVPointers(ptrs.ptrs, ptrs.capacity, [(3, 16)] * model.config.n_layer)
    with pytest.raises(KernelError):          # cache of another geometry
        plan.run(x, other, 0, tables)
    bad = K.KVPointers(ptrs.ptrs.clone(), ptrs.capacity, ptrs.geometry)
    bad.ptrs[2] = 1                           # a base past the rows' positions: C refuses
    with pytest.raises(KernelError):
        plan.run(x, bad, 0, tables)


def test_plan_rejects_inconsistent_weights(tmp_path_factory):
    model = _model(tmp_path_factory, "llama-d16", Q.F32)
    c = model.config
    layer = model.plan_layer(0, model.layers[0])
    for bad in (dict(layer, wo=model.layers[0].down),          # [64, 128] where [64, 64] belongs
                dict(layer, attn_norm=torch.ones(c.n_embd - 1)),  # a norm of the wrong length
                dict(layer, q_norm=torch.ones(c.n_embd)),
                dict(layer, qkv_bias=torch.ones(3)),             # a bias of the wrong length
                dict(layer, wq=model.layers[0].wo),              # fused and separate QKV at once
                dict(layer, window=-1)):
        with pytest.raises(KernelError):
            K.DecoderPlan.build(n_embd=c.n_embd, n_ff=c.n_ff, n_rot=c.n_rot, neox=False, act="silu",
                                eps=1e-6, scale=0.25, layers=[bad])


@pytest.mark.parametrize("name", ["llama-d16", "gemma3-d32-window"])
def test_batch_native_equals_torch(tmp_path_factory, name):
    """Streams at different positions (past the window too) advanced in one native pass."""
    model = _model(tmp_path_factory, name, Q.F32)

    def streams(native):
        model.use_native_step = native
        try:
            caches = [model.init_cache(32) for _ in range(3)]
            for c, n in zip(caches, (3, 9, 1)):
                model.forward_step(c, IDS[:n], 0)
            out = [model.forward_step_batch(caches, [7, 8, 9]), model.forward_step_batch(caches, [1, 2, 3])]
            return torch.cat(out), caches
        finally:
            model.use_native_step = True

    got, c1 = streams(True)
    want, c0 = streams(False)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    assert [c.len for c in c1] == [5, 11, 3]
    for a, b in zip(c1, c0):
        _same_rows(a, b)


def test_batch_errors_are_typed(tmp_path_factory):
    model = _model(tmp_path_factory, "llama-d16", Q.F32)
    cache = model.init_cache(4)
    ptrs = model._native_cache(cache)
    x = torch.zeros(1, model.config.n_embd)
    with pytest.raises(KernelError):     # position past the cache
        model.native_plan.run_batch(x, [ptrs], [4], [model.rope.table(8)])
    with pytest.raises(KernelError):     # rows and caches disagree
        model.native_plan.run_batch(torch.zeros(2, model.config.n_embd), [ptrs], [0], [model.rope.table(8)])


def test_long_prompts_run_in_chunks(tmp_path_factory):
    """A prompt longer than native_chunk runs as several calls: same logits as one."""
    model = _model(tmp_path_factory, "gemma3-d32-window", Q.F32)
    whole, _ = _run(model, True, [20])
    model.native_chunk = 6
    try:
        chunked, _ = _run(model, True, [20])
    finally:
        del model.native_chunk
    assert (chunked - whole).abs().max() < 1e-4 * whole.abs().max()


def test_family_with_its_own_block_gets_no_plan_by_accident(tmp_path_factory):
    """A subclass that changes the block math without describing it keeps the torch path."""
    from fucina.models import llama
    from fucina.gguf import GGUFFile

    class Odd(llama.Model):
        def block(self, i, x, cache, pos0):
            return super().block(i, x, cache, pos0) * 0.5

    arch, kw = CASES["llama-d16"]
    path = write_model(tmp_path_factory.mktemp("odd") / "m.gguf", arch, **kw)
    assert Odd(GGUFFile(path)).native_plan is None
    assert llama.Model(GGUFFile(path)).native_plan is not None


def test_window_memory_shifts_under_the_native_step(tmp_path_factory):
    """Gemma-3 with a window memory of window + 17 rows (the rows kept start on a 16-row key
    block): long prompts run in steps of 3 rows, the rows move to the front every few
    tokens, and native equals torch throughout."""
    model = _model(tmp_path_factory, "gemma3-d32-window", Q.F32)
    model.window_slack = 17
    chunks = [11, 1, 1, 4, 1, 2, 9, 3, 7, 1]
    try:
        got, c1 = _run(model, True, chunks)
        want, c0 = _run(model, False, chunks)
    finally:
        del model.window_slack
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    local = [i for i, s in enumerate(model.config.layers) if s.window]
    assert local and all(c1.memories[i].rows == 5 + 17 and c1.memories[i].base > 0
                         and c1.memories[i].base % 16 == 0 for i in local)
    _same_rows(c1, c0)
    full, _ = _run(model, True, chunks)      # a full-size memory: the same logits
    assert (full - got).abs().max() < 1e-4 * got.abs().max()


def test_plan_schema_is_named():
    plan_fields, layer_fields = K.plan_schema()
    names = [n for n, _ in layer_fields]
    assert {"qkv_bias", "wqkv", "gate_up", "window", "n_kv", "head_dim", "mixer", "ffn"} <= set(names)
    assert len(set(names)) == len(names) and {k for _, k in layer_fields} <= {"I", "F", "V", "W"}
