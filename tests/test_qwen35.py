"""Qwen3.5 hybrid (Gated DeltaNet + gated attention): the two scans agree, the recurrent
state rewinds within its snapshots (inside a multi-row step too), a three-turn chat
prefills only each turn's new tokens, speculation is lossless; parity with llama.cpp
is in test_parity (the qwen35-synth case)."""
import gguf
import pytest
import torch

import fucina.kernels as K
from fucina.models import delta_net, load_model
from fucina.models.cache import RecurrentState
from synth import write_model

Q = gguf.GGMLQuantizationType


def _inputs(m, heads=3, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = delta_net.l2_norm(torch.randn(m, heads, d, generator=g), 1e-6)
    k = delta_net.l2_norm(torch.randn(m, heads, d, generator=g), 1e-6)
    v = torch.randn(m, heads, d, generator=g)
    decay = -torch.rand(m, heads, generator=g) * 0.7        # log-decays, some strong
    beta = torch.rand(m, heads, generator=g)
    s0 = torch.randn(heads, d, d, generator=g)
    return [t.to(dtype) for t in (q, k, v, decay, beta, s0)]


@pytest.mark.parametrize("m", [1, 63, 64, 150])
def test_chunked_equals_sequential_and_f64(m):
    args = _inputs(m)
    o_seq, s_seq, _ = delta_net.sequential(*args)
    o_ch, s_ch = delta_net.chunked(*args)
    torch.testing.assert_close(o_ch, o_seq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_ch, s_seq, rtol=1e-5, atol=1e-5)
    o64, s64, _ = delta_net.sequential(*[a.double() for a in args])
    err_seq = (o_seq.double() - o64).abs().max()
    err_ch = (o_ch.double() - o64).abs().max()
    # the chunked f32 result is as good an f32 answer as the token-by-token one
    assert err_ch <= 4 * err_seq + 1e-6, (err_ch, err_seq)
    assert (s_ch.double() - s64).abs().max() < 1e-5


def test_sequential_keeps_the_last_states():
    args = _inputs(10)
    _, final, kept = delta_net.sequential(*args, keep_states=3)
    assert len(kept) == 3 and torch.equal(kept[-1], final)
    _, s7, _ = delta_net.sequential(*[a[:8] for a in args[:5]], args[5])
    torch.testing.assert_close(kept[0], s7)


def test_causal_conv_window_carries_over():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 5, generator=g), torch.randn(5, 4, generator=g)
    whole, _ = delta_net.causal_conv(x, torch.zeros(3, 5), w)
    a, full = delta_net.causal_conv(x[:4], torch.zeros(3, 5), w)
    b, _ = delta_net.causal_conv(x[4:], full[-3:], w)
    torch.testing.assert_close(torch.cat([a, b]), whole)
    # tap 3 is the current input
    torch.testing.assert_close(whole[0], x[0] * w[:, 3])


@pytest.fixture(scope="module")
def ref_model(tmp_path_factory):
    """F32 weights on the reference path: the schedules must agree to float precision."""
    path = write_model(tmp_path_factory.mktemp("q35") / "q35.gguf", "qwen35", layers=4, hidden=64,
                       heads=4, kv_heads=2, head_dim=32, ffn=128, seed=3)
    K.set_enabled(False)     # the weights pick their route at load: the model stays on it
    try:
        return load_model(path)
    finally:
        K.set_enabled(True)


IDS = [(7 * i + 3) % 250 + 4 for i in range(72)]


def test_layer_pattern_and_rope_sections(ref_model):
    c = ref_model.config
    assert c.recurrent == [True, False, True, False]
    assert [s.mixer for s in c.layers] == ["delta_net", "attention"] * 2
    # sections (3, 1, 1, 1) over 8 pairs: sectors 4 and 5 take the fourth (still) position
    assert (ref_model.rope.inv_freq == 0).tolist() == [False] * 4 + [True] * 2 + [False] * 2
    kinds = [m.kind for m in ref_model.init_cache(16).memories]
    assert kinds == ["recur", "kv"] * 2


