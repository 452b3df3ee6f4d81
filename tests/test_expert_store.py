"""Experts streamed under a RAM budget (models/expert_store.py): the residency policy (heat,
LRU, never over budget), the budget's parsing and typed errors, and the output of a
streamed model bitwise equal to the fully resident one's on the native step and the torch
path, qwen3moe and deepseek2, at budgets that force eviction."""
import os
import random
import sys

import gguf
import pytest
import torch

import fucina.kernels as K
from fucina.errors import FucinaError, InvalidArgument
from fucina.models import load_model
from fucina.models.expert_store import Residency, parse_budget, stream_experts
from synth import write_model

Q = gguf.GGMLQuantizationType
IDS = [(7 * i * i + 3 * i + 5) % 250 + 1 for i in range(40)]
QWEN = dict(layers=3, hidden=128, heads=4, kv_heads=2, head_dim=32, experts=8, experts_used=3, moe_ffn=128)


# -- the policy ---------------------------------------------------------------------

def test_lru_evicts_the_least_recently_used():
    r = Residency(3, {k: 1 for k in "abcd"}, policy="lru")
    r.acquire("a"), r.acquire("b"), r.acquire("c"), r.acquire("a")
    loaded, evicted = r.acquire("d")
    assert loaded == ["d"] and evicted == ["b"] and r.resident == {"a", "c", "d"}


def test_heat_keeps_the_often_used_over_the_recent():
    r = Residency(2, {k: 1 for k in "abc"}, policy="heat", half_life=1000)
    for _ in range(5):
        r.acquire("a")
    r.acquire("b")
    _, evicted = r.acquire("c")        # LRU would drop a (older); heat drops b (used once)
    assert evicted == ["b"] and r.resident == {"a", "c"}
    lru = Residency(2, {k: 1 for k in "abc"}, policy="lru")
    for k in "aaaaab":
        lru.acquire(k)
    assert lru.acquire("c")[1] == ["a"]


def test_heat_decays_old_use():
    """With a short half-life, many uses long ago weigh less than a few recent ones."""
    r = Residency(2, {k: 1 for k in "abc"}, policy="heat", half_life=2)
    for _ in range(4):
        r.acquire("a")
    for _ in range(12):
        r.acquire("b")
    r.acquire("a")
    r.acquire("b")
    assert r.acquire("c")[1] == ["a"]


@pytest.mark.parametrize("policy", ["heat", "lru"])
def test_budget_never_exceeded_and_chosen_stay_resident(policy):
    rng = random.Random(0)
    sizes = {(layer, e): rng.randint(1, 9) for layer in range(4) for e in range(16)}
    r = Residency(60, sizes, policy=policy, half_life=8)
    for _ in range(2000):
        layer = rng.randrange(4)
        keys = rng.sample([(layer, e) for e in range(16)], rng.randint(1, 4))
        loaded, evicted = r.acquire(keys)
        assert r.used == sum(sizes[k] for k in r.resident) <= 60
        assert set(keys) <= r.resident and not set(evicted) & set(keys)
        assert not set(loaded) & (r.resident - set(keys))
    assert r.evictions > 0 and r.hits > 0 and r.misses > 0


def test_bad_policy_and_budgets_are_typed():
    with pytest.raises(InvalidArgument):
        Residency(10, {}, policy="fifo")
    with pytest.raises(InvalidArgument):
        Residency(0, {})
    r = Residency(4, {"a": 3, "b": 3})
    with pytest.raises(FucinaError):
        r.acquire(["a", "b"])          # more at once than the budget
    with pytest.raises(FucinaError):
        r.acquire(["zz"])
    assert parse_budget("50%", 1000) == 500 and parse_budget(0.5, 0) == 1 << 29
    for bad in ("0", "-1", "abc", "150%", "0%", "nan", "inf", ""):
        with pytest.raises(InvalidArgument):
            parse_budget(bad, 1000)


# -- streamed == resident -------------------------------------------------------------

