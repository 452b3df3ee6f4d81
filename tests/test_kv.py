"""q8_0 KV cache and kv_persist (the crash-safe append-only sidecar)."""
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from fucina.errors import ContextFull, KVCacheError
from fucina.models.cache import KVCache
from fucina.models.cache_q8 import Q8Cache, dequantize_q8_0, make_cache, quantize_q8_0
from fucina.models.kv_persist import MAGIC, KVPersist
from test_chat_support import tiny_llama


def rows(m, heads=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, heads, d, generator=g), torch.randn(m, heads, d, generator=g)


def test_q8_0_matches_gguf_reference_quantizer():
    import gguf
    x = torch.randn(4, 64) * 3
    x[1] = 0.0
    q, s = quantize_q8_0(x)
    ref = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    ref_d = ref[:, :2].copy().view(np.float16).reshape(4, 2)
    ref_q = ref[:, 2:].copy().view(np.int8).reshape(4, 64)
    assert (s.numpy() == ref_d).all()
    assert (q.numpy() == ref_q).all()
    back = gguf.quants.dequantize(ref.reshape(4, 68), gguf.GGMLQuantizationType.Q8_0)
    assert np.allclose(dequantize_q8_0(q, s).numpy(), back)


def test_q8_cache_append_read_truncate():
    c = Q8Cache(2, 2, 32, 8)
    k, v = rows(3)
    for layer in range(2):
        c.append(layer, k, v)
    c.advance(3)
    assert c.len == 3 and c.keys(0, 3).shape == (3, 2, 32) and c.keys(0, 3).dtype == torch.float32
    assert torch.allclose(c.keys(1, 3), k, atol=k.abs().max() / 127)
    assert torch.allclose(c.values(1, 3), v, atol=v.abs().max() / 127)
    c.truncate(1)
    assert c.len == 1
    c.truncate(5)          # at or above len: no-op
    assert c.len == 1
    with pytest.raises(ContextFull):
        c.advance(8)
    with pytest.raises(KVCacheError):
        c.append(0, torch.zeros(1, 3, 32), torch.zeros(1, 3, 32))
    c.reset()
    assert c.len == 0


def test_q8_cache_needs_block_aligned_head_dim():
    with pytest.raises(KVCacheError, match="head_dim"):
        Q8Cache(1, 2, 48, 8)


def test_q8_cache_halves_memory():
    f16, q8 = KVCache(2, 2, 64, 128), Q8Cache(2, 2, 64, 128)
    assert q8.nbytes() / f16.nbytes() == pytest.approx(34 / 64)


def test_q8_copy_rows():
    a, b = Q8Cache(1, 2, 32, 8), Q8Cache(1, 2, 32, 8)
    k, v = rows(4)
    a.append(0, k, v)
    a.advance(4)
    b.copy_rows(a, 0, 3)
    assert b.len == 3 and torch.equal(b.keys(0, 3), a.keys(0, 3))
    with pytest.raises(KVCacheError):
        b.copy_rows(a, 0, 2)                 # len != start
    with pytest.raises(KVCacheError):
        Q8Cache(1, 1, 32, 8).copy_rows(a, 0, 2)


def test_make_cache_types(tmp_path):
    m = tiny_llama(str(tmp_path), n_embd=64, n_head=2)
    assert isinstance(make_cache(m, 16, "q8_0"), Q8Cache)
    assert isinstance(make_cache(m, 16, "f16"), KVCache)
    with pytest.raises(KVCacheError):
        make_cache(m, 16, "q4_0")


def test_q8_cache_decode_tracks_f16(tmp_path):
    m = tiny_llama(str(tmp_path), n_embd=64, n_head=2)
    prompt = [5, 17, 99, 3, 250, 42]
    outs = {}
    for kind in ("f16", "q8_0"):
        c = make_cache(m, 128, kind)
        logits = m.forward_step(c, prompt, 0)
        toks, ls = [], []
        for _ in range(40):
            t = int(torch.argmax(logits))
            toks.append(t)
            ls.append(logits)
            logits = m.forward_step(c, [t], c.len)
        outs[kind] = toks, torch.stack(ls)
    agree = sum(a == b for a, b in zip(outs["f16"][0], outs["q8_0"][0])) / 40
    assert agree >= 0.9
    # teacher-forced logits along the f16 path stay close
    c16, c8 = make_cache(m, 128, "f16"), make_cache(m, 128, "q8_0")
    seq = prompt + outs["f16"][0]
    a = m.forward_step_all_logits(c16, seq, 0)
    b = m.forward_step_all_logits(c8, seq, 0)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


