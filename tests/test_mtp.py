"""Multi-token prediction: the NextN block (models/mtp.py) against an independent numpy
formulation of llama.cpp's nextn graph (glm4-moe.cpp `graph_mtp`), the drafter's
incremental head cache against a fresh computation, and speculative streams drafted by
the head equal to the plain ones (greedy and seeded, raw completion and chat)."""
import gguf
import numpy as np
import pytest
import torch

from fucina.models import load_model, mtp
from fucina.text.api import load
from fucina.text.speculative import cascade
from fucina.text.speculative.mtp import MTPDrafter
from synth_glm4moe import write_glm4moe

IDS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 33, 200]


def _rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def reference_nextn(path, tokens, states):
    """llama.cpp's nextn graph over a fresh sequence at positions 0.., written from its
    source with the file's arrays: the logits [m, n_vocab]."""
    r = gguf.GGUFReader(str(path))
    W = {t.name: np.asarray(t.data, dtype=np.float64) for t in r.tensors}
    kv = lambda k: r.fields[f"glm4moe.{k}"].contents()     # noqa: E731
    i = kv("block_count") - kv("nextn_predict_layers")
    b = f"blk.{i}."
    H, Hkv, D, R = kv("attention.head_count"), kv("attention.head_count_kv"), kv("attention.key_length"), \
        kv("rope.dimension_count")
    k_used, scale, base = kv("expert_used_count"), kv("expert_weights_scale"), kv("rope.freq_base")
    m = len(tokens)
    e = W["token_embd.weight"][tokens]
    x = np.concatenate([_rms(e, W[b + "nextn.enorm.weight"]), _rms(states, W[b + "nextn.hnorm.weight"])], -1)
    x = x @ W[b + "nextn.eh_proj.weight"].T
    cur = _rms(x, W[b + "attn_norm.weight"])
    q = (cur @ W[b + "attn_q.weight"].T + W[b + "attn_q.bias"]).reshape(m, H, D)
    k = (cur @ W[b + "attn_k.weight"].T + W[b + "attn_k.bias"]).reshape(m, Hkv, D)
    v = (cur @ W[b + "attn_v.weight"].T + W[b + "attn_v.bias"]).reshape(m, Hkv, D)
    q, k = _rms(q, W[b + "attn_q_norm.weight"]), _rms(k, W[b + "attn_k_norm.weight"])
    ang = np.arange(m)[:, None] * base ** (-np.arange(0, R, 2) / R)[None, :]     # NEOX: pairs (j, j + R/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(t):
        a, bb = t[..., :R // 2], t[..., R // 2:R]
        return np.concatenate([a * cos - bb * sin, a * sin + bb * cos, t[..., R:]], -1)
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, H // Hkv, 1), np.repeat(v, H // Hkv, 1)
    s = np.einsum("mhd,nhd->hmn", q, k) / np.sqrt(D) + np.triu(np.full((m, m), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hmn,nhd->mhd", p / p.sum(-1, keepdims=True), v).reshape(m, H * D)
    ffn_inp = o @ W[b + "attn_output.weight"].T + x
    cur = _rms(ffn_inp, W[b + "post_attention_norm.weight"])
    probs = 1 / (1 + np.exp(-(cur @ W[b + "ffn_gate_inp.weight"].T)))
    sel = probs + W[b + "exp_probs_b.bias"]
    out = np.zeros_like(cur)
    for row in range(m):
        ids = np.argsort(-sel[row], kind="stable")[:k_used]
        w = probs[row, ids] / probs[row, ids].sum() * scale
        for e_, we in zip(ids, w):
            g = W[b + "ffn_gate_exps.weight"][e_] @ cur[row]
            u = W[b + "ffn_up_exps.weight"][e_] @ cur[row]
            out[row] += we * (W[b + "ffn_down_exps.weight"][e_] @ (_silu(g) * u))
    sh = W[b + "ffn_down_shexp.weight"] @ (_silu(W[b + "ffn_gate_shexp.weight"] @ cur.T) * (W[b + "ffn_up_shexp.weight"] @ cur.T))
    y = out + sh.T + ffn_inp
    norm = W.get(b + "nextn.shared_head_norm.weight", W["output_norm.weight"])
    head = W.get(b + "nextn.shared_head_head.weight", W["token_embd.weight"])
    return _rms(y, norm) @ head.T


@pytest.mark.parametrize("extras", [False, True], ids=["shared-head", "own-head"])
def test_nextn_equals_llama_cpp_graph(tmp_path, extras):
    path = write_glm4moe(tmp_path / "m.gguf", seed=7, nextn_extras=extras, router_scale=12.0)
    model = load_model(path)
    head = mtp.attach_from(model, True)
    assert head.block.native_plan is not None          # the head's block runs the native step
    cache = model.init_cache(32)
    model.forward_step(cache, IDS, 0)
    trunk = head.trunk_state(cache.hidden_rows[:len(IDS)])
    states = torch.cat([torch.zeros(1, model.config.n_embd), trunk[:-1]])     # entry q reads the state at q - 1
    got = head.logits(head.forward(head.init_cache(32), IDS, states, 0)).numpy()
    want = reference_nextn(path, IDS, states.double().numpy())
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert (got.argmax(1) == want.argmax(1)).all()


def _fresh_draft(model, head, context, n):
    """The head's chained greedy draft for `context`, computed from nothing: the trunk over
    every token, the head's entries 0..L-1, then token by token from its own state."""
    L = len(context)
    cache = model.init_cache(64)
    model.forward_step(cache, context, 0)
    trunk = head.trunk_state(cache.hidden_rows[:L])
    hc = head.init_cache(64)
    hn = head.forward(hc, context, torch.cat([torch.zeros(1, trunk.shape[1]), trunk[:-1]]), 0)[-1]
    out = []
    while True:
        tok, _ = head.draft_token(hn)
        out.append(tok)
        if len(out) == n:
            return out
        hn = head.forward(hc, [tok], hn[None], L + len(out) - 1)[-1]


def test_drafter_catches_up_incrementally(tmp_path):
    model = load_model(write_glm4moe(tmp_path / "m.gguf", seed=2))
    head = mtp.attach_from(model, True)
    cache = model.init_cache(64)
    d = MTPDrafter(head)
    d.bind(cache)
    history = IDS[:5]
    model.forward_step(cache, history[:-1], 0)       # the last token is carried (not yet cached)
    for more in ([9, 10, 11], [12], [13, 14]):
        assert d.suggest(history, 4) == _fresh_draft(model, head, history, 4)
        model.forward_step(cache, history[-1:] + more[:-1], cache.len)
        history = history + more
    d.sync(history[:3])                               # a rewind: the head's cache follows
    cache.truncate(2)
    assert d.suggest(history[:3], 3) == _fresh_draft(model, head, history[:3], 3)


@pytest.fixture
def mtp_always(monkeypatch):
    """The head drafts at every step (no exact match takes over, never muted)."""
    monkeypatch.setattr(cascade, "MTP_DEFERS_TO", 10 ** 9)
    monkeypatch.setattr(cascade.Gate, "muted", lambda self: False)


@pytest.mark.parametrize("opts", [dict(temperature=0.0), dict(temperature=0.9, top_k=20, seed=3)],
                         ids=["greedy", "seeded"])
def test_mtp_drafted_equals_plain(tmp_path, mtp_always, opts):
    path = write_glm4moe(tmp_path / "m.gguf", seed=1)
    plain, llm = load(path, n_ctx=256), load(path, n_ctx=256, mtp=True)
    want = plain.generate("hello world", max_tokens=16, **opts)
    got = llm.generate("hello world", max_tokens=16, speculative=True, spec_max=3, **opts)
    assert got == want
    assert llm.spec.index.mtp_gate.total_drafted > 0 and llm.model.native_plan is not None
    chats = [x.chat(speculative=x is llm, spec_max=3, max_tokens=8, **opts) for x in (plain, llm)]
    for turn in ("abc", "more please"):
        assert chats[1].send(turn) == chats[0].send(turn)
    assert chats[1].tokens == chats[0].tokens
    assert chats[1].spec.index.mtp_gate.total_drafted > 0


# -- heads trained for a model that ships none (train/mtp.py) ---------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A llama synth model (native step: the batched verify route) and a head trained for it
    through the CLI, in a few steps (two of its 16 sequences held out)."""
    from fucina.cli.main import main
    from synth import write_model

    d = tmp_path_factory.mktemp("mtp")
    path = write_model(d / "m.gguf", "llama", seed=3)
    head = d / "head.gguf"
    assert main(["mtp", "train", path, "--out", str(head), "--steps", "3", "--sequences", "16", "--tokens", "4",
                 "--seed", "1", "--threads", "1"]) == 0
    return path, str(head)


@pytest.mark.parametrize("opts", [dict(temperature=0.0), dict(temperature=0.9, top_k=20, seed=5)],
                         ids=["greedy", "seeded"])
def test_trained_head_drafts_losslessly(trained, mtp_always, opts):
    path, head = trained
    plain, llm = load(path, n_ctx=256), load(path, n_ctx=256, mtp=head)
    assert llm.model.mtp.block.native_plan is not None      # the head's block runs the native step
    for prompt in ("hello world", "abcabc"):
        want = plain.generate(prompt, max_tokens=24, **opts)
        assert llm.generate(prompt, max_tokens=24, speculative=True, spec_max=4, **opts) == want
    assert llm.spec.index.mtp_gate.total_drafted > 0


def test_cli_run_with_head(trained, capsys):
    from fucina.cli.main import main

    path, head = trained
    assert main(["run", path, "-p", "ab", "-n", "12", "-t", "1"]) == 0
    want = capsys.readouterr().out
    assert main(["run", path, "-p", "ab", "-n", "12", "-t", "1", "--spec", "--mtp", head]) == 0
    assert capsys.readouterr().out == want


def test_bad_heads_raise_typed_errors(trained, tmp_path):
    from synth import write_model

    path, head = trained
    other_width = write_model(tmp_path / "w.gguf", "llama", hidden=32, heads=2, kv_heads=1, seed=3)
    with pytest.raises(mtp.MTPHeadError, match="embedding_length"):
        load(other_width, mtp=head)
    model = load_model(path)
    model.config.n_vocab += 1                      # as a model with another vocabulary would read
    with pytest.raises(mtp.MTPHeadError, match="vocab_size"):
        mtp.load_head(model, head)
    model.config.n_vocab -= 1
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(open(head, "rb").read()[:200])
    with pytest.raises(mtp.MTPHeadError, match="not a readable MTP head"):
        mtp.load_head(model, corrupt)
    with pytest.raises(mtp.MTPHeadError, match="not an MTP head"):
        mtp.load_head(model, path)
    with pytest.raises(mtp.MTPHeadError, match="no such"):
        mtp.load_head(model, tmp_path / "missing.gguf")
    with pytest.raises(mtp.MTPHeadError, match="carries no NextN block"):
        load(path, mtp=True)


def test_head_misses_leave_the_cascade_on():
    """A head's rejected drafts mute the head (its bucket's budget falls to 0), never the
    cost gate's on/off decision, which the exact matches' drafts keep deciding."""
    from fucina.text.speculative.gate import MTP_BUCKET, CostGate

    g = CostGate(max_draft=8, min_draft=1)
    for _ in range(12):
        g.settle(3, 0, 1, MTP_BUCKET)
    assert g.active() and g.bucket_acceptance(MTP_BUCKET) < 0.1
    g.draft_cost = 0.1
    assert g.budget(0, MTP_BUCKET) == 0
    for _ in range(12):
        g.settle(3, 0, 1, 1)
    assert not g.active()