def _logits(model, native: bool) -> torch.Tensor:
    """A two-chunk prefill, then token-by-token decode: every row's logits."""
    model.use_native_step = native
    try:
        cache, out = model.init_cache(64), []
        out.append(model.forward_step_all_logits(cache, IDS[:17], 0))
        out.append(model.forward_step_all_logits(cache, IDS[17:29], 17))
        for p in range(29, len(IDS)):
            out.append(model.forward_step_all_logits(cache, IDS[p:p + 1], p))
        return torch.cat(out)
    finally:
        model.use_native_step = True


def _resident_and_streamed(path, moe_ram, native, **kw):
    want = _logits(load_model(path), native)
    model = load_model(path)
    store = stream_experts(model, moe_ram, **kw)
    if native:   # the plan was rebuilt with the store's hook
        assert model.native_plan is not None
    return want, _logits(model, native), store


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("policy", ["heat", "lru"])
def test_qwen3moe_streamed_equals_resident(tmp_path, native, policy):
    if native and not K.available():
        pytest.skip("native kernels not built")
    path = write_model(tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0, **QWEN)
    want, got, store = _resident_and_streamed(path, "34%", native, policy=policy)   # one layer + a bit
    assert torch.equal(got, want)
    rep = store.report()
    assert rep["evictions"] > 0 and rep["misses"] > 0 and rep["resident"] <= rep["budget"]
    assert rep["errors"] == [] and rep["read_bytes"] > 0 and store.stats.prefetched > 0


def _batch_decode(model) -> torch.Tensor:
    lens, nxt = (3, 11, 1, 6), [9, 17, 33, 65]
    caches = [model.init_cache(32) for _ in lens]
    for c, n in zip(caches, lens):
        model.forward_step(c, IDS[:n], 0)
    return model.forward_step_batch(caches, nxt)


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
def test_streamed_batch_decode_equals_resident(tmp_path, isa):
    """Lockstep decode (the native step_batch) through the store, on every ISA."""
    path = write_model(tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q4_1, **QWEN)
    want = _batch_decode(load_model(path))
    model = load_model(path)
    store = stream_experts(model, "34%")
    assert torch.equal(_batch_decode(model), want), isa
    assert store.report()["evictions"] > 0


def test_deepseek2_streamed_equals_resident(tmp_path):
    path = write_model(tmp_path / "d.gguf", "deepseek2", layers=3)
    model = load_model(path)
    moe_layers = sum(1 for L in model.layers if L.moe)
    assert moe_layers >= 2
    want, got, store = _resident_and_streamed(path, f"{100 / moe_layers + 1:.1f}%", native=False)
    assert torch.equal(got, want)
    assert store.report()["evictions"] > 0


@pytest.mark.skipif(not K.available(), reason="native kernels not built")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q3_K, Q.Q5_0, Q.Q5_1], ids=["q4k", "q3k", "q50", "q51"])
def test_streamed_experts_are_packed_into_row_groups(tmp_path, isa, qtype):
    """Where a load puts the stacks in 16-row groups, the store packs each expert into them as
    it reads it (the decode GEMV reads the groups): the plan takes the groups' type, each
    slot's weight gives the file's rows back, the stack refuses to run on its own bytes, and
    the logits equal the resident model's at a budget that evicts."""
    path = write_model(tmp_path / "m.gguf", "qwen3moe", qtype=qtype,
                      **dict(QWEN, hidden=256, head_dim=64, ffn=512, moe_ffn=256))
    want = _logits(load_model(path), native=True)
    model = load_model(path)
    store = stream_experts(model, "34%")
    grouped = isa != "scalar"   # the scalar unit has no decode GEMV on groups: it keeps the rows
    ex = model.layers[0].experts
    for st in ex.stacks + (ex.down,):
        assert isinstance(st.whole.kernel, K.StoredKernel) == grouped
        if grouped:
            with pytest.raises(K.KernelError, match="expert store"):
                st.whole.kernel(torch.zeros(1, st.in_features))
    assert model.native_plan is not None
    assert torch.equal(_logits(model, native=True), want), isa
    assert store.report()["evictions"] > 0
    key = next(iter(store.slot_of))
    for st, w in zip(model.layers[key[0]].experts.stacks + (model.layers[key[0]].experts.down,), store._views(key)):
        assert K.group_rows(w.kernel) == (16 if grouped else None)
        assert torch.equal(w.raw, st.expert(key[1]).raw)   # the rows back from the slot's groups
    assert torch.equal(_logits(model, native=False), _logits(load_model(path), native=False))