def test_chunked_prefill_equals_decode(ref_model):
    """One 72-row prefill (54 chunked rows + 18 sequential) against steps of 30 rows (all
    sequential), six single rows, and 36 rows (chunked again) on the same positions."""
    m = ref_model
    full = m.forward_step_all_logits(m.init_cache(128), IDS, 0)
    cache = m.init_cache(128)
    parts = [m.forward_step_all_logits(cache, IDS[:30], 0)]
    parts += [m.forward_step_all_logits(cache, [t], 30 + i) for i, t in enumerate(IDS[30:36])]
    parts.append(m.forward_step_all_logits(cache, IDS[36:], 36))
    # float noise only (logits ~20; attention over m rows and over one row are different kernels)
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-3, atol=1e-3)


def test_state_rewinds_inside_a_step_and_falls_back_past_its_horizon(ref_model):
    m = ref_model
    cache = m.init_cache(128)
    m.forward_step(cache, IDS[:40], 0)
    h = m.state_horizon
    assert cache.can_truncate(40 - h + 1) and not cache.can_truncate(40 - h)
    assert cache.truncate_point(30) == 30 and cache.truncate_point(10) == 0
    assert cache.rewind_reach() == h - 1
    cache.truncate(30)
    again = m.forward_step_all_logits(cache, IDS[30:44], 30)
    fresh = m.forward_step_all_logits(m.init_cache(128), IDS[:44], 0)[30:]
    torch.testing.assert_close(again, fresh, rtol=1e-3, atol=1e-3)
    # a prefix that is no snapshot: the longest snapshot below it
    assert cache.truncate_point(29) == 29 and cache.truncate_point(27) == 27
    cache.truncate(27)
    assert cache.len == 27
    with pytest.raises(Exception):
        cache.truncate(3)


def _llm(tmp_path, **kw):
    from fucina.text.api import load
    path = write_model(tmp_path / "chat.gguf", "qwen35", layers=2, hidden=64, heads=4, kv_heads=2,
                       head_dim=32, ffn=128, seed=5)
    return load(path, n_ctx=512, **kw)


def test_three_turn_chat_prefills_only_new_tokens(tmp_path):
    check_three_turn_prefill(_llm(tmp_path))


def check_three_turn_prefill(llm):
    """Three chat turns: each forwards only the tokens past the reused prefix (a recurrent
    state rewinds within its horizon: a retokenized tail is re-run, nothing else)."""
    conv = llm.chat(max_tokens=6)
    model = conv.model
    rows = []
    real = model._hidden

    def counting(cache, tokens, pos0):
        rows.append(len(tokens))
        return real(cache, tokens, pos0)
    model._hidden = counting
    held = []
    for turn in ("Hello there.", "Tell me more.", "Thanks!"):
        before = len(rows)
        conv.send(turn)
        reused = conv.last.reused_tokens
        assert conv.cache.len == len(conv.tokens)
        if held:   # the previous turns' positions are reused (a retokenized tail within the horizon)
            assert held[-1] - model.state_horizon < reused <= held[-1]
        # every position past the reused prefix was forwarded exactly once
        assert sum(rows[before:]) == conv.cache.len - reused, (rows[before:], conv.cache.len, reused)
        held.append(len(conv.tokens))
    assert held[0] < held[1] < held[2]


def test_speculation_is_lossless(tmp_path):
    """Seeded sampling (greedy on random weights only repeats one token: every draft would
    be accepted): drafts get rejected and the state rewinds to a snapshot inside the
    verify, and the stream is the plain one token for token."""
    llm = _llm(tmp_path)
    doc = "the cat sat on the mat"
    opts = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=5)

    def turns(spec):
        conv = llm.chat(max_tokens=24, speculative=spec, references=[doc] if spec else (), **opts)
        out = [conv.send("Repeat: " + doc), conv.send("Again")]
        return out, list(conv.tokens), conv

    want, want_ids, _ = turns(False)
    got, got_ids, conv = turns(True)
    assert got == want and got_ids == want_ids
    assert conv.spec_stats.accepted > 0 and conv.spec_stats.rejected_steps > 0


