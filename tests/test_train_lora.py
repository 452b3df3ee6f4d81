"""LoRA gradients over frozen quantized weights: against torch autograd on the same model
dequantized to f32, and against finite differences, for every target on every family."""
import gguf
import pytest
import torch

import fucina.kernels as K
from fucina.models import load_model
from fucina.train.forward import loss_sum
from fucina.train.lora import _STEM_TARGET, TARGETS, Adapted, TRAINABLE, LoRAConfig, LoRAError, LoRAModel, input_grad, parse_targets
from synth import ARCHS, write_model

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread (an OpenMP team on a busy machine costs 10-40x here)."""
    n = torch.get_num_threads()
    K.set_threads(1)
    yield
    K.set_threads(n)


@pytest.fixture
def torch_only():
    """The reference path for the whole test: weights made lazily (qwen3moe's per-expert
    views) must not pick up a native kernel after load either."""
    was = K.available()
    K.set_enabled(False)
    yield
    K.set_enabled(was)


def _model(tmp_path, arch, qtype=Q.Q8_0, native=True):
    # gemma4 at 4 layers: the last one stores no K/V and reads layer 1's (shared KV)
    layers = 4 if arch == "gemma4" else 2
    path = write_model(tmp_path / f"{arch}-{qtype.name}.gguf", arch, qtype=qtype, ffn=64, seed=3, layers=layers)
    was = K.available()
    K.set_enabled(native)
    try:
        return load_model(path)
    finally:
        K.set_enabled(was)


def _randomize(lm: LoRAModel, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.params():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _grads(model, cfg, ids, labels, dense, use_checkpoint=True):
    lm = LoRAModel(model, cfg, seed=1, dense=dense)
    try:
        _randomize(lm)
        loss, n = loss_sum(model, ids, labels, use_checkpoint)
        (loss / n).backward()
        return float(loss.detach() / n), {k: v.grad.clone() for k, v in lm.named_params().items()}
    finally:
        lm.detach()


def _batch(n=20, vocab=260, seed=0):
    """20 tokens: past the synth models' sliding window (8) and qwen35's chunked-scan threshold (16)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    labels[:3] = -100   # an unsupervised prompt
    return ids, labels


#: targets a family has no weight for: qwen3moe's and qwen35moe's ffn are experts (kept frozen)
#: and deepseek2's MLA has no attn_v (its joint K/V latent attn_kv_a_mqa counts as "k")
ABSENT = {"qwen3moe": {"gate", "up", "down"}, "qwen35moe": {"gate", "up", "down"}, "deepseek2": {"v"},
          "gpt-oss": {"gate", "up", "down"}, "deepseek4": {"v", "gate", "up", "down"}}


@pytest.mark.parametrize("arch", TRAINABLE)
def test_grads_match_dense_autograd_every_target(tmp_path, arch, torch_only):
    """Reference path (no native kernels): the quantized route and the dequantized-f32 peer
    compute the same function, so their gradients agree to f32 rounding."""
    model = _model(tmp_path, arch, Q.Q8_0, native=False)
    cfg = LoRAConfig(rank=4, alpha=8, targets=list(TARGETS))
    ids, labels = _batch()
    l1, g1 = _grads(model, cfg, ids, labels, dense=False)
    l2, g2 = _grads(model, cfg, ids, labels, dense=True, use_checkpoint=False)
    assert abs(l1 - l2) < 1e-4
    assert set(g1) == set(g2)
    covered = {_STEM_TARGET[k.split(".")[2]] for k in g1}
    assert covered == set(TARGETS) - ABSENT.get(arch, set())
    for k in g1:
        assert torch.allclose(g1[k], g2[k], rtol=1e-3, atol=1e-5), k
        assert g1[k].abs().max() > 0, k


#: kimi-k3's int8-activation gradients sit further from the f32 ones: lowest cosine 0.987 (its
#: MLA layer's kv_a), where kimi-linear and deepseek2 stay >= 0.998; probably its residual bank,
#: which mixes every earlier layer's output into each layer's input (one rounding reaches all)
NATIVE_COS = {"kimi-k3": 0.98}


