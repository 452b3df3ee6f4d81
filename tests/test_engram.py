"""Engram: the hash plan against an independent reference and committed goldens, the layer
and every gradient against a plain-module formulation, ShortConv streaming, the graft seam
(zero-init graft == bare model, torch path and native step), the file, bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engram_reference import GOLDEN, golden_case, golden_values, ref_hash, ref_multipliers, ref_primes
from fucina.models.engram.plan import EngramError, HashPlan, head_sizes


def _plan(case, **kw):
    return HashPlan(n_vocab=case["n_vocab"], layer_ids=case["layer_ids"], max_ngram=case["max_ngram"],
                    n_head=case["n_head"], vocab_per_ngram=case["vocab_per_ngram"], pad_id=case["pad_id"],
                    seed=case["seed"], lookup=case["lookup"], **kw)


def test_hash_matches_reference_goldens():
    g = json.loads(GOLDEN.read_text())
    case = golden_case()
    assert g["case"]["ids"] == case["ids"].tolist()      # the golden's input is the case's
    primes, mults, rows = golden_values(case)            # the independent formulation == its goldens
    for lid in case["layer_ids"]:
        assert primes[lid] == g["primes"][str(lid)]
        assert mults[lid].tolist() == g["multipliers"][str(lid)]
        assert rows[lid].tolist() == g["rows"][str(lid)]
    plan = _plan(case)
    for i, lid in enumerate(case["layer_ids"]):
        assert plan.sizes[i] == g["primes"][str(lid)]
        assert plan.multipliers[i].tolist() == g["multipliers"][str(lid)]
        want = np.array(g["rows"][str(lid)])
        for b in range(case["ids"].shape[0]):
            got = plan.rows(lid, plan.compress(case["ids"][b]))
            assert (got - plan.offsets[i]).tolist() == want[b].tolist()
            assert (got < plan.table_rows[i]).all() and (got >= 0).all()


def test_hash_wraps_and_streams():
    """Wrapping int64 products (odd multipliers near the int64 range), and rows of a
    sequence hashed in pieces with their history == hashed whole."""
    rng = np.random.default_rng(0)
    mult = (rng.integers(1 << 60, (1 << 62), size=(1, 4)) | 1).astype(np.int64)
    plan = HashPlan(n_vocab=1000, layer_ids=[0], max_ngram=4, n_head=2, vocab_per_ngram=[101, 103, 107],
                    pad_id=3, multipliers=mult)
    ids = rng.integers(0, 1000, size=40)
    whole = plan.rows(0, ids)
    primes = [plan.sizes[0][o] for o in range(3)]
    ref = ref_hash(ids[None], mult[0], primes, 4, 3)[0]
    assert (whole - plan.offsets[0]).tolist() == ref.tolist()
    for cut in (1, 2, 3, 17, 39):
        parts = np.concatenate([plan.rows(0, ids[:cut]), plan.rows(0, ids[cut:], prev=ids[:cut])])
        assert parts.tolist() == whole.tolist()


def test_prime_chain_is_global_and_capacity_one():
    sizes = head_sizes([0, 5], [10, 10], 2)
    assert sizes == list(ref_primes([0, 5], [10, 10], 2).values()) == [[[11, 13], [17, 19]], [[23, 29], [31, 37]]]
    assert head_sizes([2], [1, 1], 3) == [[[1, 1, 1], [1, 1, 1]]]
    p = HashPlan(n_vocab=50, layer_ids=[2], vocab_per_ngram=[1, 1], n_head=3)
    rows = p.rows(2, np.arange(10))
    assert rows.tolist() == [list(range(6))] * 10     # one row per head: the offsets only


def test_multipliers_drawn_as_the_reference_or_given():
    p = HashPlan(n_vocab=500, layer_ids=[3, 9], seed=4)
    ref = ref_multipliers([3, 9], 3, 500, 4)
    assert p.multipliers.tolist() == [ref[3].tolist(), ref[9].tolist()]
    q = HashPlan(n_vocab=500, layer_ids=[3, 9], seed=99, multipliers=p.multipliers)
    assert (q.rows(9, np.arange(20)) == p.rows(9, np.arange(20))).all()


def test_plan_bad_input():
    with pytest.raises(EngramError, match="out of range"):
        HashPlan(n_vocab=10, layer_ids=[0]).compress(np.array([3, 10]))
    with pytest.raises(EngramError, match="odd"):
        HashPlan(n_vocab=10, layer_ids=[0], multipliers=np.array([[2, 3, 5]]))
    with pytest.raises(EngramError, match="table size"):
        HashPlan(n_vocab=10, layer_ids=[0], vocab_per_ngram=[5])
    with pytest.raises(EngramError, match="carries no memory"):
        HashPlan(n_vocab=10, layer_ids=[0]).rows(1, np.arange(3))
    with pytest.raises(EngramError, match="compression"):
        HashPlan(n_vocab=10, layer_ids=[0], lookup=np.arange(9))


# -- the layer ---------------------------------------------------------------------------------

import torch  # noqa: E402

from engram_reference import ref_layer  # noqa: E402
from fucina.models.engram.layer import PARAMS, EngramLayer  # noqa: E402


def _layer(graft=False, d=24, head_dim=4, heads=6, rows=97, kernel=4, dilation=3):
    torch.manual_seed(0)
    mod = EngramLayer(rows, d, head_dim, heads, kernel, dilation, graft=graft,
                      generator=torch.Generator().manual_seed(1))
    with torch.no_grad():   # norms away from 1 so their gradients are exercised
        for name in ("key_norm", "query_norm", "conv_norm"):
            getattr(mod, name).uniform_(0.5, 1.5)
    return mod


def test_layer_forward_and_every_gradient_match_the_reference():
    mod = _layer()
    t, d = 19, mod.n_embd
    x = torch.randn(t, d, requires_grad=True)
    rows = torch.randint(0, 97, (t, mod.n_heads))
    out, _ = mod(x, rows)
    params = {n: getattr(mod, n).detach().clone().requires_grad_() for n in PARAMS}
    xr = x.detach().clone().requires_grad_()
    ref = ref_layer(params, xr, rows, mod.kernel, mod.dilation)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)
    w = torch.randn(t, d)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-6)
    for n in PARAMS:
        assert getattr(mod, n).grad is not None and params[n].grad.abs().sum() > 0, n
        torch.testing.assert_close(getattr(mod, n).grad, params[n].grad, rtol=1e-4, atol=1e-6, msg=n)


def test_shortconv_streaming_equals_whole_sequence():
    mod = _layer()
    t = 23
    x, rows = torch.randn(t, mod.n_embd), torch.randint(0, 97, (t, mod.n_heads))
    with torch.no_grad():
        whole, vn = mod(x, rows)
        for cuts in ([1] * t, [5, 1, 1, 9, 7], [2, 21]):
            outs, hist, at = [], torch.zeros(mod.history, mod.n_embd), 0
            for n in cuts:
                o, v = mod(x[at:at + n], rows[at:at + n], hist[-mod.history:])
                hist = torch.cat([hist, v])
                outs.append(o)
                at += n
            # the projections' sums differ in the last bit with the row count (torch's GEMM
            # blocking); the conv itself is elementwise over the same history
            torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-5, atol=1e-6)


def test_graft_zero_init_is_exactly_zero_with_value_gradients():
    mod = _layer(graft=True)
    x = torch.randn(7, mod.n_embd)
    out, _ = mod(x, torch.randint(0, 97, (7, mod.n_heads)))
    assert (out == 0).all()
    out.sum().backward()
    assert mod.value_w.grad.abs().sum() > 0 and mod.value_b.grad.abs().sum() > 0


# -- the graft on a decoder ----------------------------------------------------------------------

from synth import chunked_logits, write_model  # noqa: E402

from fucina.models import load_model  # noqa: E402
from fucina.models.engram import Engram  # noqa: E402

IDS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 33, 200, 11, 12, 13, 14, 150, 151, 152, 9, 77, 31, 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(write_model(tmp_path_factory.mktemp("engram") / "m.gguf", "llama", layers=3))


def _logits(model, native: bool, chunks=(len(IDS),)):
    return chunked_logits(model, IDS, chunks, native)


def _trained(eng):
    """Move every parameter off its init, as training would."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in eng.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return eng


