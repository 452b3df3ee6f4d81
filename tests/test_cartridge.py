"""Cartridges (models.cartridge): capture, persistence, writing into every cache kind,
composition, and the equivalence with a real prefill."""
import gguf
import pytest
import torch

from fucina.errors import CartridgeError
from fucina.models import load_model
from fucina.models.cartridge import Cartridge, compose, layer_geometry, read_safetensors
from synth import write_model

Q = gguf.GGMLQuantizationType

CASES = {
    "llama": ("llama", dict(hidden=128, heads=4, kv_heads=2, head_dim=32, layers=2)),
    "qwen3": ("qwen3", dict(hidden=64, heads=4, kv_heads=1, head_dim=32, layers=2)),
    # window 5 < p: the cartridge's oldest rows fall out of the local layers' window
    "gemma3-window": ("gemma3", dict(hidden=64, heads=4, kv_heads=2, head_dim=32, layers=3, sliding_window=5)),
    # per-layer embeddings, and a last layer reading another layer's K/V (no rows of its own)
    "gemma4-shared": ("gemma4", dict(hidden=64, heads=4, kv_heads=2, head_dim=32, layers=4)),
}

IDS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 33, 200, 11, 12, 13, 14, 150, 151, 152, 9,
       77, 31, 6, 190, 45, 2, 88, 123, 61, 19, 240, 4]


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory):
    arch, kw = CASES[request.param]
    path = write_model(tmp_path_factory.mktemp(request.param) / "m.gguf", arch, qtype=Q.Q8_0, **kw)
    return load_model(path)


def _continue(model, cache, suffix, n_greedy=6):
    """Logits of `suffix` after what the cache holds, then a greedy continuation."""
    logits = model.forward_step_all_logits(cache, suffix, cache.len)
    out, tok = [], int(logits[-1].argmax())
    for _ in range(n_greedy):
        out.append(tok)
        tok = int(model.forward_step(cache, [tok], cache.len).argmax())
    return logits, out


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("native", [True, False])
def test_corpus_init_equals_real_prefill(model, cache_type, native):
    """Untrained, a captured cartridge written into an empty cache is the real prefill:
    the same logits and greedy continuation, bit for bit."""
    p, suffix = 12, IDS[12:20]
    model.use_native_step = native
    try:
        real = model.init_cache(64, cache_type=cache_type)
        model.forward_step(real, IDS[:p], 0)
        want, want_greedy = _continue(model, real, suffix)
        cart = Cartridge.capture(model, IDS[:p], cache_type=cache_type)
        served = model.init_cache(64, cache_type=cache_type)
        cart.write_to_cache(served)
        assert served.len == p
        got, got_greedy = _continue(model, served, suffix)
    finally:
        model.use_native_step = True
    if cache_type == "f16":
        assert torch.equal(got, want)
    else:   # q8_0 rows re-quantized from their own dequantized values: the same blocks up to scale rounding
        assert (got - want).abs().max() < 1e-3
    assert got_greedy == want_greedy


def test_two_halves_composed_equal_the_whole(model):
    """Two halves of one capture, composed, are the capture of the whole."""
    whole = Cartridge.capture(model, IDS[:16])
    a = Cartridge(*_halves(whole, 0, 10))
    b = Cartridge(*_halves(whole, 10, 16), frozen=0)
    both = compose([a, b])
    assert both.p == 16
    c1, c2 = model.init_cache(64), model.init_cache(64)
    whole.write_to_cache(c1)
    both.write_to_cache(c2)
    l1, g1 = _continue(model, c1, IDS[16:22])
    l2, g2 = _continue(model, c2, IDS[16:22])
    assert torch.equal(l1, l2) and g1 == g2


def _halves(c, lo, hi):
    return ([None if k is None else k[lo:hi] for k in c.k], [None if v is None else v[lo:hi] for v in c.v],
            c.geometry, c.identity)