@pytest.mark.parametrize("arch", TRAINABLE)
def test_grads_native_kernels_close_to_dense(tmp_path, arch):
    """Native kernels quantize activations to int8 in the forward: gradients stay close."""
    if not K.available():
        pytest.skip("native kernels not built")
    model = _model(tmp_path, arch, Q.Q4_1, native=True)
    cfg = LoRAConfig(rank=4, alpha=8, targets=list(TARGETS))
    ids, labels = _batch()
    _, g1 = _grads(model, cfg, ids, labels, dense=False)
    _, g2 = _grads(model, cfg, ids, labels, dense=True)
    for k in g1:
        cos = torch.nn.functional.cosine_similarity(g1[k].flatten(), g2[k].flatten(), dim=0)
        assert cos > NATIVE_COS.get(arch, 0.99), (k, float(cos))


class HeldRouting:
    """A MoE router whose expert choice, after the first (recording) pass, is the one that
    pass made, call by call: the top-k selection is piecewise constant, so a finite
    difference across a flip measures the jump, not the derivative autograd computes. The
    choice is pinned through Routing's own selection-only bias; the weights stay the gate's."""

    def __init__(self, routing):
        self.routing, self.held, self.at = routing, [], None

    def __call__(self, logits, bias=None):
        if self.at is None:
            ids, w = self.routing(logits, bias)
            self.held.append(ids)
            return ids, w
        ids, self.at = self.held[self.at], self.at + 1
        pin = torch.zeros(logits.shape).scatter_(1, ids, 1e4)
        return self.routing(logits, pin if bias is None else bias + pin)


def _hold_routing(model, monkeypatch) -> HeldRouting | None:
    owner = model if hasattr(model, "routing") else model.config
    if getattr(owner, "routing", None) is None:
        return None
    held = HeldRouting(owner.routing)
    monkeypatch.setattr(owner, "routing", held)
    return held


@pytest.mark.parametrize("arch", TRAINABLE)
def test_grads_match_finite_differences(tmp_path, arch, torch_only, monkeypatch):
    """Every adapted projection of every layer (gemma4's shared-KV source included: its
    K gradient sums both layers' use), the largest-gradient entry of its A and of its B.
    eps 1e-3: qwen35's L2-normed DeltaNet q/k curve enough that 1e-2 is 10% off there.
    MoE families: the expert choice held at the unperturbed one (HeldRouting)."""
    model = _model(tmp_path, arch, Q.Q8_0, native=False)
    cfg = LoRAConfig(rank=2, alpha=4, targets=list(TARGETS))
    ids, labels = _batch()
    held = _hold_routing(model, monkeypatch)
    lm = LoRAModel(model, cfg, seed=1)
    try:
        _randomize(lm)
        loss, n = loss_sum(model, ids, labels, "off")
        (loss / n).backward()
        for name, p in lm.named_params().items():
            j = int(p.grad.abs().argmax())
            eps = 1e-3
            vals = []
            with torch.no_grad():
                for sgn in (1, -1):
                    p.view(-1)[j] += sgn * eps
                    if held is not None:
                        held.at = 0
                    lo, c = loss_sum(model, ids, labels, False)
                    vals.append(float(lo / c))
                    p.view(-1)[j] -= sgn * eps
            fd = (vals[0] - vals[1]) / (2 * eps)
            an = float(p.grad.view(-1)[j])
            assert abs(fd - an) <= 2e-2 * abs(an) + 1e-3, (name, fd, an)
    finally:
        lm.detach()