def test_zero_init_graft_is_bitwise_the_bare_model(tiny):
    # the bare model in the same chunks: the graft must change no bit of either path (the
    # torch blocks' own chunking is not bitwise on AVX2, so each chunking is its own reference)
    splits = ((len(IDS),), (9, 1, 1, 12))
    bare = {(n, c): _logits(tiny, n, c) for n in (True, False) for c in splits}
    eng = Engram.for_model(tiny, [0, 2], capacity=31, n_head=2, head_dim=8).attach(tiny)
    try:
        assert tiny.residual_hooks
        for native in (True, False):
            for chunks in splits:
                assert torch.equal(_logits(tiny, native, chunks), bare[native, chunks])
    finally:
        eng.detach()
    assert not tiny.residual_hooks


def test_graft_native_step_matches_torch_blocks_and_streams(tiny):
    eng = _trained(Engram.for_model(tiny, [1, 2], capacity=31, n_head=2, head_dim=8)).attach(tiny)
    try:
        whole = _logits(tiny, False)
        assert tiny._native_cache(tiny.init_cache(8)) is not None and tiny._hook_ranges()   # cut plans
        native = _logits(tiny, True)
        torch.testing.assert_close(native, whole, rtol=1e-3, atol=1e-3)
        pieces = _logits(tiny, True, (7, 1, 1, 1, 13))
        torch.testing.assert_close(pieces, native, rtol=1e-4, atol=1e-4)
        # lockstep streams: each row's hooks read its own cache's history
        caches = [tiny.init_cache(64) for _ in range(2)]
        for c, n in zip(caches, (5, 8)):
            tiny.forward_step(c, IDS[:n], 0)
        lock = tiny.forward_step_batch(caches, [IDS[5], IDS[8]])
        torch.testing.assert_close(lock[0], native[5], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lock[1], native[8], rtol=1e-4, atol=1e-4)
    finally:
        eng.detach()
    assert not torch.allclose(native, _logits(tiny, True))   # the graft changed the logits