# -- persistence ------------------------------------------------------------------

def filled(cache, n, seed=0):
    for layer in range(cache.n_layers):
        k, v = rows(n, seed=seed + layer)
        cache.append(layer, k, v)
    cache.advance(n)
    return cache


@pytest.mark.parametrize("make", [lambda: KVCache(2, 2, 32, 16), lambda: Q8Cache(2, 2, 32, 16)])
def test_persist_round_trip_bit_exact(tmp_path, make):
    src = filled(make(), 5)
    p = KVPersist(tmp_path / "c.kv")
    assert p.sync(src, [10, 11, 12, 13, 14]) == 5
    dst = make()
    assert KVPersist(tmp_path / "c.kv").load(dst) == [10, 11, 12, 13, 14]
    assert dst.len == 5
    for layer in range(2):
        assert torch.equal(dst.keys(layer, 5), src.keys(layer, 5))
        assert torch.equal(dst.values(layer, 5), src.values(layer, 5))


def test_persist_appends_only_new_rows_and_rewinds(tmp_path):
    c = filled(KVCache(1, 2, 32, 16), 4)
    p = KVPersist(tmp_path / "c.kv")
    assert p.sync(c, [1, 2, 3, 4]) == 4
    filled(c, 2, seed=9)
    assert p.sync(c, [1, 2, 3, 4, 5, 6]) == 2
    c.truncate(3)                                  # the conversation rewinds and diverges
    filled(c, 1, seed=7)
    assert p.sync(c, [1, 2, 3, 9]) == 1
    d = KVCache(1, 2, 32, 16)
    assert KVPersist(tmp_path / "c.kv").load(d) == [1, 2, 3, 9]
    assert torch.equal(d.keys(0, 4), c.keys(0, 4))
    with pytest.raises(KVCacheError):
        p.sync(c, [1, 2])                          # tokens must describe every position


def test_persist_torn_tail_ignored(tmp_path):
    c = filled(KVCache(1, 2, 32, 16), 4)
    path = tmp_path / "c.kv"
    KVPersist(path).sync(c, [1, 2, 3, 4])
    size = path.stat().st_size
    with open(path, "ab") as f:                    # a torn append: record bytes, no count
        f.write(b"\x07" * 100)
    d = KVCache(1, 2, 32, 16)
    assert KVPersist(path).load(d) == [1, 2, 3, 4]
    # a tear inside the counted records: the complete prefix survives
    os.truncate(path, size - 10)
    d = KVCache(1, 2, 32, 16)
    assert KVPersist(path).load(d) == [1, 2, 3]
    assert torch.equal(d.keys(0, 3), c.keys(0, 3))


def test_persist_foreign_or_absent_ignored(tmp_path):
    path = tmp_path / "c.kv"
    assert KVPersist(path).load(KVCache(1, 2, 32, 16)) is None
    KVPersist(path).sync(filled(KVCache(1, 2, 32, 16), 2), [1, 2])
    assert KVPersist(path).load(KVCache(1, 4, 32, 16)) is None       # other heads
    assert KVPersist(path).load(KVCache(2, 2, 32, 16)) is None       # other depth
    assert KVPersist(path).load(Q8Cache(1, 2, 32, 16)) is None       # other storage
    assert KVPersist(path).load(KVCache(1, 2, 32, 1)) is None        # beyond capacity
    path.write_bytes(b"garbage")
    assert KVPersist(path).load(KVCache(1, 2, 32, 16)) is None
    with pytest.raises(KVCacheError):
        KVPersist(path).load(filled(KVCache(1, 2, 32, 16), 1))       # cache not empty