def test_save_load_round_trip(model, tmp_path):
    cart = Cartridge.capture(model, IDS[:9], corpus=IDS)
    cart.meta["steps"] = 3
    path = cart.save(tmp_path / "c.safetensors")
    back = Cartridge.load(path)
    assert back.p == 9 and back.frozen == 1 and back.corpus == IDS and back.meta == {"steps": 3}
    assert back.geometry == [tuple(g) for g in layer_geometry(model)]
    for a, b in zip(cart.k + cart.v, back.k + back.v):
        assert (a is None and b is None) or torch.equal(a, b)
    back.check_model(model)


def test_bad_input_is_a_typed_error(model, tmp_path):
    cart = Cartridge.capture(model, IDS[:9])
    path = cart.save(tmp_path / "c.safetensors")
    data = open(path, "rb").read()
    (tmp_path / "cut.safetensors").write_bytes(data[:len(data) - 10])
    with pytest.raises(CartridgeError, match="outside the file|truncated"):
        Cartridge.load(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    with pytest.raises(CartridgeError, match="not JSON"):
        Cartridge.load(tmp_path / "junk.safetensors")
    with pytest.raises(CartridgeError, match="cannot read"):
        Cartridge.load(tmp_path / "absent.safetensors")
    with pytest.raises(CartridgeError, match="no room"):
        cart.write_to_cache(model.init_cache(9))
    full = model.init_cache(32)
    model.forward_step(full, [1, 2], 0)
    with pytest.raises(CartridgeError, match="empty cache"):
        cart.write_to_cache(full)
    other = dict(cart.identity, n_embd=cart.identity["n_embd"] * 2)
    with pytest.raises(CartridgeError, match="another model .*n_embd"):
        Cartridge(cart.k, cart.v, cart.geometry, other).check_model(model)


def test_other_geometry_is_refused(tmp_path):
    a = load_model(write_model(tmp_path / "a.gguf", "llama", hidden=64, heads=4, kv_heads=2, head_dim=16))
    b = load_model(write_model(tmp_path / "b.gguf", "llama", hidden=64, heads=4, kv_heads=4, head_dim=16))
    cart = Cartridge.capture(a, IDS[:5])
    with pytest.raises(CartridgeError, match="does not fit"):
        cart.write_to_cache(b.init_cache(16))
    with pytest.raises(CartridgeError, match="layer 0"):
        cart.check_model(b)
    tensors, meta = read_safetensors(cart.save(tmp_path / "a.safetensors"))
    assert meta["format"] == "fucina.cartridge" and tensors["layers.0.k"].shape == (5, 2, 16)


def test_equiv_cli_on_a_tiny_model(tmp_path, capsys):
    import json

    from fucina.cli.main import main

    path = write_model(tmp_path / "m.gguf", "qwen3", hidden=64, heads=4, kv_heads=1, head_dim=32, layers=2)
    (tmp_path / "doc.txt").write_text("The quick brown fox jumps over the lazy dog. " * 4)
    assert main(["cartridge", "equiv", str(path), "--corpus", str(tmp_path / "doc.txt"), "--p", "40",
                 "--suffix", "8", "--greedy", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["bitwise"] and res["greedy_agree"] == 4 and res["max_abs"] == 0.0
    assert main(["cartridge", "equiv", str(path), "--corpus", str(tmp_path / "doc.txt"), "--p", "400"]) == 1
    assert "the corpus has" in capsys.readouterr().err


REAL = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf",
        "qwen2.5-coder": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL))
def test_equivalence_bitwise_on_real_models(name):
    """The gate on real quantized models (p + suffix inside gemma3's 512 window)."""
    from pathlib import Path

    from fucina.models.cartridge import equivalence
    from fucina.text.tokenizer import Tokenizer

    path = Path.home() / ".cache" / "fucina" / REAL[name]
    if not path.exists():
        pytest.skip(f"{path} absent")
    model = load_model(path)
    tok = Tokenizer.from_metadata(model.gguf.metadata)
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    res = equivalence(model, tok.encode(text, add_special=True), 128, suffix=16, greedy=8)
    assert res["bitwise"] and res["max_abs"] == 0.0 and res["greedy_agree"] == 8
