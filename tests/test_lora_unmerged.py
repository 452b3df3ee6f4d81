"""Unmerged LoRA (weights/lora.py LoRALinear): the frozen weight keeps its GGUF type and the
native step adds B (A x) in f32 after its matmul (csrc/generic/step_impl.inc step_lora)."""
import gguf
import pytest
import torch

import fucina.kernels as K
from fucina.gguf import GGMLType
from fucina.kernels import KernelError
from fucina.models import load_model
from fucina.train.adapters import apply_adapters, read_adapter, write_adapter
from fucina.weights.lora import LoRAError, LoRALinear
from synth import write_model
from test_batch_invariance import check_batch_rows_equal_alone

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

IDS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 33, 200, 11, 12, 13, 14, 150, 151, 152, 9]
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _model(tmp_path, qtype):
    return load_model(write_model(tmp_path / f"m-{qtype.name}.gguf", "llama", qtype=qtype, seed=3))


def _adapter(tmp_path, model, rank, seed, name="a"):
    """Every projection of every layer adapted, with random A and B big enough to matter."""
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for i, L in enumerate(model.layers):
        for t in TARGETS:
            w = next(w for _, _, w in _slots(L) if w.name == f"blk.{i}.{t}.weight")
            pairs[w.name] = (torch.randn(rank, w.in_features, generator=g) * 0.3,
                             torch.randn(w.out_features, rank, generator=g) * 0.3)
    return read_adapter(write_adapter(tmp_path / f"{name}.gguf", "llama", 2.0 * rank, pairs))


def _slots(L):
    from fucina.weights.lora import weight_slots
    return weight_slots(L)


def _logits(model, native):
    model.use_native_step = native
    try:
        with torch.no_grad():
            return model.forward_step_all_logits(model.init_cache(32), IDS, 0)
    finally:
        model.use_native_step = True


def test_unmerged_native_equals_torch_and_merged_f32(tmp_path):
    """Two adapters (ranks concatenate, each scale folded in) on every projection, fused
    QKV and gate/up included: the native step == the torch path (x W^T + (x A^T) Bt) ==
    the adapters merged into F32 weights, on F32 weights (the same float arithmetic)."""
    model = _model(tmp_path, Q.F32)
    plain = _logits(model, True)
    ads = [(_adapter(tmp_path, model, 4, 1, "a"), 0.7), (_adapter(tmp_path, model, 3, 2, "b"), -0.4)]
    assert apply_adapters(model, ads) == 7 * len(model.layers)
    L = model.layers[0]
    assert isinstance(L.wqkv, LoRALinear) and isinstance(L.w_gate_up, LoRALinear)
    assert L.wqkv.lora[0].shape[0] == 3 * 7 and L.wq.qtype is GGMLType.F32   # frozen, unmerged
    assert model.native_plan is not None
    native, torch_path = _logits(model, True), _logits(model, False)
    effect = float((native - plain).abs().max())
    assert effect > 0.5
    assert float((native - torch_path).abs().max()) < 1e-4 * effect
    merged = _model(tmp_path, Q.F32)
    apply_adapters(merged, ads, GGMLType.F32)
    assert float((native - _logits(merged, True)).abs().max()) < 1e-4 * effect


def test_unmerged_parts_quantized_close_to_merged(tmp_path):
    """Separate q/k/v and gate/up weights (no fused copy) on Q8_0: each part's own LoRA. The
    native step == the torch path (the same matmul kernel plus the f32 LoRA), and it is as
    far from the exact figure (merged F32) as the frozen model is from its own F32 copy
    (the int8 activation rounding of the frozen weight's matmul)."""
    def parts_model(ads=(), merge=None):
        model = _model(tmp_path, Q.Q8_0)
        for L in model.layers:
            L.wqkv = L.w_gate_up = None
        if ads:
            apply_adapters(model, ads, merge)
            assert model.native_plan is not None and model.layers[0].wqkv is None
            assert isinstance(model.layers[0].wq, LoRALinear) == (merge is None)
        return _logits(model, True), model

    plain, model = parts_model()
    routes = float((_logits(model, False) - plain).abs().max())   # ISA's prefill vs per-weight route
    ad = _adapter(tmp_path, model, 4, 5)
    usual = float((parts_model([(ad, 0.0)], GGMLType.F32)[0] - plain).abs().max())
    ours, model = parts_model([(ad, 0.05)])
    exact, _ = parts_model([(ad, 0.05)], GGMLType.F32)
    effect = float((exact - plain).abs().max())
    path = float((ours - _logits(model, False)).abs().max())
    assert effect > 0.5 and path < 3 * routes + 1e-4 * effect, (path, routes, effect)
    err = float((ours - exact).abs().max())
    assert err < 3 * usual, (err, usual, effect)


def test_unmerged_batch_rows_equal_alone(tmp_path):
    model = _model(tmp_path, Q.Q4_0)
    apply_adapters(model, [(_adapter(tmp_path, model, 8, 3), 1.0)])
    assert isinstance(model.layers[0].wqkv, LoRALinear) and model.native_plan is not None
    check_batch_rows_equal_alone(model, IDS, "default")
    # and a prompt's rows equal the same tokens stepped one at a time
    c1, c2 = model.init_cache(32), model.init_cache(32)
    with torch.no_grad():
        whole = model.forward_step_all_logits(c1, IDS[:6], 0)
        one = torch.cat([model.forward_step_all_logits(c2, [t], p) for p, t in enumerate(IDS[:6])])
    assert torch.equal(whole, one)


def test_bad_loras_are_typed_errors(tmp_path, monkeypatch):
    model = _model(tmp_path, Q.F32)
    c, L = model.config, model.layers[0]
    layer = model.plan_layer(0, L)

    def build(**kw):
        K.DecoderPlan.build(n_embd=c.n_embd, n_ff=c.n_ff, n_rot=c.n_rot, neox=False, act="silu",
                            eps=1e-6, scale=0.25, layers=[dict(layer, **kw)])

    n, k = L.wo.out_features, L.wo.in_features
    for a, bt in ((torch.zeros(4, k + 1), torch.zeros(4, n)),        # A of the wrong width
                  (torch.zeros(4, k), torch.zeros(3, n)),            # ranks disagree
                  (torch.zeros(4, k, dtype=torch.float64), torch.zeros(4, n)),
                  (torch.zeros(0, k), torch.zeros(0, n))):           # rank 0
        bad = LoRALinear(L.wo, a, bt)
        bad.lora = (a, bt)   # as given, not converted
        with pytest.raises(KernelError, match="LoRA"):
            build(wo=bad)
    # the C side's own check, past Python's: a rank without its B, and a rank out of range
    ok = LoRALinear(L.wo, torch.zeros(4, k), torch.zeros(4, n))
    for slots in ([ok.lora[0].data_ptr(), 0, 4], [ok.lora[0].data_ptr(), ok.lora[1].data_ptr(), 5000]):
        monkeypatch.setattr(K, "_lora_slots", lambda name, w, keep, s=slots: s if w is ok else [0, 0, 0])
        with pytest.raises(KernelError, match="layer 0"):
            build(wo=ok)
    monkeypatch.undo()
    big = {"blk.0.attn_q.weight": (torch.zeros(1025, c.n_embd), torch.zeros(L.wq.out_features, 1025))}
    with pytest.raises(LoRAError, match="total rank"):
        apply_adapters(model, [(read_adapter(write_adapter(tmp_path / "big.gguf", "llama", 1.0, big)), 1.0)])