def test_graft_file_roundtrip(tiny, tmp_path):
    eng = _trained(Engram.for_model(tiny, [1], capacity=31, n_head=2, head_dim=8, seed=4,
                                    lookup=np.arange(tiny.config.n_vocab) // 2))
    eng.save(tmp_path / "e.safetensors")
    back = Engram.load(tmp_path / "e.safetensors")
    assert back.plan.multipliers.tolist() == eng.plan.multipliers.tolist()
    assert back.plan.lookup.tolist() == eng.plan.lookup.tolist()
    for (n, a), (m, b) in zip(eng.named_parameters(), back.named_parameters()):
        assert n == m and torch.equal(a, b)
    eng.attach(tiny)
    want = _logits(tiny, True)
    eng.detach()
    back.attach(tiny)
    try:
        assert torch.equal(_logits(tiny, True), want)
    finally:
        back.detach()


def test_graft_bad_input(tiny, tmp_path):
    from fucina.models.engram import EngramError
    eng = Engram.for_model(tiny, [1], capacity=31, n_head=2, head_dim=8)
    eng.model_id["embd_digest"] = "0" * 16          # made for another model
    with pytest.raises(EngramError, match="another model"):
        eng.attach(tiny)
    eng = Engram.for_model(tiny, [1], capacity=31, n_head=2, head_dim=8)
    path = tmp_path / "e.safetensors"
    eng.save(path)
    raw = bytearray(path.read_bytes())
    (tmp_path / "short.safetensors").write_bytes(raw[:len(raw) - 100])
    with pytest.raises(EngramError, match="does not fit"):
        Engram.load(tmp_path / "short.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(EngramError, match="not JSON"):
        Engram.load(tmp_path / "junk.safetensors")
    arrays = eng.tensors()
    arrays["engram.layers.1.table"][3, 1] = np.nan
    from fucina.models.engram import store
    store.write(tmp_path / "nan.safetensors", arrays, {"format": "fucina-engram/1",
                                                        "config": __import__("json").dumps(eng.config()),
                                                        "model": __import__("json").dumps(eng.model_id)})
    with pytest.raises(EngramError, match="corrupt"):
        Engram.load(tmp_path / "nan.safetensors")
    with pytest.raises(EngramError, match="out of range"):
        eng(1, torch.zeros(1, tiny.config.n_embd), torch.tensor([tiny.config.n_vocab]), 0, tiny.init_cache(8))
    with pytest.raises(EngramError, match="layer 7 out of range"):
        Engram.for_model(tiny, [7])
    eng.attach(tiny)
    try:   # a cache whose earlier positions ran without the graft
        cache = tiny.init_cache(64)
        eng.detach()
        tiny.forward_step(cache, IDS[:4], 0)
        eng.attach(tiny)
        with pytest.raises(EngramError, match="reset the cache"):
            tiny.forward_step(cache, IDS[4:6], 4)
    finally:
        eng.detach()


# -- training and the interfaces ----------------------------------------------------------------

def test_training_moves_only_the_graft_and_lowers_the_loss(tiny):
    from fucina.train.engram import train
    ids = (IDS * 6)[:120]
    eng = Engram.for_model(tiny, [1], capacity=61, n_head=2, head_dim=8)
    before = [w.raw.clone() for w in (tiny.layers[0].wqkv, tiny.output)]
    losses = train(tiny, eng, ids, steps=25, lr=1e-2, ctx=48, seed=1)
    assert losses[-1] < 0.9 * losses[0]
    assert eng.layers["1"].value_w.abs().sum() > 0
    assert all(torch.equal(a, w.raw) for a, w in zip(before, (tiny.layers[0].wqkv, tiny.output)))
    assert not tiny.residual_hooks     # detached after training


def test_cli_equiv_train_and_engram_flags(tiny, tmp_path, capsys):
    from fucina.cli.main import main
    model = str(tiny.gguf.path)
    assert main(["engram", "equiv", model, "--layers", "0,2"]) == 0
    assert "bitwise equal" in capsys.readouterr().out
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 20)
    out = tmp_path / "e.safetensors"
    assert main(["engram", "train", model, "--corpus", str(corpus), "--out", str(out), "--steps", "3",
                 "--capacity", "31", "--ctx", "32", "--layers", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 3
    assert main(["perplexity", model, "--engram", str(out), "--file", str(corpus), "--ctx", "64"]) == 0
    assert "PPL" in capsys.readouterr().out
    assert main(["run", model, "--engram", str(out), "-p", "the cat", "-n", "4"]) == 0
    import fucina
    llm = fucina.load(model, engram=out)
    assert llm.model.residual_hooks
    llm.generate("the cat", max_tokens=3, temperature=0)
    assert main(["run", model, "--engram", str(corpus), "-p", "x", "-n", "1"]) == 1   # not an Engram file


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "qwen2.5-coder"])
def test_equiv_on_real_models(name, capsys):
    from conftest import present_model
    from fucina.cli.main import main
    path = present_model(name)
    assert main(["engram", "equiv", str(path), "-t", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("bitwise equal") == 2, out


def test_graft_history_follows_copied_rows(tiny):
    eng = _trained(Engram.for_model(tiny, [1], capacity=31, n_head=2, head_dim=8)).attach(tiny)
    try:
        want = _logits(tiny, True)
        a, b = tiny.init_cache(64), tiny.init_cache(64)
        tiny.forward_step(a, IDS[:10], 0)
        b.copy_rows(a, 0, 8)                 # a server slot adopting a shared prefix
        got = tiny.forward_step_all_logits(b, IDS[8:12], 8)
        torch.testing.assert_close(got, want[8:12], rtol=1e-4, atol=1e-4)
    finally:
        eng.detach()
    assert eng not in type(a).copy_listeners


# -- the native forward (csrc/engram_module.cpp) -------------------------------------------------

def _native_or_skip():
    from fucina.kernels import engram as native_engram
    if not native_engram.available():
        pytest.skip("the Engram kernel is not built")
    return native_engram


def _stream_graft(tiny, trained=True, **kw):
    eng = Engram.for_model(tiny, [1], capacity=31, n_head=2, head_dim=8, lookup=np.arange(tiny.config.n_vocab) // 3,
                           pad_id=2, **kw)
    return _trained(eng) if trained else eng


def _run_layer(eng, x, ids, cuts, native: bool):
    """The graft's layer-1 hook over x in pieces of `cuts`, one fresh cache: (out, history)."""
    from fucina.models.cache import KVCache
    cache = KVCache(1, 1, 4, x.shape[0] + 4)
    eng.native, outs, at = native, [], 0
    try:
        with torch.inference_mode():
            for n in cuts:
                outs.append(eng(1, x[at:at + n].clone(), torch.tensor(ids[at:at + n]), at, cache))
                at += n
    finally:
        eng.native = True
    s = eng._streams[cache]
    return torch.cat(outs), s.conv[1][:at].clone(), s.ids[:at].copy()


def test_native_forward_matches_the_torch_layer_and_streams_bitwise(tiny, isa):
    """Every ISA section against the torch layer (the projections' sums in another order:
    within 2e-5 relative), prefill and decode; pieces == whole bitwise (rows are independent
    and each reads the history the ones before it wrote)."""
    _native_or_skip()
    eng = _stream_graft(tiny)
    x = torch.randn(len(IDS), tiny.config.n_embd, generator=torch.Generator().manual_seed(5))
    ref, ref_conv, ref_ids = _run_layer(eng, x, IDS, (len(IDS),), native=False)
    whole, conv, sids = _run_layer(eng, x, IDS, (len(IDS),), native=True)
    assert sids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(whole, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(conv, ref_conv, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(whole, x)            # the graft moved the residual
    for cuts in ((1,) * len(IDS), (7, 1, 1, 14)):
        got, got_conv, _ = _run_layer(eng, x, IDS, cuts, native=True)
        assert torch.equal(got, whole) and torch.equal(got_conv, conv)


def test_native_rows_match_the_plan_and_zero_init_is_exact(tiny, isa):
    native_engram = _native_or_skip()
    eng = _stream_graft(tiny, trained=False)
    plan, comp = eng.plan, eng.plan.compress(np.array(IDS))
    out = np.zeros((len(IDS), plan.n_heads_total), dtype=np.int64)
    li = plan.index(1)
    mult = np.ascontiguousarray(plan.multipliers[li])
    native_engram.rows(comp.ctypes.data, 0, len(IDS), plan.max_ngram, plan.n_head, plan.pad, mult.ctypes.data,
                       plan.mods[li].ctypes.data, plan.offsets[li].ctypes.data, out.ctypes.data)
    assert out.tolist() == plan.rows(1, comp).tolist()
    x = torch.randn(len(IDS), tiny.config.n_embd)
    got, conv, _ = _run_layer(eng, x, IDS, (5, 1, 17), native=True)
    assert torch.equal(got, x) and not conv.any()          # zero-init: the identity, bitwise


def test_native_forward_bad_input(tiny):
    native_engram = _native_or_skip()
    from fucina.models.engram import EngramError
    eng = _stream_graft(tiny)
    with pytest.raises(EngramError, match="out of range"):
        _run_layer(eng, torch.zeros(2, tiny.config.n_embd), [1, tiny.config.n_vocab], (2,), native=True)
    x = torch.zeros(1, tiny.config.n_embd)
    fixed = list(eng._native_args(1, eng.layers["1"]))
    sids, conv, ids = np.zeros(4, dtype=np.int64), torch.zeros(4, tiny.config.n_embd), torch.tensor([1])
    call = lambda f, pos0=0: native_engram.forward(x.data_ptr(), 1, tiny.config.n_embd, ids.data_ptr(),  # noqa: E731
                                                   tiny.config.n_vocab, 0, sids.ctypes.data, pos0, 4, *f,
                                                   conv.data_ptr())
    call(fixed)
    with pytest.raises(ValueError, match="capacity"):
        call(fixed, pos0=4)                                  # past the history's capacity
    bad = list(fixed)
    bad[7] = 5                                               # a table too short for the heads' rows
    with pytest.raises(ValueError, match="outside the table"):
        call(bad)
    bad = list(fixed)
    bad[9] = 0                                               # a null weight
    with pytest.raises(ValueError, match="null"):
        call(bad)


def test_mapped_table_gives_the_in_ram_logits_and_reads_ahead(tiny, tmp_path):
    _native_or_skip()
    path = tmp_path / "e.safetensors"
    _stream_graft(tiny).save(path)
    logits = {}
    for mmap in (False, True):
        for in_step in (True, False):
            eng = Engram.load(path, mmap=mmap)
            assert eng.mapped_layers == ([1] if mmap else [])
            assert isinstance(eng._mapped.get(1), np.memmap) == mmap
            eng.in_step = in_step
            eng.attach(tiny)
            try:
                logits[mmap, in_step] = _logits(tiny, True, (9, 1, 1, 12))
            finally:
                eng.detach()
            # each head of each position read ahead: inside the step every step's rows (the
            # binding makes the history), cut every step's after the first
            ahead = len(IDS) if in_step else len(IDS) - 9
            assert eng.rows_prefetched == (eng.plan.n_heads_total * ahead if mmap else 0)
    assert all(torch.equal(v, logits[False, True]) for v in logits.values())
    from fucina.cli.main import main
    from fucina.models.engram import graft
    try:
        assert main(["run", str(tiny.gguf.path), "--engram", str(path), "--engram-mmap", "-p", "the", "-n", "2"]) == 0
        assert graft.MMAP_DEFAULT is True
    finally:
        graft.MMAP_DEFAULT = None


# -- the memory layers inside the native step (DecoderPlan.with_hooks) ---------------------------

def test_in_step_graft_is_bitwise_the_cut_step(tiny, isa, monkeypatch):
    """One native call a token with the memory layers inside == the step cut at them with a
    native call each, bitwise, at every ISA level and thread count (the projections' outputs
    split over the step's threads), prefill and decode; at the first and the last layer."""
    _native_or_skip()
    import fucina.kernels as K
    eng = _trained(Engram.for_model(tiny, [0, 2], capacity=31, n_head=2, head_dim=8,
                                    lookup=np.arange(tiny.config.n_vocab) // 3)).attach(tiny)
    threads = K.get_threads()
    try:
        for n in (1, 2):
            K.set_threads(n)
            for chunks in ((len(IDS),), (9, 1, 1, 12)):
                eng.in_step = False
                cut = _logits(tiny, True, chunks)
                eng.in_step = True
                with monkeypatch.context() as mp:     # nothing runs the memory layers outside the step
                    mp.setattr(Engram, "_native_forward", lambda *a: pytest.fail("cut step taken"))
                    inside = _logits(tiny, True, chunks)
                assert tiny._hook_step and torch.equal(inside, cut)
    finally:
        K.set_threads(threads)
        eng.detach()
    assert not tiny.residual_hooks and tiny._hook_step is None


def test_in_step_graft_follows_a_parameter_given_new_storage(tiny):
    """bind() skips its checks while nothing moved; a parameter given new storage between
    two steps of one cache (`.data =`, as `Module.to` does) is seen at the next step: the
    in-step logits equal the cut step's with the new weights, not the old weights'."""
    _native_or_skip()
    eng = _trained(Engram.for_model(tiny, [0, 2], capacity=31, n_head=2, head_dim=8)).attach(tiny)
    w = eng.layers["2"].value_w
    old = w.data

    def run(in_step: bool, scale: float) -> torch.Tensor:
        eng.in_step = in_step
        w.data = old
        cache = tiny.init_cache(len(IDS) + 1)
        tiny.forward_step(cache, IDS[:-1], 0)
        w.data = old * scale                    # new storage
        return tiny.forward_step(cache, IDS[-1:], len(IDS) - 1)

    try:
        cut, inside, unchanged = run(False, 3.0), run(True, 3.0), run(True, 1.0)
        assert torch.equal(inside, cut) and not torch.equal(inside, unchanged)
    finally:
        w.data = old
        eng.detach()


def test_in_step_bad_input(tiny):
    native_engram = _native_or_skip()
    from fucina.kernels import KernelError
    eng = _stream_graft(tiny).attach(tiny)
    try:
        with torch.inference_mode():
            _in_step_bad_input(tiny, eng, native_engram, KernelError)
        assert not eng.bind(torch.tensor([1]), 0, tiny.init_cache(8))    # a gradient: the cut step's torch layer
    finally:
        eng.detach()


def _in_step_bad_input(tiny, eng, native_engram, KernelError):
    cache = tiny.init_cache(8)
    with pytest.raises(EngramError, match="out of range"):
        eng.bind(torch.tensor([1, tiny.config.n_vocab]), 0, cache)
    with pytest.raises(EngramError, match="not computed with the graft"):
        eng.bind(torch.tensor([1]), 3, cache)
    plan, _ = tiny._in_step_plan()
    x = torch.zeros(1, tiny.config.n_embd)
    ptrs = tiny._native_cache(cache)
    tables = [t.table(8) for t in tiny.rope_tables(8)]
    with pytest.raises(KernelError, match="hook refused"):     # a step no binding armed
        plan.run(x, ptrs, 0, tables)
    assert eng.bind(torch.tensor([1, 2]), 0, cache)
    with pytest.raises(KernelError, match="hook refused"):     # bound to other rows
        plan.run(x, ptrs, 0, tables)
    with pytest.raises(ValueError, match="out of range"):
        native_engram.graft_layer(eng._graft, 5, eng._native_args(1, eng.layers["1"]), 0)
    bad = list(eng._native_args(1, eng.layers["1"]))
    bad[7] = 5                                                 # a table too short for the heads' rows
    with pytest.raises(ValueError, match="outside the table"):
        native_engram.graft_layer(eng._graft, 0, tuple(bad), 0)