def test_pack_groups_is_the_interleave_and_checks_its_input():
    if not K.available():
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(3)
    layouts = {fmt: lay for fmt, lay in K._LAYOUTS.items() if lay.group == 16}
    assert len(layouts) == 13   # every 16-row layout: the K-quants, the two-block units, MXFP4
    for fmt, lay in layouts.items():
        raw = torch.randint(0, 256, (48, 2 * lay.unit), dtype=torch.uint8, generator=g)
        out = torch.empty(raw.numel(), dtype=torch.uint8)
        K.pack_groups(raw.reshape(-1), out, 48, lay.pseudo)
        assert torch.equal(out, lay.pack(raw, 48).reshape(-1)), fmt
    raw, q4k = torch.zeros(32 * 144, dtype=torch.uint8), K._LAYOUTS[gguf.GGMLQuantizationType.Q4_K].pseudo
    for bad in (lambda: K.pack_groups(raw, torch.empty_like(raw), 32, K.TQ2_X8),             # 8-row groups
                lambda: K.pack_groups(raw[:8 * 144], torch.empty(8 * 144, dtype=torch.uint8), 8, q4k),   # not whole groups
                lambda: K.pack_groups(raw, raw, 32, q4k),                                             # in place
                lambda: K.pack_groups(raw, torch.empty(16 * 144, dtype=torch.uint8), 32, q4k),
                lambda: K.pack_groups(raw[:-1], torch.empty(raw.numel() - 1, dtype=torch.uint8), 32, q4k)):
        with pytest.raises(K.KernelError):
            bad()


def test_prefetch_reads_ahead_the_next_layers_last_choice(tmp_path, monkeypatch):
    path = write_model(tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0, **QWEN)
    store = stream_experts(load_model(path), "34%")          # 8 slots: one layer's experts
    assert store.n_slots == 8
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)))
    store.use(1, [0, 1, 2])
    store.use(0, [3])            # layer 1's last choice is resident: nothing to read ahead
    assert calls == []
    store.use(2, list(range(8)))  # evicts everything else
    assert set(store.slot_of) == {(2, e) for e in range(8)}
    store.use(0, [3])
    want = {(s.offset + e * s.size, s.size, os.POSIX_FADV_WILLNEED) for e in (0, 1, 2) for s in store.stacks[1]}
    assert set(calls) == want and len(calls) == 9 and store.stats.prefetched == 3


def _cut_file(store, path, tmp_path, cut: int):
    """Point the store's descriptor at a copy of its file that ends at byte `cut` (reads past it
    come back short); returns the undo."""
    short = tmp_path / "short.gguf"
    with open(path, "rb") as f:
        short.write_bytes(f.read(cut))
    fd, saved, tmp = store.stacks[0][0].fd, os.dup(store.stacks[0][0].fd), os.open(short, os.O_RDONLY)
    os.dup2(tmp, fd)
    os.close(tmp)

    def undo():
        os.dup2(saved, fd)
        os.close(saved)
    return undo


def test_a_failed_read_is_typed_and_leaves_the_store_consistent(tmp_path):
    path = write_model(tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0, **QWEN)
    store = stream_experts(load_model(path), "34%")
    store.use(0, [1])
    gate = store.stacks[0][0]
    undo = _cut_file(store, path, tmp_path, gate.offset + 2 * gate.size)   # experts 2 and 3 cut off
    with pytest.raises(FucinaError, match="short read"):
        store.use(0, [2, 3])
    assert set(store.slot_of) == {(0, 1)} == store.policy.resident and len(store.free) == store.n_slots - 1
    undo()
    assert set(store.use(0, [2, 3])) == {2, 3} and store.tables[0][:, [1, 2, 3]].ne(0).all()


