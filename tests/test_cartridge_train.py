"""Training cartridges (train.cartridge): the loss and its gradients against an
independent torch formulation, finite differences through attention into the rows, the
student forward against a real forward, and self-study runs that learn, repeat for a
seed and resume bit for bit."""
import gguf
import pytest
import torch

from fucina.errors import CartridgeError
from fucina.models import load_model
from fucina.models.cartridge import Cartridge
from fucina.text.tokenizer import Tokenizer
from fucina.train.cartridge import (CartridgeParams, Sample, SelfStudy, SelfStudyConfig, Trainable,
                                    distill_loss, optimize, sample_loss, student_logprobs, teacher_topk,
                                    train_cartridge)
from fucina.train.forward import hidden
from synth import write_model

Q = gguf.GGMLQuantizationType
DOC = ("Zorvath is the capital of Plenn. The river Quiss flows through Zorvath. "
       "Plenn exports blue salt and copper. Its queen is named Ilvara. ") * 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("c") / "m.gguf", "qwen3", hidden=64, heads=4, kv_heads=2,
                       head_dim=32, layers=2, qtype=Q.F32)
    model = load_model(path)
    return model, Tokenizer.from_metadata(model.gguf.metadata)


def test_teacher_topk_keeps_the_crossing_entry():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    ids, lp = teacher_topk(logits, k=20, mass=0.9)
    assert ids.tolist() == [0, 1, 2] and torch.allclose(lp.exp(), torch.tensor([0.5, 0.3, 0.15]))
    ids, _ = teacher_topk(logits, k=2, mass=0.99)
    assert ids.tolist() == [0, 1]


def test_loss_and_gradient_match_a_dense_formulation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g, dtype=torch.float64).requires_grad_()
    teacher = torch.randn(5, 40, generator=g, dtype=torch.float64)
    toks, lps = zip(*[teacher_topk(t, k=6, mass=0.95) for t in teacher])
    # duplicate an entry's row: entries add, rows average
    loss = distill_loss(torch.log_softmax(logits, -1), toks, lps)
    (gl,) = torch.autograd.grad(loss, logits)
    dense = torch.zeros(5, 40, dtype=torch.float64)
    for r, (t, lp) in enumerate(zip(toks, lps)):
        dense[r, t] = lp.double().exp()
    logits2 = logits.detach().clone().requires_grad_()
    ref = -(dense * torch.log_softmax(logits2, -1)).sum(-1).mean()
    (gr,) = torch.autograd.grad(ref, logits2)
    assert torch.allclose(loss.double(), ref, atol=1e-6) and torch.allclose(gl, gr, atol=1e-6)
    # gradient of forward KL: teacher entropy is constant, so the same gradient
    kl = (dense * (torch.where(dense > 0, dense.log(), torch.zeros_like(dense)) - torch.log_softmax(logits2, -1)))
    (gk,) = torch.autograd.grad(kl.sum(-1).mean(), logits2)
    assert torch.allclose(gk, gr, atol=1e-9)


@pytest.mark.parametrize("arch", ["qwen3", "gemma4"])
def test_student_forward_behind_a_capture_is_the_real_forward(tiny, arch, tmp_path):
    """(gemma4: windows, per-layer embeddings and a layer reading another's K/V)"""
    model = tiny[0] if arch == "qwen3" else load_model(write_model(tmp_path / "g.gguf", "gemma4", layers=4))
    ids = list(range(10, 40))
    p = 18
    cart = Cartridge.capture(model, ids[:p])
    ks, vs = CartridgeParams(cart).full()
    with torch.no_grad():
        got = student_logprobs(model, ks, vs, ids[p:], list(range(len(ids) - p)), "off")
        want = torch.log_softmax(model.head(hidden(model, torch.tensor(ids), "off")[p:]).float(), -1)
    assert (got - want).abs().max() < 2e-2     # the prefix rows went through f16 once