def test_delta_net_chunked_scan_gradients_equal_sequential():
    """qwen35's prefill route (the chunked WY scan) is differentiable and its gradients are
    the token-by-token recurrence's."""
    from fucina.models import delta_net
    g = torch.Generator().manual_seed(0)
    m, H, dk, dv = 70, 2, 8, 4     # two chunks, the second padded

    def inputs():
        q = delta_net.l2_norm(torch.randn(m, H, dk, generator=g), 1e-6)
        k = delta_net.l2_norm(torch.randn(m, H, dk, generator=g), 1e-6)
        return [q, k, torch.randn(m, H, dv, generator=g), -torch.rand(m, H, generator=g),
                torch.rand(m, H, generator=g), torch.randn(H, dk, dv, generator=g) * 0.1]
    leaves = [t.requires_grad_() for t in inputs()]
    w = torch.randn(m, H, dv, generator=g)
    grads = []
    for scan in (delta_net.sequential, delta_net.chunked):
        o, s = scan(*leaves)[:2]
        grads.append(torch.autograd.grad((o * w).sum() + s.sum(), leaves))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_input_grad_chunks_equal_dense(tmp_path, monkeypatch):
    import fucina.train.lora as lora
    model = _model(tmp_path, "llama", Q.Q4_1, native=True)
    w = model.output
    dy = torch.randn(5, w.out_features)
    ref = dy @ w.dequantize()
    monkeypatch.setattr(lora, "_ROW_CHUNK_BYTES", 4 * w.in_features * 7)   # 7-row chunks
    assert torch.allclose(input_grad(w, dy), ref, rtol=1e-5, atol=1e-5)


def test_detach_restores_model_and_native_step(tmp_path):
    model = _model(tmp_path, "qwen3")
    ids = torch.arange(6)
    before = model.forward_last_logits(ids.tolist())
    native = model.use_native_step
    lm = LoRAModel(model, LoRAConfig(rank=2, targets="all"))
    assert model.use_native_step is False
    lm.detach()
    assert model.use_native_step is native
    assert torch.equal(model.forward_last_logits(ids.tolist()), before)


def test_dropout_deterministic_per_step(tmp_path):
    model = _model(tmp_path, "llama", native=False)
    lm = LoRAModel(model, LoRAConfig(rank=2, dropout=0.5, targets="q,v"), seed=5)
    try:
        _randomize(lm)
        ids, labels = _batch()
        lm.state.training = True

        def loss_at(step):
            lm.state.step = step
            with torch.no_grad():
                return float(loss_sum(model, ids, labels)[0])
        a, b, c = loss_at(0), loss_at(0), loss_at(1)
        assert a == b and a != c
    finally:
        lm.detach()


def test_config_errors():
    with pytest.raises(LoRAError, match="unknown LoRA target"):
        parse_targets("q,x")
    with pytest.raises(LoRAError, match="rank"):
        LoRAConfig(rank=0)
    with pytest.raises(LoRAError, match="dropout"):
        LoRAConfig(dropout=1.0)
    assert parse_targets("v,q") == ["q", "v"]


def test_q8_transposed_equals_quantized_transpose():
    """W^T encoded in row chunks == W^T encoded whole (2080 rows: two full chunks + a tail)."""
    from fucina.gguf import GGMLType
    from fucina.kernels import attach
    from fucina.quant import quantize
    from fucina.train.lora import Frozen
    from fucina.weights import LinearWeight
    if not K.available():
        pytest.skip("native kernels not built")
    dense = torch.randn(2080, 64, generator=torch.Generator().manual_seed(0))
    w = LinearWeight(quantize(dense, int(GGMLType.Q4_1)).reshape(-1), GGMLType.Q4_1, 2080, 64, "w")
    attach(w)
    f = Frozen(w)
    assert f.mode == "q8"
    ref = quantize(w.dequantize().T.contiguous(), int(GGMLType.Q8_0))
    assert torch.equal(f.transposed().raw.reshape(-1), ref.reshape(-1))
    dy = torch.randn(3, 2080)
    cos = torch.nn.functional.cosine_similarity(f.input_grad(dy).flatten(), (dy @ w.dequantize()).flatten(), 0)
    assert cos > 0.999


