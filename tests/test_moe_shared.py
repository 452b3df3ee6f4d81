"""The native step's MoE ffn with a shared expert (csrc/generic/moe_shared_impl.inc) on
qwen35moe (a sigmoid-gated SwiGLU shared expert beside the routed ones, under qwen35's
DeltaNet and gated-attention mixers) and gemma4's MoE layers (the dense FFN as shared
expert, each half with its own norms, the router on its own scaled input, per-expert
scales; separate or fused gate_up stacks): the plan against the torch blocks, batch
invariance (a prompt split any way, a batch row against its stream alone, on every ISA),
the expert store streaming through the plan, and the plan's checks. Against llama.cpp: test_parity (qwen35moe-synth) and
test_gemma4 (test_live_moe_matches_llama_cpp), which run this step now."""
import gguf
import pytest
import torch

import fucina.kernels as K
from fucina.models import load_model
from fucina.models.expert_store import stream_experts
from synth import write_model
from synth_gemma4 import write_gemma4
from test_batch_invariance import _prefill, _same_cache, check_batch_rows_equal_alone

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built")

Q = gguf.GGMLQuantizationType
IDS = [(7 * i * i + 3 * i + 5) % 250 + 1 for i in range(48)]
QWEN35MOE = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, experts=8, experts_used=2,
                 moe_ffn=32, seed=11)
# gemma4's MoE shape in miniature: a local and a global layer, per-layer FFN widths
GEMMA4MOE = dict(layers=2, hidden=128, heads=4, kv_heads=[2, 1], head_dim=64, head_dim_swa=32, ffn=[128, 256],
                 window=16, shared=0, ple=0, seed=5, experts=8, experts_used=2, moe_ffn=64)


def _write(tmp_path, family: str, qtype, **kw) -> str:
    if family == "qwen35moe":
        return write_model(tmp_path / "q.gguf", "qwen35moe", qtype=qtype, **{**QWEN35MOE, **kw})
    fused = dict(fused_experts=True) if family == "gemma4-fused" else {}
    return write_gemma4(tmp_path / "g.gguf", qtype=qtype, **{**GEMMA4MOE, **fused, **kw})


def _run(m, native: bool):
    """A 40-row prefill, then 8 decode steps: every row's logits."""
    m.use_native_step = native
    try:
        c = m.init_cache(64)
        a = m.forward_step_all_logits(c, IDS[:40], 0)
        d = torch.stack([m.forward_step(c, [t], 40 + i) for i, t in enumerate(IDS[40:48])])
        return torch.cat([a, d])
    finally:
        m.use_native_step = True


@pytest.mark.parametrize("family", ["qwen35moe", "gemma4", "gemma4-fused"])
def test_plan_equals_torch_blocks(tmp_path, family):
    """F32 weights (on a quantized file float noise can flip an activation's int8 rounding),
    past gemma4's 16-token window: the tolerance qwen35's plan test uses, and every row's
    logits as close as the other families' (cosine > 0.999)."""
    m = load_model(_write(tmp_path, family, Q.F32))
    assert m.native_plan is not None and m.native_plan.n_layer == 2
    native, ref = _run(m, True), _run(m, False)
    torch.testing.assert_close(native, ref, rtol=1e-3, atol=1e-3)
    cos = torch.nn.functional.cosine_similarity(native.double(), ref.double(), dim=-1)
    assert cos.min() > 0.999