def test_finite_differences_through_attention_into_the_rows(tiny):
    model, _ = tiny
    cart = Cartridge.capture(model, list(range(50, 62)))
    params = CartridgeParams(cart)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(4, model.config.n_vocab, generator=g) * 3
    toks, lps = zip(*[teacher_topk(t, k=8, mass=0.99) for t in teacher])
    s = Sample(ids=[3, 9, 27, 81, 5], rows=[1, 2, 3, 4], tokens=list(toks), logprobs=list(lps))
    trainable = Trainable(model)
    try:
        loss = sample_loss(model, params, s, "off")
        loss.backward()
        for t in (params.k[1], params.v[0]):
            d = torch.randn(t.shape, generator=g)
            analytic = float((t.grad * d).sum())
            eps = 1e-2
            with torch.no_grad():
                t += eps * d
                up = float(sample_loss(model, params, s, "off"))
                t -= 2 * eps * d
                down = float(sample_loss(model, params, s, "off"))
                t += eps * d
            numeric = (up - down) / (2 * eps)
            assert abs(numeric - analytic) <= 0.03 * abs(analytic) + 1e-4, (numeric, analytic)
        # the frozen sink gets no gradient: it is not a parameter
        assert all(p.shape[0] == cart.p - 1 for p in params.params())
        # checkpointed segments give the same gradient
        grads = [p.grad.clone() for p in params.params()]
        for p in params.params():
            p.grad = None
        sample_loss(model, params, s, "full").backward()
        assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(grads, params.params()))
    finally:
        trainable.close()


def test_self_study_samples_are_a_function_of_seed_and_index(tiny):
    model, tok = tiny
    cfg = SelfStudyConfig(p=16, chunk_tokens=60, max_question=8, max_answer=10)
    study = SelfStudy(model, tok, DOC, cfg)
    a, b = study.sample(3), study.sample(3)
    assert a.ids == b.ids and a.rows == b.rows and all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    assert a.rows[-1] < len(a.ids) and len(a.rows) == len(a.tokens) >= 1
    other = SelfStudy(model, tok, DOC, SelfStudyConfig(p=16, chunk_tokens=60, max_question=8, max_answer=10,
                                                       seed=1)).sample(3)
    # another seed shows the bots another chunk: the teacher's targets move
    assert other.ids != a.ids or any(not torch.equal(x, y) for x, y in zip(a.logprobs, other.logprobs))


def test_training_lowers_the_loss_on_its_conversations(tiny):
    model, tok = tiny
    cfg = SelfStudyConfig(p=16, chunk_tokens=60, max_question=8, max_answer=10, lr=2e-2, accum=2,
                          conversations=2 * 8)
    study = SelfStudy(model, tok, DOC, cfg)
    fixed = [study.sample(i) for i in range(2)]
    from fucina.train.cartridge import init_cartridge
    params = CartridgeParams(init_cartridge(model, tok, DOC, cfg))
    trainable = Trainable(model)
    try:
        with torch.no_grad():
            before = sum(float(sample_loss(model, params, s)) for s in fixed)
        prog = optimize(model, params, lambda i: fixed[i % 2], cfg)
        with torch.no_grad():
            after = sum(float(sample_loss(model, params, s)) for s in fixed)
    finally:
        trainable.close()
    assert prog.steps == 8 and after < 0.9 * before


def test_train_is_deterministic_and_resumes_bit_for_bit(tiny, tmp_path):
    model, tok = tiny
    kw = dict(p=12, chunk_tokens=40, max_question=6, max_answer=6, accum=2)
    whole = train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=6, **kw), out=str(tmp_path / "a.st"))
    again = train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=6, **kw), out=str(tmp_path / "b.st"))
    train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=2, **kw), out=str(tmp_path / "c.st"))
    resumed = train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=6, **kw), out=str(tmp_path / "c.st"),
                              resume=True)
    for x, y, z in zip(whole.k + whole.v, again.k + again.v, resumed.k + resumed.v):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert whole.meta["steps"] == 3 and resumed.meta["conversations"] == 6
    loaded = Cartridge.load(tmp_path / "c.st")
    assert loaded.corpus == tok.encode(DOC, add_special=False) and loaded.meta["steps"] == 3
    assert not torch.equal(loaded.k[0][1:], Cartridge.capture(model, tok.encode(DOC)[:12]).k[0][1:])
    with pytest.raises(CartridgeError, match="setup differs"):
        train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=8, **dict(kw, lr=1e-3)),
                        out=str(tmp_path / "c.st"), resume=True)
    with pytest.raises(CartridgeError, match="fewer than p"):
        train_cartridge(model, tok, "short", SelfStudyConfig(p=64), out=str(tmp_path / "d.st"))