def test_fused_in_file_weights_write_one_llama_cpp_pair(tmp_path):
    """phi3 stores Q/K/V as one attn_qkv and [gate | up] as one ffn_up: LoRA on some of the
    parts adapts slices of the fused output, and the adapter file holds one pair per fused
    tensor (rank r * parts) whose llama.cpp delta, B A * alpha / rank, is what training added."""
    from fucina.train.adapters import read_adapter, write_adapter
    model = _model(tmp_path, "phi3", Q.Q8_0, native=False)
    cfg = LoRAConfig(rank=2, alpha=4, targets=["q", "v", "up", "down"])
    lm = LoRAModel(model, cfg, seed=1)
    try:
        _randomize(lm)
        pairs = lm.file_pairs()
        assert "blk.0.attn_qkv.weight" in pairs and "blk.0.attn_q.weight" not in pairs
        assert pairs["blk.0.attn_qkv.weight"][0].shape[0] == 4      # q and v: 2 x rank 2
        assert pairs["blk.0.ffn_up.weight"][0].shape[0] == 2        # up only
        ad = read_adapter(write_adapter(tmp_path / "a.gguf", model.config.arch, cfg.alpha, pairs))
        x = torch.randn(5, model.config.n_embd)
        L = model.layers[0]
        with torch.no_grad():
            for adapted in (L.wqkv, L.w_gate_up, L.down):
                got = adapted(x) - adapted.base(x)
                want = x @ ad.delta(adapted.name).T
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), adapted.name
            q, k, v = (L.wqkv(x) - L.wqkv.base(x)).split(L.split_qkv, dim=-1)
            assert k.abs().max() == 0 and q.abs().max() > 0 and v.abs().max() > 0
    finally:
        lm.detach()


def test_checkpoint_modes_give_the_same_gradients(tmp_path):
    """Keeping the frozen matmuls' outputs (keep-matmul) or every activation (off) changes
    what is recomputed, not what is computed."""
    model = _model(tmp_path, "llama", Q.Q4_1, native=True)
    cfg = LoRAConfig(rank=4, alpha=8, targets=list(TARGETS))
    ids, labels = _batch(16)
    runs = {m: _grads(model, cfg, ids, labels, dense=False, use_checkpoint=m)
            for m in ("full", "keep-matmul", "off")}
    l0, g0 = runs["full"]
    for mode, (l1, g1) in runs.items():
        assert l1 == l0, mode
        for k in g0:
            assert torch.equal(g1[k], g0[k]), (mode, k)
    with pytest.raises(Exception, match="checkpointing mode"):
        loss_sum(model, ids, labels, "sometimes")


def test_auto_checkpoint_follows_the_activation_budget(tmp_path, monkeypatch):
    import fucina.train.forward as fw
    model = _model(tmp_path, "llama", Q.Q8_0, native=False)
    per_row = fw.activation_bytes(model, 100)
    assert per_row > 100 * model.config.n_layer * model.config.n_embd * 4   # > the layer inputs alone
    monkeypatch.setattr(fw, "AUTO_BUDGET_BYTES", per_row)
    assert fw.checkpoint_mode("auto", model, 100) == "off"
    assert fw.checkpoint_mode(True, model, 101) == "keep-matmul"


def test_untrained_families_are_refused(tmp_path, monkeypatch):
    """A family whose training forward is not verified raises instead of training wrong."""
    import fucina.train.lora as lora
    monkeypatch.setattr(lora, "TRAINABLE", ("llama",))
    model = _model(tmp_path, "qwen3", Q.Q8_0, native=False)
    with pytest.raises(LoRAError, match="not supported yet"):
        LoRAModel(model, LoRAConfig(rank=2, alpha=4))


def test_targets_the_model_lacks_are_an_error(tmp_path):
    model = _model(tmp_path, "qwen3moe", Q.Q8_0, native=False)
    before = model.use_native_step
    with pytest.raises(LoRAError, match="routed experts stay frozen"):
        LoRAModel(model, LoRAConfig(rank=2, targets="gate,up,down"))
    assert model.use_native_step is before and not isinstance(model.output, Adapted)   # restored


def test_every_loaded_family_trains():
    """Every family a test writes is in the list the gradient tests above run over."""
    assert set(TRAINABLE) == set(ARCHS)


