"""BitNet b1.58 (the `bitnet` family): the activation choice, and parity with llama.cpp on
random ternary weights (TQ2_0 / TQ1_0 matrices, the sub-norms, the per-matrix scales)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import fucina.kernels as K
import oracle as oracle_mod
from conftest import VOCAB_DIR
from fucina.errors import GGUFError
from fucina.models import load_model
from fucina.models.schema.bitnet import pick_act
from fucina.text.evaluate import teacher_forced_logits
from parity_cases import TEXT
from synth import write_model

Q = gguf.GGMLQuantizationType


def bitnet_synth(path, vocab, qtype=Q.TQ2_0):
    """A random-weight BitNet: every matrix (the tied embeddings too) in qtype, 256-wide."""
    return write_model(path, "bitnet", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512,
                       vocab=str(vocab) if vocab else None, qtype=qtype, seed=19)


def test_activation_follows_the_model_and_the_override(monkeypatch):
    monkeypatch.delenv("FUCINA_BITNET_ACT", raising=False)
    assert pick_act("bitnet_b1_58-3B") == "silu"
    assert pick_act("BitNet b1.58 2B 4T") == "relu2"
    monkeypatch.setenv("FUCINA_BITNET_ACT", "silu")
    assert pick_act("BitNet-b1.58-2B-4T") == "silu"
    monkeypatch.setenv("FUCINA_BITNET_ACT", "gelu")
    with pytest.raises(GGUFError, match="FUCINA_BITNET_ACT"):
        pick_act("x")


def test_relu2_changes_the_ffn_and_runs_natively_per_matmul(tmp_path, monkeypatch):
    path = bitnet_synth(tmp_path / "m.gguf", None)
    ids = [5, 9, 11, 3, 7]
    silu = teacher_forced_logits(load_model(path), ids).numpy()
    monkeypatch.setenv("FUCINA_BITNET_ACT", "relu2")
    model = load_model(path)
    assert model.act == "relu2" and model.native_plan is None
    assert all(w.kernel is not None for w in (model.layers[0].wqkv, model.layers[0].down))
    relu2 = teacher_forced_logits(model, ids).numpy()
    assert np.isfinite(relu2).all() and not np.allclose(silu, relu2)


def _logits(path, ids, native: bool) -> np.ndarray:
    """Teacher-forced logits with the native kernels, or on the exact reference path."""
    K.set_enabled(native)
    try:
        return teacher_forced_logits(load_model(path), ids).numpy()
    finally:
        K.set_enabled(True)


def _cos(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("qtype", [Q.TQ2_0, Q.TQ1_0], ids=lambda t: t.name)
def test_live_closer_to_exact_than_llama_cpp(oracle, tmp_path, qtype):
    """Ternary random weights: ours and llama.cpp's logits against the exact model (the same
    weights in f32 arithmetic); ours at least as close, top-1 agreement with llama.cpp."""
    if not (VOCAB_DIR / "vocab-qwen3.gguf").exists():
        pytest.skip("shared Qwen3 vocab not present")
    path = bitnet_synth(tmp_path / "m.gguf", VOCAB_DIR / "vocab-qwen3.gguf", qtype)
    text = tmp_path / "p.txt"
    text.write_text(TEXT)
    ids = [int(x) for x in oracle_mod.run("llama-tokenize", "-m", path, "-f", str(text), "--ids", "--no-escape",
                                          "--log-disable").strip().strip("[]").split(",")]
    out = tmp_path / "ref.f32"
    oracle_mod.run("llama-logits", path, ",".join(map(str, ids)), str(out))
    ref = np.fromfile(out, dtype="<f4").reshape(len(ids), -1)
    ours, exact = (_logits(path, ids, native) for native in (True, False))
    ours_err, llama_err = 1 - _cos(ours, exact).mean(), 1 - _cos(ref, exact).mean()
    print(f"{qtype.name}: 1 - mean cosine to exact: ours {ours_err:.3e}, llama.cpp {llama_err:.3e}")
    assert ours_err <= 1.05 * llama_err, (ours_err, llama_err)
    assert _cos(ours, ref).min() > 0.99
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.9