@pytest.mark.slow
def test_self_study_on_smollm2(tmp_path):
    """A few conversations on a real model: finite losses that do not blow up, a saved
    cartridge that loads and answers behind the chat template."""
    from pathlib import Path

    import fucina

    path = Path.home() / ".cache" / "fucina" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} absent")
    doc = (Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "cartridge_doc.txt").read_text()
    model = load_model(path)
    tok = Tokenizer.from_metadata(model.gguf.metadata)
    cfg = SelfStudyConfig(p=32, conversations=4, accum=2, chunk_tokens=128, max_question=16, max_answer=24)
    out = str(tmp_path / "c.safetensors")
    cart = train_cartridge(model, tok, doc, cfg, out=out)
    losses = cart.meta["losses"]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    llm = fucina.load(path, cartridge=out)
    reply = llm.chat(max_tokens=8, temperature=0).send("Who founded the Tessaly Institute?")
    assert isinstance(reply, str) and llm.model.config.arch == "llama"


def test_batched_self_study_is_bitwise_the_one_at_a_time_run(tiny):
    """Conversations generated together in lockstep equal each generated alone (the native
    kernels are batch-invariant), streams leaving the batch at different steps included."""
    model, tok = tiny
    kw = dict(p=16, chunk_tokens=60, max_question=8, max_answer=10, temperature=1.0)
    alone = SelfStudy(model, tok, DOC, SelfStudyConfig(batch=1, **kw))
    assert alone.batch_invariant()
    # a stop id that ends one conversation's answer early: streams drop out unevenly
    ref = [alone.sample(i) for i in range(5)]
    stop = next(int(t[0]) for s in ref for t in s.tokens[2:5])
    alone.stop.add(stop)
    ref = [alone.sample(i) for i in range(5)]
    assert len({len(s.rows) for s in ref}) > 1
    for batch in (2, 5):
        together = SelfStudy(model, tok, DOC, SelfStudyConfig(batch=batch, **kw))
        together.stop.add(stop)
        got = together.samples(range(5))
        for a, b in zip(ref, got):
            assert a.ids == b.ids and a.rows == b.rows and a.question == b.question
            assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))
            assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))


def test_train_does_not_depend_on_the_generation_batch(tiny, tmp_path):
    model, tok = tiny
    kw = dict(p=12, chunk_tokens=40, max_question=6, max_answer=6, accum=2, conversations=6)
    one = train_cartridge(model, tok, DOC, SelfStudyConfig(batch=1, **kw), out=str(tmp_path / "a.st"))
    four = train_cartridge(model, tok, DOC, SelfStudyConfig(batch=4, **kw), out=str(tmp_path / "b.st"))
    assert all(torch.equal(x, y) for x, y in zip(one.k + one.v, four.k + four.v) if x is not None)


def _rows_cartridge(model, p=6):
    """A capture whose key channel 0 is 1000x channel 1 in every layer and head."""
    cart = Cartridge.capture(model, list(range(20, 20 + p)))
    for k in cart.k:
        if k is not None:
            k[..., 0] = 100.0 * torch.sign(k[..., 0] + 1e-3)
            k[..., 1] = 0.1 * torch.sign(k[..., 1] + 1e-3)
    return cart