WRITER = textwrap.dedent("""
    import sys, torch
    from fucina.models.cache import KVCache
    from fucina.models.kv_persist import KVPersist
    c = KVCache(2, 2, 32, 100000)
    p = KVPersist(sys.argv[1])
    toks = []
    while True:
        n = c.len
        for layer in range(2):
            r = torch.full((3, 2, 32), 0.0) + (torch.arange(n, n + 3).view(3, 1, 1) % 256) * (layer + 1)
            c.append(layer, r, -r)
        c.advance(3)
        toks += [n % 7, (n + 1) % 7, (n + 2) % 7]
        p.sync(c, toks)
        print(c.len, flush=True)
""")


def test_persist_survives_kill_9_mid_append(tmp_path):
    path = tmp_path / "c.kv"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        n = 0
        while n < 60 and time.time() < deadline:
            n = int(proc.stdout.readline() or 0)
        time.sleep(0.05)                # somewhere inside a later append
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert n >= 60
    with open(path, "rb") as f:
        assert f.read(8) == MAGIC
        (count,) = struct.unpack("<Q", f.read(8))
    c = KVCache(2, 2, 32, 100000)
    toks = KVPersist(path).load(c)
    assert toks is not None and len(toks) >= 60 and len(toks) % 3 == 0 and len(toks) <= count
    assert toks == [i % 7 for i in range(len(toks))]
    pos = (torch.arange(len(toks)).view(-1, 1, 1) % 256).float()
    for layer in range(2):
        assert torch.equal(c.keys(layer, c.len).float(), (pos * (layer + 1)).expand(-1, 2, 32))
        assert torch.equal(c.values(layer, c.len).float(), -(pos * (layer + 1)).expand(-1, 2, 32))


@pytest.mark.slow
def test_q8_cache_tracks_f16_on_smollm2(smollm2_path):
    path = smollm2_path
    from fucina.models import load_model
    from fucina.text.genbench import greedy_run
    m = load_model(path)
    ids = [1, 4093, 314, 253, 1345, 2415, 30, 216] * 4
    seq = ids + greedy_run(m, ids, 48, "f16")
    a = m.forward_step_all_logits(make_cache(m, len(seq), "f16"), seq, 0)[len(ids) - 1:-1]
    b = m.forward_step_all_logits(make_cache(m, len(seq), "q8_0"), seq, 0)[len(ids) - 1:-1]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85
    pa, pb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    assert (pa.exp() * (pa - pb)).sum(-1).mean() < 0.02
    assert make_cache(m, 4096, "q8_0").nbytes() / make_cache(m, 4096, "f16").nbytes() == pytest.approx(34 / 64)


# -- the cache protocol: every memory kind --------------------------------------------

from fucina.models.cache import AliasKV, KVMemory, LatentKV, RecurrentState, WindowKV  # noqa: E402

CAP = 64


def _kinds():
    def mixed():
        full = KVMemory(CAP, 2, 32)
        return KVCache.of([full, WindowKV(CAP, 2, 32, window=4, slack=15), AliasKV(full, 0)], CAP)
    return {
        "kv-f16": lambda: KVCache(2, 2, 32, CAP),
        "kv-q8_0": lambda: Q8Cache(2, 2, 32, CAP),
        "kv-wide-v": lambda: KVCache(2, 2, 32, CAP, v_dim=64),
        "window-f16": lambda: KVCache.of([WindowKV(CAP, 2, 32, window=4, slack=15) for _ in range(2)], CAP),
        "window-q8_0": lambda: KVCache.of([WindowKV(CAP, 2, 32, storage="q8_0", window=4, slack=15)], CAP),
        "mixed-alias": mixed,
        "latent-f16": lambda: KVCache.of([LatentKV(CAP, 32, 16) for _ in range(2)], CAP),
        "latent-q8_0": lambda: KVCache.of([LatentKV(CAP, 64, 32, storage="q8_0")], CAP),
    }


KINDS = _kinds()