def test_q8_0_weights_and_cache(tmp_path):
    path = write_model(tmp_path / "q.gguf", "qwen35", layers=2, hidden=64, heads=4, kv_heads=2,
                       head_dim=32, ffn=128, qtype=Q.Q8_0, seed=9)
    m = load_model(path)
    assert m.layers[0].attn_qkv.qtype == Q.Q8_0 and m.layers[0].conv.dtype is torch.float32
    a = m.forward_step(m.init_cache(32, cache_type="q8_0"), IDS[:20], 0)
    b = m.forward_last_logits(IDS[:20])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999


def test_native_decode_step_equals_torch(tmp_path, monkeypatch):
    if not K.delta_step_ok():
        pytest.skip("native kernels not built")
    import fucina.models.qwen35 as q35
    m = load_model(write_model(tmp_path / "n.gguf", "qwen35", layers=2, hidden=64, heads=4, kv_heads=2,
                               head_dim=32, ffn=128, seed=4))
    m.use_native_step = False   # the torch blocks with the one native DeltaNet call per layer

    def run():
        c = m.init_cache(64)
        m.forward_step(c, IDS[:10], 0)
        return torch.stack([m.forward_step(c, [t], 10 + i) for i, t in enumerate(IDS[10:18])]), c

    native, a = run()
    monkeypatch.setattr(q35.kernels, "delta_step_ok", lambda: False)
    ref, b = run()
    torch.testing.assert_close(native, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(a.memories[0].state, b.memories[0].state, rtol=1e-5, atol=1e-5)
    # every prefill row, then every 4th decoded length (RecurrentState.decode_stride)
    assert sorted(a.memories[0].snaps) == sorted(b.memories[0].snaps) == list(range(1, 11)) + [12, 16]
    with pytest.raises(K.KernelError):
        K.delta_step(*(torch.zeros(3) for _ in range(10)), 1, 1, 1e-6)


# ---- the native layer plan: DeltaNet and gated attention layers in one step call ----------

def _plan_model(tmp_path_factory, qtype):
    path = write_model(tmp_path_factory.mktemp("q35p") / "p.gguf", "qwen35", layers=2, hidden=64, heads=4,
                       kv_heads=2, head_dim=32, ffn=128, qtype=qtype, seed=11)
    m = load_model(path)
    if m.native_plan is None:
        pytest.skip("native kernels not built")
    return m


@pytest.fixture(scope="module")
def plan_model(tmp_path_factory):
    return _plan_model(tmp_path_factory, Q.Q8_0)


def _snapshots(cache, layer=0):
    mem = cache.memories[layer]
    return {n: mem._views(slot) for n, slot in mem.snaps.items()}


def test_native_plan_equals_torch_blocks(tmp_path_factory, monkeypatch):
    """A 40-row prefill and 8 decode steps through the plan against the torch blocks
    (FUCINA_NATIVE_STEP=0): logits, the final states and every snapshot agree closely.
    F32 weights: on a quantized file float noise can flip an activation's int8 rounding."""
    m = _plan_model(tmp_path_factory, Q.F32)

    def run():
        c = m.init_cache(128)
        a = m.forward_step_all_logits(c, IDS[:40], 0)
        d = torch.stack([m.forward_step(c, [t], 40 + i) for i, t in enumerate(IDS[40:48])])
        return torch.cat([a, d]), c

    native, a = run()
    monkeypatch.setattr(m, "use_native_step", False)
    ref, b = run()
    torch.testing.assert_close(native, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(a.memories[0].state, b.memories[0].state, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.memories[0].conv, b.memories[0].conv)
    sa, sb = _snapshots(a), _snapshots(b)
    assert sorted(sa) == sorted(sb) == list(range(31, 41)) + [44, 48]
    for n in sa:
        torch.testing.assert_close(sa[n][0], sb[n][0])
        torch.testing.assert_close(sa[n][1], sb[n][1], rtol=1e-4, atol=1e-4)


def test_native_plan_rows_equal_single_rows(plan_model, isa):
    """The plan claims batch invariance: a prompt split any way (the DeltaNet rows of one
    call, or one row a call) gives the same logits, states and snapshots, bit for bit."""
    from test_batch_invariance import SPLITS, check_split_equals_whole
    check_split_equals_whole(plan_model, IDS[:37], SPLITS, isa, capacity=64, also=same_snapshots)


def same_snapshots(c0, c1):
    """The recurrent snapshots both caches keep are equal (single-row steps keep every 4th
    length only, so the two sets differ)."""
    s0, s1 = _snapshots(c0), _snapshots(c1)
    both = set(s0) & set(s1)
    assert len(both) >= 5
    assert all(torch.equal(s0[n][0], s1[n][0]) and torch.equal(s0[n][1], s1[n][1]) for n in both)


def test_native_batch_rows_equal_streams_alone(plan_model, isa):
    from test_batch_invariance import _same_cache, check_batch_rows_equal_alone
    check_batch_rows_equal_alone(plan_model, IDS, isa, same_cache=_same_cache)


def test_native_plan_checks_delta_layers_and_snapshot_slots(plan_model):
    m = plan_model
    layers = [m.plan_layer(i, L) for i, L in enumerate(m.layers)]
    c = m.config
    with pytest.raises(K.KernelError):   # value heads not a multiple of the key heads
        K.DecoderPlan.build(n_embd=c.n_embd, n_ff=c.n_ff, n_rot=c.n_rot, neox=True, act="silu", eps=c.rms_eps,
                            scale=m.scale, layers=[dict(layers[0], ssm_hk=3)] + layers[1:])
    cache = m.init_cache(16)
    table = m._native_cache(cache)
    assert table is not None
    other = m.init_cache(16)             # a state of another shape: not served natively
    w, s = other.memories[0].conv.shape, other.memories[0].state.shape
    other.memories[0] = RecurrentState(w[0], w[1], s[0], s[1], s[2] // 2)
    assert m._native_cache(other) is None
    mem = cache.memories[0]
    mem.reserve(0, 2)                    # two snapshot slots for a step that runs one row
    x = m.embed(torch.tensor([5])).float().contiguous()
    with pytest.raises(K.KernelError):
        m.native_plan.run(x, table, 0, [t.table(1) for t in m.rope_tables()])


def test_decode_snapshots_are_strided_and_a_rewind_between_reruns(plan_model):
    """Decode keeps every 4th length; a rewind to a length between lands on the one below
    (truncate_point), and re-running from there gives the logits of a fresh prefill."""
    m = plan_model
    cache = m.init_cache(64)
    m.forward_step(cache, IDS[:20], 0)
    for i in range(8):
        m.forward_step(cache, [IDS[20 + i]], 20 + i)
    points = cache.memories[0].rewind_points()
    assert 24 in points and 28 in points and 25 not in points and 27 not in points
    assert cache.truncate_point(27) == 24
    cache.truncate(24)
    again = m.forward_step_all_logits(cache, IDS[24:30], 24)
    fresh = m.forward_step_all_logits(m.init_cache(64), IDS[:30], 0)[24:]
    torch.testing.assert_close(again, fresh, rtol=1e-3, atol=1e-3)
    # a multi-row step after strided decode can still rewind to where it started
    m.forward_step(cache, [IDS[30]], 30)          # length 31: no snapshot
    assert 31 not in cache.memories[0].rewind_points()
    m.forward_step(cache, IDS[31:34], 31)
    assert cache.can_truncate(31)