@pytest.mark.parametrize("scaled", [True, False])
def test_adam_moves_each_channel_by_its_own_size(tiny, scaled):
    """Adam's first step moves every element by about lr: in units of its channel's size
    (scaled) a channel 1000x larger moves 1024x more; raw (the default), both by lr."""
    model, _ = tiny
    cart = _rows_cartridge(model)
    params = CartridgeParams(cart, scaled)
    ks, _ = params.full()
    assert all(torch.equal(a, b.float()) for a, b in zip(ks, cart.k) if a is not None)   # exact round trip
    opt = torch.optim.Adam(params.params(), lr=1e-2)
    ks, vs = params.full()
    g = torch.Generator().manual_seed(0)
    loss = sum((k * torch.randn(k.shape, generator=g)).sum() + (v * torch.randn(v.shape, generator=g)).sum()
               for k, v in zip(ks, vs) if k is not None)
    loss.backward()
    opt.step()
    with torch.no_grad():
        after, _ = params.full()
    d = (after[0] - ks[0].detach())[1:].abs()
    big, small = float(d[..., 0].mean()), float(d[..., 1].mean())
    if scaled:
        assert big == pytest.approx(128 * 1e-2, rel=1e-3) and small == pytest.approx(0.125 * 1e-2, rel=1e-3)
    else:
        assert big == pytest.approx(1e-2, rel=1e-3) and small == pytest.approx(1e-2, rel=1e-3)


def stopped_after(visits, model, tok, cfg, out):
    """A run interrupted after `visits` conversations (OUT and OUT.ckpt written)."""
    from fucina.train.cartridge import CartridgeRun
    run = CartridgeRun(model, tok, DOC, cfg, out=out)
    t = Trainable(model)
    try:
        run.advance(visits)
    finally:
        t.close()
    return run


def test_passes_reuse_each_conversation_and_resume_bit_for_bit(tiny, tmp_path, monkeypatch):
    """--epochs 2: every conversation is made once and trained on twice (the second pass
    in another order); a run stopped inside the second pass resumes bit for bit."""
    model, tok = tiny
    made: list[int] = []
    real = SelfStudy._generate

    def counting(self, indices):
        made.extend(indices)
        return real(self, indices)
    monkeypatch.setattr(SelfStudy, "_generate", counting)
    kw = dict(p=12, chunk_tokens=40, max_question=6, max_answer=6, accum=2, conversations=4, epochs=2, batch=4)
    whole = train_cartridge(model, tok, DOC, SelfStudyConfig(**kw), out=str(tmp_path / "a.safetensors"),
                            save_passes=True)
    assert sorted(made) == [0, 1, 2, 3] and whole.meta["steps"] == 4 and whole.meta["conversations"] == 8
    # --save-passes: the cartridge after each pass; the last is the run's result
    first, last = (Cartridge.load(tmp_path / f"a.pass{k}.safetensors") for k in (1, 2))
    assert first.meta["conversations"] == 4 and last.meta["conversations"] == 8
    assert all(x is None or torch.equal(x, y) for x, y in zip(whole.k + whole.v, last.k + last.v))
    assert any(x is not None and not torch.equal(x, y) for x, y in zip(first.k, last.k))
    from fucina.train.cartridge import visit
    second = [visit(SelfStudyConfig(**kw), v) for v in range(4, 8)]
    assert sorted(second) == [0, 1, 2, 3] and second != [0, 1, 2, 3]
    # stopped after 3 steps (inside pass 2), resumed: the same rows; a longer run is refused
    stopped_after(6, model, tok, SelfStudyConfig(**kw), str(tmp_path / "b.st"))
    resumed = train_cartridge(model, tok, DOC, SelfStudyConfig(**kw), out=str(tmp_path / "b.st"), resume=True)
    for x, y in zip(whole.k + whole.v, resumed.k + resumed.v):
        assert x is None or torch.equal(x, y)
    with pytest.raises(CartridgeError, match="over 2 passes"):
        train_cartridge(model, tok, DOC, SelfStudyConfig(**dict(kw, conversations=6)), out=str(tmp_path / "b.st"),
                        resume=True)