def _step(cache, pos, m, seed):
    """Write m rows at pos in every layer that has rows of its own; returns them."""
    out = []
    for i, mem in enumerate(cache.memories):
        if mem.kind == "alias":
            out.append(None)
            continue
        g = torch.Generator().manual_seed(seed * 100 + i)
        k = torch.randn(m, mem.k.heads, mem.k.dim, generator=g)
        v = torch.randn(m, mem.v.heads, mem.v.dim, generator=g)
        cache.append(i, k, v)
        out.append((k, v))
    return out


def _fill(cache, n, seed=0):
    """n positions in steps the cache takes; per layer the rows written, by position."""
    rows = {}
    pos, end = cache.len, cache.len + n
    while pos < end:
        m = min(cache.step_limit(), end - pos)
        cache.reserve(m)
        for i, kv in enumerate(_step(cache, pos, m, seed + pos)):
            if kv is not None:
                for j in range(m):
                    rows[(i, pos + j)] = (kv[0][j], kv[1][j])
        cache.advance(m)
        pos += m
    return rows


def _held_equal(a, b):
    for i, mem in enumerate(a.memories):
        lo = max(mem.base, b.memories[i].base) if isinstance(mem, KVMemory) else 0
        if isinstance(mem, KVMemory):
            for x, y in zip(a.span(i, lo, a.len), b.span(i, lo, b.len)):
                assert torch.equal(x, y)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_protocol_rows_and_reads(kind):
    c = KINDS[kind]()
    rows = _fill(c, 11)
    assert c.len == 11
    for i, mem in enumerate(c.memories):
        if not isinstance(mem, KVMemory):
            continue
        lo = mem.base
        assert lo <= max(0, 11 - getattr(mem, "window", 11))     # what position 11 reads is held
        k, v = c.span(i, lo, 11)
        want_k = torch.stack([rows[(i, p)][0] for p in range(lo, 11)])
        tol = 0 if mem.storage == "f16" else want_k.abs().max() / 100
        assert (k.float() - want_k).abs().max() <= tol + 2e-3 * want_k.abs().max()
        assert v.shape[-1] == mem.v.dim
    with pytest.raises(ContextFull):
        c.reserve(CAP)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_protocol_rewinds(kind):
    c = KINDS[kind]()
    _fill(c, 40)                                              # past a window memory's 19 rows
    windowed = any(m.kind == "window" for m in c.memories)
    assert c.can_truncate(40) and c.can_truncate(0) and c.can_truncate(39)
    assert c.can_truncate(2) is not windowed                 # past the window's rows
    assert c.truncate_point(2) == (0 if windowed else 2)
    if windowed:
        with pytest.raises(KVCacheError):
            c.truncate(2)
        assert c.len == 40
    c.truncate(c.truncate_point(38))
    assert c.len == 38
    _fill(c, 2, seed=5)                                       # re-extend after the rewind
    c.reset()
    assert c.len == 0 and c.can_truncate(0)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_protocol_copy_rows(kind):
    a, b = KINDS[kind](), KINDS[kind]()
    _fill(a, 13)
    b.copy_rows(a, 0, 13)
    assert b.len == 13
    _held_equal(b, a)
    with pytest.raises(KVCacheError):
        b.copy_rows(a, 0, 5)                                  # len != start
    if kind != "kv-f16":
        with pytest.raises(KVCacheError):
            KVCache(2, 2, 32, CAP).copy_rows(a, 0, 3)          # another layout


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_protocol_persists(tmp_path, kind):
    src = KINDS[kind]()
    _fill(src, 13)
    toks = list(range(100, 113))
    KVPersist(tmp_path / "c.kv").sync(src, toks)
    dst = KINDS[kind]()
    assert KVPersist(tmp_path / "c.kv").load(dst) == toks and dst.len == 13
    _held_equal(dst, src)
    _fill(src, 2, seed=9)
    _fill(dst, 2, seed=9)                                     # both continue the same way
    _held_equal(dst, src)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_protocol_costs_and_native_table(kind):
    c = KINDS[kind]()
    assert c.nbytes() == sum(m.nbytes() for m in c.memories) > 0
    assert c.bytes_per_position() >= 0
    table = c.native_table()
    def native_mem(m):   # an alias has an empty entry when its target is native (gemma4's kv_from)
        return native_mem(m.target) if m.kind == "alias" else (
            m.kind in ("kv", "window") and m.storage == "f16" and m.k.dim == m.v.dim
            or m.kind == "latent" and m.storage == "f16")                  # latent rows as k, rope rows as v
    assert (table is not None) == all(native_mem(m) for m in c.memories)
    if table is not None:
        t = table.ptrs.view(-1, 4)
        assert t[:, 3].tolist() == [getattr(m, "rows", 0) for m in c.memories]
        _fill(c, 14)                                          # a window shift republishes its base
        assert t[:, 2].tolist() == [getattr(m, "base", 0) for m in c.memories]