@pytest.mark.parametrize("family", ["qwen35moe", "gemma4"])
def test_the_shared_half_counts(tmp_path, family):
    """Each optional piece moves the logits: the shared expert's gate (qwen35moe) or the
    per-expert scales (gemma4) zeroed, the plan's logits change and still equal torch's."""
    m = load_model(_write(tmp_path, family, Q.F32))
    before = _run(m, True)
    for L in m.layers:
        if family == "qwen35moe":
            L.ffn_gate_inp_shexp = torch.full_like(L.ffn_gate_inp_shexp, -1e4)   # sigmoid -> 0: no shared expert
        else:
            L.expert_scale = torch.zeros_like(L.expert_scale)                    # no routed experts
    m.native_plan = m.build_plan()
    after = _run(m, True)
    assert not torch.allclose(before, after, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(after, _run(m, False), rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module", params=["qwen35moe", "gemma4", "gemma4-fused"])
def q8_model(request, tmp_path_factory):
    return load_model(_write(tmp_path_factory.mktemp(request.param), request.param, Q.Q8_0))


def test_prompt_split_any_way_equals_one_call(q8_model, isa):
    """Batch invariance: a prompt past the window split any way gives the bits of one call."""
    m, ids = q8_model, IDS[:37]
    whole, c0 = _prefill(m, ids, [37], capacity=64)
    for chunks in ([1] * 37, [9, 1, 1, 6, 2, 18]):
        got, c1 = _prefill(m, ids, chunks, capacity=64)
        assert torch.equal(got, whole), f"{chunks} on {isa}"
        _same_cache(c1, c0)


def test_batch_rows_equal_streams_alone(q8_model, isa):
    check_batch_rows_equal_alone(q8_model, IDS, isa)


@pytest.mark.parametrize("family", ["qwen35moe", "gemma4"])
def test_streamed_experts_equal_resident(tmp_path, family):
    """The expert store under a budget that evicts: the rebuilt plan calls it, and every
    row's logits are the resident plan's, bitwise."""
    check_streamed_equals_resident(_write(tmp_path, family, Q.Q8_0))


def check_streamed_equals_resident(path):
    """The file's model under a 60% expert budget against it resident: the same bits, some
    experts evicted; the streamed model."""
    want = _run(load_model(path), True)
    m = load_model(path)
    store = stream_experts(m, "60%")
    assert m.native_plan is not None
    assert torch.equal(_run(m, True), want)
    rep = store.report()
    assert rep["evictions"] > 0 and rep["errors"] == []
    return m


def test_plan_checks_the_shared_expert(tmp_path):
    m = load_model(_write(tmp_path, "qwen35moe", Q.Q8_0))
    layers = [m.plan_layer(i, L) for i, L in enumerate(m.layers)]
    c, spec = m.config, m.native_plan._spec
    build = dict(n_embd=c.n_embd, n_ff=spec["n_ff"], n_rot=c.n_rot, neox=True, act="silu", eps=c.rms_eps,
                 scale=spec["scale"])
    assert K.DecoderPlan.build(**build, layers=layers) is not None
    bad = dict(layers[0], down=None)                   # a gate without its shared expert
    with pytest.raises(K.KernelError, match="layer 0"):
        K.DecoderPlan.build(**build, layers=[bad, layers[1]])
    bad = dict(layers[0], up=layers[0].get("gate_up"), gate_up=None)   # fused and parts mixed up
    with pytest.raises(K.KernelError):
        K.DecoderPlan.build(**build, layers=[bad, layers[1]])
    bad = dict(layers[0], exp_scale=torch.ones(c.n_expert + 1))
    with pytest.raises(K.KernelError, match="exp_scale"):
        K.DecoderPlan.build(**build, layers=[bad, layers[1]])
    bad = dict(layers[0], shexp_gate=torch.ones(c.n_embd, dtype=torch.float64))
    with pytest.raises(K.KernelError, match="shexp_gate"):
        K.DecoderPlan.build(**build, layers=[bad, layers[1]])


def test_plan_checks_the_fused_stack_views(tmp_path):
    """gemma4's fused gate_up stack: its views must span the strided experts exactly."""
    m = load_model(_write(tmp_path, "gemma4-fused", Q.F32))
    spec = m.native_plan._spec
    layers = spec["layers"]
    assert layers[0]["exps_stride"] == 2 * layers[0]["n_ff_exp"]
    for bad in (dict(exps_stride=layers[0]["n_ff_exp"] - 1), dict(exps_stride=3 * layers[0]["n_ff_exp"])):
        with pytest.raises(K.KernelError, match="layer 0"):
            K.DecoderPlan.build(**dict(spec, layers=[dict(layers[0], **bad), layers[1]]))