def test_a_second_turn_extends_the_first(tiny):
    """--turns 2: after bot B's answer bot A asks again; the conversation's first turn is
    the one-turn conversation (ids, rows and targets), the second one's rows follow it."""
    model, tok = tiny
    kw = dict(p=12, chunk_tokens=40, max_question=6, max_answer=10, batch=4)
    probe = SelfStudy(model, tok, DOC, SelfStudyConfig(**kw)).samples([0])[0]
    said = probe.ids[probe.rows[0] + 1:]
    assert said   # the random model never ends a turn by itself: end bot B's turns at what it says
    end = max(set(said), key=said.count)
    one, two = (SelfStudy(model, tok, DOC, SelfStudyConfig(**kw, turns=t)) for t in (1, 2))
    for st in (one, two):
        st.stop = st.stop | {end}
    for a, b in zip(one.samples([0, 1, 2]), two.samples([0, 1, 2])):
        n = len(a.rows)
        assert b.ids[:len(a.ids)] == a.ids and len(b.ids) > len(a.ids) + 2
        assert b.rows[:n] == a.rows and len(b.rows) > n and min(b.rows[n:]) >= len(a.ids)
        assert all(torch.equal(x, y) for x, y in zip(a.tokens + a.logprobs, b.tokens[:n] + b.logprobs[:n]))
        assert b.kind == a.kind + " x2"


def test_a_document_teacher_answers_from_the_whole_corpus(tiny, tmp_path):
    """teacher="document": bot A asks about its chunk, bot B answers with the whole corpus
    in context (its rows copied from one prefill of it): the targets are those of bot B's
    prompt prefilled from nothing, two turns batched equal one at a time, the student's
    ids are the chunk teacher's, and a run resumes only under the same teacher."""
    from fucina.text.generate import prefill
    from fucina.train.cartridge import ANSWER_DOCUMENT, DOCUMENT

    model, tok = tiny
    kw = dict(p=12, chunk_tokens=30, max_question=6, max_answer=8, temperature=1.0, turns=2)
    chunk, doc = (SelfStudy(model, tok, DOC, SelfStudyConfig(teacher=t, batch=3, **kw)) for t in ("chunk", "document"))
    got, plain = doc.samples([0, 1, 2]), chunk.samples([0, 1, 2])
    for a, b in zip(got, plain):
        assert a.question == b.question and a.ids[:a.rows[0] + 1] == b.ids[:b.rows[0] + 1]
    assert any(not torch.equal(a.logprobs[0], b.logprobs[0]) for a, b in zip(got, plain))
    alone = SelfStudy(model, tok, DOC, SelfStudyConfig(teacher="document", batch=1, **kw))
    for a, b in zip(got, [alone.sample(i) for i in range(3)]):
        assert a.ids == b.ids and a.rows == b.rows
        assert all(torch.equal(x, y) for x, y in zip(a.tokens + a.logprobs, b.tokens + b.logprobs))
    s = got[0]
    msgs = [{"role": "system", "content": DOCUMENT.format(document=DOC)},
            {"role": "user", "content": ANSWER_DOCUMENT.format(question=s.question)}]
    ids = doc._prompt(msgs)
    assert len(ids) > len(tok.encode(DOC, add_special=False, parse_special=False))
    logits, _ = prefill(model, model.init_cache(len(ids) + 4), [], ids)
    want_ids, want_lp = teacher_topk(logits.reshape(-1)[-logits.shape[-1]:], 20, 0.99)
    assert torch.equal(s.tokens[0], want_ids) and torch.equal(s.logprobs[0], want_lp)
    out = str(tmp_path / "d.st")
    train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=2, teacher="document", **kw), out=out)
    with pytest.raises(CartridgeError, match="teacher"):
        train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=4, **kw), out=out, resume=True)
    with pytest.raises(CartridgeError, match="teacher"):
        SelfStudy(model, tok, DOC, SelfStudyConfig(teacher="book"))