def test_window_memory_holds_only_its_window():
    full, win = KVMemory(8192, 1, 256), WindowKV(8192, 1, 256, window=512, slack=256)
    assert win.rows == 768 and win.nbytes() / full.nbytes() == pytest.approx(768 / 8192)


def test_recurrent_state_snapshots_and_rewinds(tmp_path):
    def make():
        return KVCache.of([RecurrentState(3, 8, 2, 4, 4, horizon=4, decode_stride=1)], 64)

    c = make()
    states = {}
    for p in range(10):                      # a mixer would compute these from the inputs
        conv, state = torch.full((3, 8), float(p)), torch.full((2, 4, 4), -float(p))
        c.memories[0].write(p, conv, state)
        c.advance(1)
        states[c.len] = (conv, state)
    assert c.can_truncate(8) and c.can_truncate(7) and not c.can_truncate(5)   # horizon 4
    c.truncate(8)
    assert torch.equal(c.span(0, 0, 8)[0], states[8][0]) and c.len == 8
    with pytest.raises(KVCacheError):
        c.truncate(3)
    other = make()
    other.copy_rows(c, 0, 8)
    assert torch.equal(other.memories[0].state, states[8][1])
    KVPersist(tmp_path / "r.kv").sync(c, list(range(8)))
    back = make()
    assert KVPersist(tmp_path / "r.kv").load(back) == list(range(8))
    assert torch.equal(back.memories[0].conv, states[8][0]) and torch.equal(back.memories[0].state, states[8][1])
    with open(tmp_path / "r.kv", "r+b") as f:   # a state that does not describe the count
        f.seek(8)
        f.write(struct.pack("<Q", 7))
    assert KVPersist(tmp_path / "r.kv").load(make()) is None
    c.reset()
    assert c.len == 0 and not c.memories[0].state.any()


def test_window_cache_serves_a_model_prefix_reuse_and_persistence(tmp_path):
    """Gemma-3 with window memories of window + 3 rows: the same logits as a cache that
    keeps everything, prefix reuse falls back when the window moved on, and a persisted
    cache resumes to the same next logits."""
    from fucina.models import load_model
    from fucina.text.generate import prefill
    from synth import write_model
    m = load_model(write_model(tmp_path / "g.gguf", "gemma3", layers=6, hidden=64, heads=4, kv_heads=2,
                               head_dim=32, sliding_window=5))
    m.window_slack = 15
    ids = [(i * 37) % 250 + 3 for i in range(40)]
    keep_all = m.init_cache(64, rewindable=True)
    want = m.forward_step_all_logits(keep_all, ids, 0)
    c = m.init_cache(64)
    got = m.forward_step_all_logits(c, ids, 0)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    assert c.nbytes() < keep_all.nbytes()
    for prompt in (ids[:39] + [9], ids[:20] + [9, 9]):   # a rewind within reach, one beyond it
        hist = list(ids) if c.len == len(ids) else hist
        logits, keep = prefill(m, c, hist, prompt)
        assert keep == (39 if prompt[20] != 9 else 0)
        fresh = m.forward_step(m.init_cache(64, rewindable=True), prompt, 0)
        assert (logits - fresh).abs().max() < 1e-3 * fresh.abs().max()
    KVPersist(tmp_path / "c.kv").sync(c, hist)
    d = m.init_cache(64)
    assert KVPersist(tmp_path / "c.kv").load(d) == hist
    a, b = m.forward_step(c, [11], c.len), m.forward_step(d, [11], d.len)
    assert torch.equal(a, b)