def test_a_family_off_the_list_is_refused(tmp_path, monkeypatch):
    """A family added to the loader before its gradients are checked is refused, typed."""
    import fucina.train.lora as lora
    model = _model(tmp_path, "llama")
    monkeypatch.setattr(lora, "TRAINABLE", tuple(a for a in TRAINABLE if a != "llama"))
    with pytest.raises(LoRAError, match="not supported yet"):
        LoRAModel(model, LoRAConfig(rank=4, alpha=8))


@pytest.mark.parametrize("arch", TRAINABLE)
def test_written_adapter_merged_equals_training_forward(tmp_path, arch, torch_only):
    """finetune -> adapter.gguf -> --lora, every family: the file's pairs (file names: phi3's
    and qwen35's fused attn_qkv, deepseek2's MLA projections one object down), merged F32 at
    inference, give the logits the training forward computed with the adapters unmerged."""
    from fucina.gguf import GGMLType
    from fucina.train.adapters import apply_adapters, read_adapter, write_adapter
    model = _model(tmp_path, arch, Q.Q8_0, native=False)
    ids = _batch()[0].tolist()
    lm = LoRAModel(model, LoRAConfig(rank=2, alpha=4, targets="all"), seed=1)
    _randomize(lm)
    with torch.no_grad():
        want = model.forward_step_all_logits(model.init_cache(32), ids, 0)
    path = write_adapter(tmp_path / "a.gguf", model.config.arch, 4.0, lm.file_pairs())
    lm.detach()
    with torch.no_grad():
        plain = model.forward_step_all_logits(model.init_cache(32), ids, 0)
    assert apply_adapters(model, [(read_adapter(path), 1.0)], GGMLType.F32) == len(lm.file_pairs())
    with torch.no_grad():
        got = model.forward_step_all_logits(model.init_cache(32), ids, 0)
    effect = float((want - plain).abs().max())
    assert effect > 0.1
    # the f16 KV cache rounds the two routes' (f32-equal) keys apart by ~1e-3 at most
    assert float((got - want).abs().max()) < 0.01 * effect, (float((got - want).abs().max()), effect)


@pytest.mark.parametrize("arch", TRAINABLE)
def test_training_forward_equals_inference(tmp_path, arch, torch_only):
    """The training forward (TrainCache: flash attention, causal or windowed, GQA unrepeated;
    shared-KV and recurrent layers from the model's own layout) computes inference's loss."""
    model = _model(tmp_path, arch, Q.Q8_0, native=False)
    ids, labels = _batch()
    with torch.no_grad():
        loss, n = loss_sum(model, ids, labels, "off")
        logits = model.forward_step_all_logits(model.init_cache(32), ids.tolist(), 0)
    keep = labels >= 0
    ref = torch.nn.functional.cross_entropy(logits[keep].float(), labels[keep], reduction="sum")
    assert n == int(keep.sum()) and abs(float(loss) - float(ref)) < 1e-3 * float(ref), (float(loss), float(ref))


def test_kimi_linear_fused_qkv_file_adapts_q_k_v_slices(tmp_path, torch_only):
    """A kimi-linear file storing its KDA q/k/v as one attn_qkv: q, k and v adapt its slices,
    gradients as the dense peer's, and the adapter file names attn_qkv (phi3's layout)."""
    from synth_kimi import write_kimi
    model = load_model(write_kimi(tmp_path / "f.gguf", seed=2, layers=2, mla_layers=(1,), fused_qkv=True))
    cfg = LoRAConfig(rank=2, alpha=4, targets=["q", "k", "v"])
    ids, labels = _batch()
    l1, g1 = _grads(model, cfg, ids, labels, dense=False)
    l2, g2 = _grads(model, cfg, ids, labels, dense=True, use_checkpoint=False)
    assert abs(l1 - l2) < 1e-4
    assert {f"blk.0.{s}.weight.lora_a" for s in ("attn_q", "attn_k", "attn_v")} <= set(g1)
    for k in g1:
        assert torch.allclose(g1[k], g2[k], rtol=1e-3, atol=1e-5), k
    lm = LoRAModel(model, cfg, seed=1)
    try:
        assert "blk.0.attn_qkv.weight" in lm.file_pairs()
    finally:
        lm.detach()