def test_chunks_cover_the_ends_of_the_corpus():
    """Every token is in at least about half as many chunks as the middle's (a window
    kept inside the corpus shows its first and last tokens in 1 chunk of 572 here)."""
    import random

    from fucina.train.cartridge import chunk_span
    rng = random.Random(0)
    hits = [0] * 955
    for _ in range(4000):
        a, b = chunk_span(rng, 955, 384)
        assert 0 <= a < b <= 955 and b - a >= 192
        for t in range(a, b):
            hits[t] += 1
    middle = hits[955 // 2]
    assert min(hits) >= 0.4 * middle and max(hits) <= 1.1 * middle
    assert chunk_span(rng, 50, 384) == (0, 50)


def test_spread_covers_the_document_and_the_forms_evenly_for_any_count():
    """--spread: the first n conversations' chunks sit on a golden-ratio sequence (at most
    three gap sizes, the largest within 2.7x the smallest, for every n) and the seed prompts
    take turns (their counts differ by at most one); conversation i is a function of
    (seed, i) only, and two seeds start at different points."""
    from fucina.train.cartridge import spread_draw, spread_span
    for seed in (0, 1):
        draws = [spread_draw(seed, i, 6) for i in range(64)]
        for n in (5, 16, 64):
            us = sorted(u for u, _ in draws[:n])
            gaps = [b - a for a, b in zip(us, us[1:])] + [1 - us[-1] + us[0]]
            assert len({round(g, 9) for g in gaps}) <= 3 and max(gaps) < 2.7 * min(gaps)
            counts = [sum(k == j for _, k in draws[:n]) for j in range(6)]
            assert max(counts) - min(counts) <= 1
        assert draws[10] == spread_draw(seed, 10, 6)
    assert spread_draw(0, 0, 6)[0] != spread_draw(1, 0, 6)[0]
    hits = [0] * 1061
    for i in range(64):
        a, b = spread_span(spread_draw(0, i, 6)[0], 1061, 384)
        assert 0 <= a < b <= 1061 and b - a >= 192
        for t in range(a, b):
            hits[t] += 1
    assert min(hits[192:-192]) >= 0.8 * max(hits)       # the inside evenly (the random draws: 0.6-0.7)
    assert spread_span(0.0, 1061, 384) == (0, 192) and spread_span(0.9999, 1061, 384) == (869, 1061)
    assert spread_span(0.5, 50, 384) == (0, 50)


def test_spread_is_part_of_the_run(tiny, tmp_path):
    """--spread changes which chunks and forms the conversations get, so resuming a run
    with the other setting is refused (a checkpoint from before the option: random draws)."""
    model, tok = tiny
    kw = dict(p=12, chunk_tokens=40, max_question=6, max_answer=6, accum=2)
    plain = SelfStudy(model, tok, DOC, SelfStudyConfig(**kw)).samples([0, 1, 2])
    spread = SelfStudy(model, tok, DOC, SelfStudyConfig(spread=True, **kw)).samples([0, 1, 2])
    assert [(s.kind, s.question) for s in plain] != [(s.kind, s.question) for s in spread]
    assert len({s.kind for s in spread}) == 3                              # the forms in turn
    out = str(tmp_path / "s.st")
    train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=2, spread=True, **kw), out=out)
    with pytest.raises(CartridgeError, match="spread"):
        train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=4, **kw), out=out, resume=True)


def test_a_checkpoint_from_before_passes_and_channel_steps_resumes(tiny, tmp_path):
    model, tok = tiny
    kw = dict(p=12, chunk_tokens=40, max_question=6, max_answer=6, accum=2)
    out = str(tmp_path / "a.st")
    train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=2, **kw), out=out)
    state = torch.load(out + ".ckpt", weights_only=False)
    for k in ("epochs", "scaled", "turns", "decay", "spread", "teacher"):
        del state["config"][k]
    del state["scales"]
    torch.save(state, out + ".ckpt")
    again = train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=4, **kw), out=out, resume=True)
    assert again.meta["steps"] == 2
    with pytest.raises(CartridgeError, match="scaled"):
        train_cartridge(model, tok, DOC, SelfStudyConfig(conversations=6, scaled=True, **kw), out=out, resume=True)


