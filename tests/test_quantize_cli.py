"""`fucina quantize`: every eligible matrix re-encoded exactly as fucina.quant.quantize
encodes its values, everything else byte-verbatim, a report row a tensor, typed errors."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import oracle as oracle_mod
from fucina.cli import main as cli
from fucina.cli.quantize import HEAD, TYPES, requantize
from fucina.errors import QuantError
from fucina.gguf import GGMLType as T, GGUFFile
from fucina.quant import ENCODABLE, dequantize, quantize
from synth import write_model


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("q") / "m.gguf", "qwen3", layers=1, hidden=256, heads=4, kv_heads=2,
                       head_dim=64, ffn=512, seed=3)


def test_types_are_the_encodable_ones():
    assert set(TYPES) == {t.name for t in ENCODABLE}


@pytest.mark.parametrize("qt", [T.TQ2_0, T.TQ1_0])
def test_matrices_reencoded_rest_verbatim(f32_model, tmp_path, qt):
    out = str(tmp_path / "o.gguf")
    report = requantize(f32_model, out, qt.name)
    src, dst = GGUFFile(f32_model), GGUFFile(out)
    assert set(dst.tensors) == set(src.tensors) and dst.metadata["general.name"] == src.metadata["general.name"]
    rows = {r["name"]: r for r in report}
    done = 0
    for name, t in src.tensors.items():
        d, r = dst.tensors[name], rows[name]
        if len(t.ne) == 2 and name not in HEAD:
            want = quantize(t.data.view(np.float32).reshape(-1, t.ne[0]), int(qt))
            assert d.ggml_type is qt and np.array_equal(d.data.reshape(want.shape), want), name
            back = dequantize(want.reshape(-1), qt, t.n_elements)
            ref = t.data.view(np.float32)
            assert r["rel_err"] == pytest.approx(np.linalg.norm(back.numpy() - ref) / np.linalg.norm(ref), rel=1e-4)
            done += 1
        else:
            assert d.ggml_type is t.ggml_type and np.array_equal(d.data, t.data) and r["kept"], name
    assert done == 7


def test_named_tensors_only_and_ineligible_ones_refused(f32_model, tmp_path):
    out = str(tmp_path / "o.gguf")
    report = requantize(f32_model, out, "Q8_0", only=["blk.0.ffn_down.weight"])
    assert [r["name"] for r in report if r["kept"] is None] == ["blk.0.ffn_down.weight"]
    with pytest.raises(QuantError, match="blk.0.attn_norm.weight cannot be encoded"):
        requantize(f32_model, out, "Q8_0", only=["blk.0.attn_norm.weight"])
    with pytest.raises(QuantError, match="no tensor named nope"):
        requantize(f32_model, out, "Q8_0", only=["nope"])
    with pytest.raises(QuantError, match="overwrite"):
        requantize(f32_model, f32_model, "Q8_0")


def test_cli_prints_the_report(f32_model, tmp_path, capsys):
    out = str(tmp_path / "o.gguf")
    assert cli.main(["quantize", f32_model, out, "--type", "tq2_0"]) == 0
    text = capsys.readouterr()
    assert "blk.0.ffn_up.weight" in text.out and "F32 -> TQ2_0" in text.out and "rel err" in text.out
    assert "7 of" in text.err and "as TQ2_0" in text.err


@pytest.mark.oracle
@pytest.mark.parametrize("qt", [T.TQ2_0, T.TQ1_0])
def test_same_bytes_as_llama_quantize(oracle, f32_model, tmp_path, qt):
    ours, theirs = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    requantize(f32_model, ours, qt.name)
    oracle_mod.run("llama-quantize", f32_model, theirs, qt.name)
    a, b = GGUFFile(ours), GGUFFile(theirs)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        assert b.tensors[name].ggml_type is qt and np.array_equal(a.tensors[name].data, b.tensors[name].data), name
