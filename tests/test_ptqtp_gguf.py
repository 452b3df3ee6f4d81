"""PTQTP persistence: `fucina quantize --ptqtp K` writes each eligible projection as
`<name>.ptqtpN` TQ2_0 planes with everything else byte-verbatim; the loader detects them
and the reloaded model's logits equal the in-memory decorated model's bit for bit; typed
errors for a missing plane, K outside 1..3 and an ineligible tensor asked for."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from fucina.cli import main as cli
from fucina.cli.quantize import _copy_verbatim, decorate, ptqtp_eligible
from fucina.errors import GGUFError, QuantError
from fucina.gguf import GGUFFile
from fucina.gguf.ptqtp import PLANES_KEY, VERSION_KEY, plane_name
from fucina.models import load_model
from fucina.quant.ptqtp import fit, plane_bytes
from synth import write_model

TOKENS = [5, 70, 3, 120, 9, 44, 200, 17]
PROJ = ("wq", "wk", "wv", "wo", "gate", "up", "down")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    # hidden 256: every projection eligible; a 320-wide ffn leaves ffn_down (in-dim 320) out
    return write_model(tmp_path_factory.mktemp("p") / "m.gguf", "qwen3", layers=2, hidden=256, heads=4, kv_heads=2,
                       head_dim=64, ffn=320, seed=5)


@pytest.fixture(scope="module")
def decorated(src, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("p") / "d.gguf")
    return out, decorate(src, out, 2)


def _logits(model) -> torch.Tensor:
    cache = model.init_cache(64)
    return model.forward_step_all_logits(cache, TOKENS, 0)


def test_planes_written_rest_verbatim(src, decorated):
    out, report = decorated
    a, b = GGUFFile(src), GGUFFile(out)
    assert b.metadata[VERSION_KEY] == 1 and b.metadata[PLANES_KEY] == 2
    assert b.metadata["general.name"] == a.metadata["general.name"]
    done = {r["name"] for r in report if r["kept"] is None}
    assert done == {f"blk.{i}.{n}.weight" for i in range(2)
                    for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    for name, t in a.tensors.items():
        if name in done:
            assert name not in b.tensors
            f = fit(t.data.view(np.float32).reshape(-1, t.ne[0]), 2)
            for p in range(2):
                pt = b.tensors[plane_name(name, p)]
                assert pt.ggml_type.name == "TQ2_0" and pt.ne == t.ne
                assert np.array_equal(pt.data.reshape(t.ne[1], -1), plane_bytes(f, p)), name
        else:
            assert b.tensors[name].ggml_type is t.ggml_type and np.array_equal(b.tensors[name].data, t.data), name
    kept = {r["name"]: r["kept"] for r in report if r["kept"] is not None}
    assert kept["blk.0.ffn_down.weight"] == "in-dim 320 is not a multiple of 256"
    assert kept["token_embd.weight"] == "embeddings / head"


def test_reload_gives_the_in_memory_decorated_logits_bitwise(src, decorated):
    from fucina.models import llama
    from fucina.weights.ptqtp import PtqtpWeight

    loaded = load_model(decorated[0])
    L0 = loaded.layers[0]
    assert isinstance(L0.wq, PtqtpWeight) and L0.wq.k == 2 and not isinstance(L0.down, PtqtpWeight)
    assert isinstance(L0.wqkv, PtqtpWeight) and isinstance(L0.w_gate_up, PtqtpWeight)   # re-fused plane-wise
    import fucina.kernels as K
    if K.available():
        assert loaded.native_plan is not None   # the layer step takes the planes
    # decorate the source model in memory: the same solver on the same values
    ref = load_model(src)
    for L in ref.layers:
        for attr in PROJ:
            w = getattr(L, attr)
            if ptqtp_eligible(GGUFFile(src).tensors[w.name]) is None:
                setattr(L, attr, PtqtpWeight.from_fit(fit(w.dequantize(), 2), w.name))
        L.wqkv = llama.fuse(None, [L.wq, L.wk, L.wv])
        L.w_gate_up = llama.fuse(None, [L.gate, L.up])
    ref.native_plan = ref.build_plan()
    a, b = _logits(loaded), _logits(ref)
    assert torch.equal(a, b)
    assert not torch.equal(a, _logits(load_model(src)))   # the planes are in use


def _rewrite(src: str, dst: str, drop: str | None = None, add: tuple[str, str] | None = None) -> str:
    from fucina.train.export import _copy_metadata, write_and_move

    f = GGUFFile(src)
    w = gguf.GGUFWriter(dst + ".tmp", f.architecture)
    _copy_metadata(src, w, None)
    for name, t in f.tensors.items():
        if name != drop:
            _copy_verbatim(w, name, t)
    if add is not None:
        _copy_verbatim(w, add[1], f.tensors[add[0]])
    write_and_move(w, dst + ".tmp", dst)
    return dst


def test_a_missing_plane_is_an_error(decorated, tmp_path):
    bad = _rewrite(decorated[0], str(tmp_path / "x.gguf"), drop=plane_name("blk.1.attn_k.weight", 1))
    with pytest.raises(GGUFError, match=r"blk.1.attn_k.weight lacks plane tensor\(s\) blk.1.attn_k.weight.ptqtp1"):
        load_model(bad)
    bad = _rewrite(decorated[0], str(tmp_path / "y.gguf"), drop=plane_name("blk.0.attn_q.weight", 0))
    with pytest.raises(GGUFError, match="lacks plane"):
        load_model(bad)


def test_a_fourth_plane_is_an_error(decorated, tmp_path):
    q = "blk.0.attn_q.weight"
    bad = _rewrite(decorated[0], str(tmp_path / "x.gguf"), add=(plane_name(q, 0), plane_name(q, 3)))
    with pytest.raises(GGUFError, match="1, 2 or 3 planes"):
        load_model(bad)


@pytest.mark.parametrize("planes", [0, 4])
def test_plane_count_outside_one_to_three_is_refused(src, tmp_path, planes):
    with pytest.raises(QuantError, match="1, 2 or 3 planes"):
        decorate(src, str(tmp_path / "o.gguf"), planes)


def test_an_ineligible_tensor_asked_for_is_refused(src, tmp_path):
    out = str(tmp_path / "o.gguf")
    with pytest.raises(QuantError, match="blk.0.ffn_down.weight cannot be decorated.*in-dim 320"):
        decorate(src, out, 1, only=["blk.0.ffn_down.weight"])
    with pytest.raises(QuantError, match="token_embd.weight cannot be decorated.*embeddings"):
        decorate(src, out, 1, only=["token_embd.weight"])
    report = decorate(src, out, 1, only=["blk.1.attn_v.weight"])
    assert [r["name"] for r in report if r["kept"] is None] == ["blk.1.attn_v.weight"]
    with pytest.raises(QuantError, match="already PTQTP-decorated"):
        decorate(out, str(tmp_path / "p.gguf"), 1)


def test_cli_reports_the_decorated_share(src, tmp_path, capsys):
    out = str(tmp_path / "o.gguf")
    assert cli.main(["quantize", src, out, "--ptqtp", "1", "--tensors", "blk.0.attn_q.weight,blk.0.ffn_up.weight"]) == 0
    text = capsys.readouterr()
    assert "blk.0.attn_q.weight" in text.out and "F32 -> PTQTP1" in text.out and "rel err" in text.out
    assert "kept (not asked for)" in text.out
    assert "2 of" in text.err and "of the model's weights" in text.err and "kept in their format" in text.err
    assert cli.main(["quantize", src, out, "--ptqtp", "5"]) != 0
    assert "1, 2 or 3 planes" in capsys.readouterr().err


def test_lora_on_decorated_weights_is_a_typed_error(decorated):
    from fucina.train.lora import LoRAConfig, LoRAModel
    from fucina.weights.lora import LoRAError
    model = load_model(decorated[0])
    with pytest.raises(LoRAError, match="PTQTP trit-planes"):
        LoRAModel(model, LoRAConfig())
    # refused before anything was swapped: the model still runs as loaded
    assert torch.isfinite(_logits(model)).all()