def test_reads_over_the_threads_keep_what_they_read_when_some_fail(tmp_path, monkeypatch):
    """The misses of a call are read over the kernels' threads, every read tried: the experts
    read whole stay resident, the others do not, the slots add up, and the error is typed."""
    monkeypatch.setattr(K, "get_threads", lambda: 2)
    path = write_model(tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0, **QWEN)
    store = stream_experts(load_model(path), "34%")
    assert store.readers == 2
    store.use(0, [1])
    down = store.stacks[0][-1]
    assert all(s.offset + s.size * 8 <= down.offset for s in store.stacks[0][:-1])   # the file's order
    undo = _cut_file(store, path, tmp_path, down.offset + 3 * down.size)   # down of experts 3.. cut off
    with pytest.raises(FucinaError, match=r"short read of .*ffn_down_exps.*\[3\]"):
        store.use(0, [2, 3, 4, 5, 6])
    assert set(store.slot_of) == {(0, 1), (0, 2)} == store.policy.resident
    assert len(store.free) == store.n_slots - 2
    assert store.tables[0][:, [3, 4, 5, 6]].eq(0).all() and store.tables[0][:, [1, 2]].ne(0).all()
    undo()
    assert set(store.use(0, [3, 5])) == {3, 5} and store.tables[0][:, [3, 5]].ne(0).all()


def test_budget_errors_are_typed(tmp_path):
    path = write_model(tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0, **QWEN)
    with pytest.raises(InvalidArgument, match="below one layer"):
        stream_experts(load_model(path), "20%")
    with pytest.raises(InvalidArgument):
        stream_experts(load_model(path), "lots")
    dense = write_model(tmp_path / "d.gguf", "llama")
    with pytest.raises(InvalidArgument, match="no expert stacks"):
        stream_experts(load_model(dense), 1)


def _mapped_bytes(lo: int, hi: int) -> int:
    """Resident bytes of this process's mappings that overlap [lo, hi) (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_streamed_experts_are_not_read_through_the_mapping(tmp_path):
    """With a store the GGUF mapping keeps at most the non-expert bytes resident (plus pages
    at the stacks' edges): every expert byte read lives in the store's pool of budget size;
    without one, the run maps the experts it used."""
    geo = dict(QWEN, hidden=256, moe_ffn=256, experts=16, experts_used=4)
    path = write_model(tmp_path / "m.gguf", "qwen3moe", qtype=Q.F16, **geo)
    for streamed in (False, True):
        model = load_model(path)
        store = stream_experts(model, "40%", policy="lru") if streamed else None
        _logits(model, native=K.available())
        f = model.gguf
        lo = min(t.data.ctypes.data for t in f.tensors.values())
        hi = max(t.data.ctypes.data + t.nbytes for t in f.tensors.values())
        other = sum(t.nbytes for n, t in f.tensors.items() if "_exps" not in n)
        mapped = _mapped_bytes(lo, hi)
        if streamed:
            assert mapped <= other + 2 * 4096 * 3 * len(model.layers), (mapped, other)
            assert store.pool.numel() <= store.budget < store.total and store.report()["evictions"] > 0
        else:
            assert mapped > other + store_total(model) // 2


def store_total(model) -> int:
    return sum(L.experts.nbytes for L in model.layers)


def test_cli_and_api_stream_with_the_same_output(tmp_path, capsys):
    import fucina
    from fucina.cli.main import main

    path = write_model(tmp_path / "m.gguf", "qwen3moe", qtype=Q.Q8_0, **QWEN)
    outs = []
    for extra in ([], ["--moe-ram", "40%", "--moe-policy", "lru"], ["--moe-cache-mb", "0.5"]):
        out = tmp_path / f"ids{len(extra)}.txt"
        assert main(["run", path, "--tokens", "5,9,17,33", "--gen", "12", "--ids-out", str(out), *extra]) == 0
        outs.append(out.read_text())
    assert outs[0] == outs[1] == outs[2] and len(outs[0].split()) == 12
    capsys.readouterr()
    assert main(["run", path, "--tokens", "5,9", "--gen", "2", "--moe-ram", "-3"]) == 1
    assert "moe_ram" in capsys.readouterr().err
    llm = fucina.load(path, moe_ram="40%")
    assert llm.model.expert_store.budget < llm.model.expert_store.total