def test_decay_takes_the_rate_down_linearly_and_resumes(tiny, tmp_path, monkeypatch):
    """--decay: step t of T moves at lr (1 - t/T), the last at lr / T; a run stopped midway
    resumes onto the same schedule, bit for bit."""
    model, tok = tiny
    kw = dict(p=12, chunk_tokens=40, max_question=6, max_answer=6, accum=2, conversations=4, epochs=2, batch=4,
              decay=True, lr=4e-3)
    seen = []
    real = torch.optim.Adam.step

    def step(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return real(self, *a, **k)
    monkeypatch.setattr(torch.optim.Adam, "step", step)
    run = stopped_after(8, model, tok, SelfStudyConfig(**kw), str(tmp_path / "a.st"))
    monkeypatch.undo()
    assert seen == pytest.approx([4e-3, 3e-3, 2e-3, 1e-3])
    whole = run.result()
    flat = train_cartridge(model, tok, DOC, SelfStudyConfig(**dict(kw, decay=False)), out=str(tmp_path / "c.st"))
    assert any(x is not None and not torch.equal(x, y) for x, y in zip(whole.k, flat.k))
    stopped_after(4, model, tok, SelfStudyConfig(**kw), str(tmp_path / "b.st"))
    resumed = train_cartridge(model, tok, DOC, SelfStudyConfig(**kw), out=str(tmp_path / "b.st"), resume=True)
    assert all(x is None or torch.equal(x, y) for x, y in zip(whole.k + whole.v, resumed.k + resumed.v))


def test_distractors_mix_in_by_visit_and_train_only_the_rows(tiny, tmp_path):
    """--distract: a visit's distractor (and its side) is a function of (seed, visit);
    the student reads it composed beside the rows exactly as serving composes them;
    gradients reach only the rows; distract 0 is the plain run bit for bit; resume
    refuses another distract setting."""
    from fucina.models.cartridge import compose
    from fucina.train.cartridge import distractor

    model, tok = tiny
    cfg = SelfStudyConfig(distract=0.5, seed=3)
    picks = [distractor(cfg, v, 3) for v in range(400)]
    assert picks == [distractor(cfg, v, 3) for v in range(400)]
    mixed = [d for d in picks if d is not None]
    assert 150 < len(mixed) < 250 and {i for i, _ in mixed} == {0, 1, 2} and {b for _, b in mixed} == {True, False}
    assert distractor(cfg, 5, 0) is None and distractor(SelfStudyConfig(), 5, 3) is None

    other = Cartridge.capture(model, tok.encode("The lighthouse keeper owns nine cats. " * 3)[:10])
    kw = dict(p=12, chunk_tokens=40, max_question=6, max_answer=6, accum=2, conversations=4)
    study = SelfStudy(model, tok, DOC, SelfStudyConfig(**kw))
    s = study.sample(0)
    params = CartridgeParams(Cartridge.capture(model, tok.encode(DOC)[:12]))
    for before in (True, False):
        loss = sample_loss(model, params, s, beside=(other, before))
        own = params.cartridge()
        served = compose([other, own] if before else [own, other])
        want = distill_loss(student_logprobs(model, served.k, served.v, s.ids, s.rows), s.tokens, s.logprobs)
        assert torch.allclose(loss, want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(loss, sample_loss(model, params, s))
        grads = torch.autograd.grad(loss, params.params())
        assert all(g is not None and torch.isfinite(g).all() for g in grads)

    plain = train_cartridge(model, tok, DOC, SelfStudyConfig(**kw))
    unused = train_cartridge(model, tok, DOC, SelfStudyConfig(**kw), distractors=[other])
    mixed = train_cartridge(model, tok, DOC, SelfStudyConfig(distract=1.0, **kw), out=str(tmp_path / "m.st"),
                            distractors=[other])
    assert all(torch.equal(x, y) for x, y in zip(plain.k + plain.v, unused.k + unused.v))
    assert not all(torch.equal(x, y) for x, y in zip(plain.k + plain.v, mixed.k + mixed.v))
    with pytest.raises(CartridgeError, match="setup differs"):
        train_cartridge(model, tok, DOC, SelfStudyConfig(distract=0.5, **dict(kw, conversations=6)),
                        out=str(tmp_path / "m.st"), resume=True, distractors=[other])
    with pytest.raises(CartridgeError, match="needs distractor"):
        train_cartridge(model, tok, DOC, SelfStudyConfig(distract=0.5, **kw))
