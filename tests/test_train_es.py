"""Evolution strategies (fucina.train.es) on tiny synthetic models: the update against a
direct numpy formulation, the reward rising, the same adapter bytes with 1 and 2 worker
processes and after a resume, the rewards end to end, bad input, and the two-spirals toy."""
from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
import torch

from fucina.errors import FucinaError
from fucina.models import load_model
from fucina.text.chat_template import ChatTemplate
from fucina.text.tokenizer import Tokenizer
from fucina.train.checkpoint import CheckpointError
from fucina.train.data import DataError
from fucina.train.es import (ESConfig, ESError, ESTrainer, Strategy, centred_ranks, es_example,
                             pair_noise, parse_reward, read_es_jsonl, schedule_factor)
from synth import write_model

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_model(tmp_path_factory.mktemp("es") / "m.gguf", "qwen3", qtype=Q.Q8_0, ffn=64, layers=2))


RECORDS = [{"prompt": f"q{i}:", "completion": "abab"} for i in range(6)]


def _setup(path, records=RECORDS):
    m = load_model(path)
    tok = Tokenizer.from_metadata(m.gguf.metadata)
    tpl = ChatTemplate.from_metadata(m.gguf.metadata, tok)
    return m, tok, tpl, [es_example(r, tok, tpl) for r in records]


def _cfg(**kw):
    base = dict(population=8, sigma=0.05, lr=0.05, rank=4, targets=["q", "v", "o", "up", "down"], batch=4)
    return ESConfig(**{**base, **kw})


def _run(path, out, iterations, reward="nll", workers=1, resume=None, init=None, held=None, eval_every=0,
         eval_reward=None, keep="best", **kw):
    m, tok, tpl, exs = _setup(path)
    held_out = [es_example(r, tok, tpl) for r in held] if held else None
    t = ESTrainer(m, tok, tpl, _cfg(**kw), exs, reward, str(out), workers=workers, model_path=path,
                  progress=False, init=init, eval_examples=held_out, eval_every=eval_every,
                  eval_reward=eval_reward, keep=keep)
    try:
        if resume:
            t.resume(resume)
        t.fit(iterations)
        return t
    finally:
        t.close()


# -- the algorithm ----------------------------------------------------------------------------

def test_update_equals_numpy():
    cfg = ESConfig(population=6, sigma=0.1, lr=0.3, seed=7)
    theta0 = [torch.randn(3, 5, generator=torch.Generator().manual_seed(1)), torch.randn(4)]
    es = Strategy(theta0, cfg)
    rewards = [0.3, -1.0, 2.0, 0.3, 5.0, -2.5]
    es.update(rewards)
    # numpy: centred ranks (ties share their mean rank), mirrored pairs, lr / (P sigma) * sum (C+ - C-) e
    r = np.array(rewards)
    rank = np.array([(r < v).sum() + ((r == v).sum() - 1) / 2 for v in r])   # mean rank of ties
    c = rank / 5 - 0.5
    for k, t0 in enumerate(theta0):
        g = sum((c[2 * j] - c[2 * j + 1]) * pair_noise(7, 0, j, [t0.shape for t0 in theta0])[k].double().numpy()
                for j in range(3))
        want = t0.double().numpy() + 0.3 / (6 * 0.1) * g
        np.testing.assert_allclose(es.theta[k].double().numpy(), want, rtol=1e-5, atol=1e-6)
    assert es.iteration == 1


def test_members_are_mirrored_and_regenerated():
    es = Strategy([torch.zeros(10)], ESConfig(population=4, sigma=0.5, seed=3))
    plus, minus = es.member(2)[0], es.member(3)[0]
    assert torch.equal(plus, -minus) and plus.abs().sum() > 0
    assert torch.equal(es.member(2)[0], plus)              # a pure function of the counters
    assert not torch.equal(es.member(0)[0], plus)


def test_centred_ranks_and_anchor():
    assert centred_ranks([1.0, 1.0, 0.0]) == [0.25, 0.25, -0.5]
    assert centred_ranks([3.0, 1.0, 2.0]) == [0.5, -0.5, 0.0]
    flat = Strategy([torch.ones(3)], ESConfig(population=4))
    flat.update([0.0] * 4)                                   # no signal: no step
    assert torch.equal(flat.theta[0], torch.ones(3)) and flat.iteration == 1
    theta = [torch.ones(4)]
    es = Strategy(theta, ESConfig(population=2, sigma=0.1, lr=0.5, anchor="l2", anchor_lambda=1.0))
    es.update([1.0, 0.0])
    free = Strategy(theta, ESConfig(population=2, sigma=0.1, lr=0.5))
    free.update([1.0, 0.0])
    assert torch.allclose(es.theta[0] - 1, (free.theta[0] - 1) * 0.5)   # (1 - lr lambda) of the step
    l1 = Strategy(theta, ESConfig(population=2, sigma=0.1, lr=0.5, anchor="l1", anchor_lambda=100.0))
    l1.update([1.0, 0.0])
    assert torch.equal(l1.theta[0], theta[0])                          # soft-thresholded to zero


def test_schedule_factor_formula():
    cos = ESConfig(schedule="cosine", horizon=10, final_scale=0.2)
    for t, want in ((0, 1.0), (5, 0.6), (10, 0.2), (25, 0.2)):
        assert math.isclose(schedule_factor(cos, t), want, abs_tol=1e-12), (t, want)
    assert math.isclose(schedule_factor(cos, 3), 0.2 + 0.8 * (1 + math.cos(math.pi * 0.3)) / 2)
    step = ESConfig(schedule="step", step_every=4, step_gamma=0.5)
    assert [schedule_factor(step, t) for t in (0, 3, 4, 7, 8, 13)] == [1, 1, 0.5, 0.5, 0.25, 0.125]
    assert all(schedule_factor(ESConfig(), t) == 1.0 for t in (0, 7, 10**6))


def test_scheduled_update_is_the_constant_one_at_lr_t():
    """Iteration t with lr and the schedule moves theta as a constant-lr run at lr s(t) does;
    decay_sigma scales the members' probe radius too."""
    theta = [torch.randn(6, generator=torch.Generator().manual_seed(2))]
    rewards = [0.4, -0.1, 0.9, 0.3]
    sched = Strategy(theta, ESConfig(population=4, sigma=0.1, lr=0.2, schedule="step", step_every=1,
                                     step_gamma=0.5, anchor="l2", anchor_lambda=0.5))
    sched.update(rewards)
    sched.update(rewards)                              # iteration 1: s = 0.5
    ref = Strategy(theta, ESConfig(population=4, sigma=0.1, lr=0.2, anchor="l2", anchor_lambda=0.5))
    ref.update(rewards)
    ref.cfg = ESConfig(population=4, sigma=0.1, lr=0.1, anchor="l2", anchor_lambda=0.5)
    ref.update(rewards)
    assert torch.allclose(sched.theta[0], ref.theta[0], rtol=0, atol=1e-7)
    dec = Strategy([torch.zeros(5)], ESConfig(population=2, sigma=0.4, schedule="cosine", horizon=2,
                                              final_scale=0.25, decay_sigma=True))
    dec.iteration = 2
    assert torch.allclose(dec.member(0)[0], 0.1 * dec.noise(0)[0])


def test_bad_config():
    for kw in (dict(population=3), dict(sigma=0.0), dict(lr=float("nan")), dict(mode="x"),
               dict(norm="x"), dict(anchor="l3"), dict(schedule="linear"), dict(schedule="cosine"),
               dict(final_scale=1.5), dict(step_every=0), dict(step_gamma=0.0)):
        with pytest.raises(ESError):
            ESConfig(**kw)
    for spec in ("bleu", "regex:(", "regex:"):
        with pytest.raises(ESError):
            parse_reward(spec)


# -- on a model -------------------------------------------------------------------------------

def test_nll_reward_rises(model_path, tmp_path):
    t = _run(model_path, tmp_path, 12, batch=0)
    first, last = t.history[0]["mean"], t.ev.center()
    assert last > first + 1.0, (first, last)
    assert (tmp_path / "adapter.gguf").exists()


def test_adapter_reproduces_the_trained_model(model_path, tmp_path):
    """DIR/adapter.gguf loaded by --lora's path scores what the trainer's theta scored."""
    from fucina.train.es import Reward, score_batch
    from fucina.weights.lora import load_adapters
    t = _run(model_path, tmp_path, 3)
    want = t.ev.center()
    m, tok, tpl, exs = _setup(model_path)
    load_adapters(m, [str(tmp_path / "adapter.gguf")])
    got = score_batch(m, tok, [], exs, Reward("nll", False), 8)
    assert math.isclose(got, want, rel_tol=1e-4), (got, want)


def test_start_from_an_adapter(model_path, tmp_path):
    first = _run(model_path, tmp_path / "a", 2)
    again = _run(model_path, tmp_path / "b", 0, init=str(tmp_path / "a" / "adapter.gguf"))
    assert all(torch.equal(x, y) for x, y in zip(first.theta, again.theta))
    with pytest.raises(ESError, match="rank"):
        _run(model_path, tmp_path / "c", 0, init=str(tmp_path / "a" / "adapter.gguf"), rank=2)


def test_same_bytes_with_one_and_two_workers(model_path, tmp_path):
    _run(model_path, tmp_path / "w1", 3)
    _run(model_path, tmp_path / "w2", 3, workers=2)
    assert (tmp_path / "w1" / "adapter.gguf").read_bytes() == (tmp_path / "w2" / "adapter.gguf").read_bytes()


def test_resume_equals_uninterrupted(model_path, tmp_path):
    straight = _run(model_path, tmp_path / "a", 4)
    _run(model_path, tmp_path / "b", 2)
    resumed = _run(model_path, tmp_path / "b", 4, resume=str(tmp_path / "b"))
    assert (tmp_path / "a" / "adapter.gguf").read_bytes() == (tmp_path / "b" / "adapter.gguf").read_bytes()
    assert [h["mean"] for h in straight.history] == [h["mean"] for h in resumed.history]
    with pytest.raises(CheckpointError):
        _run(model_path, tmp_path / "c", 4, resume=str(tmp_path / "b"), sigma=0.1)


HELD = [{"prompt": f"h{i}:", "completion": "abab"} for i in range(3)]


def test_keep_best(model_path, tmp_path):
    """The held-out score is taken before the first iteration and every eval_every; the best
    theta (ties: the earlier) is DIR/best/ and the final DIR/adapter.gguf, the last DIR/last/."""
    scores = iter([0.1, 0.3, 0.9, 0.2, 0.9, 0.5])      # iterations 0, 2, 4, 6, 8, 10

    def judge(reply, rec):                            # one held-out example: one call per score
        return next(scores)
    t = _run(model_path, tmp_path, 10, held=HELD[:1], eval_every=2, eval_reward=judge, max_tokens=2)
    assert [h.get("eval") for h in t.history if "eval" in h] == [0.3, 0.9, 0.2, 0.9, 0.5]
    assert t.best["iteration"] == 4 and t.best["reward"] == 0.9
    assert t.summary()["best_iteration"] == 4
    best = (tmp_path / "best" / "adapter.gguf").read_bytes()
    assert (tmp_path / "adapter.gguf").read_bytes() == best
    assert (tmp_path / "last" / "adapter.gguf").read_bytes() != best
    from fucina.weights.lora import read_adapter
    got = read_adapter(tmp_path / "adapter.gguf")
    want = dict(zip(t.ev.target.names, zip(t.best["theta"][::2], t.best["theta"][1::2])))
    assert all(torch.equal(got.pairs[n][0].float(), a) for n, (a, _) in want.items())
    last = _run(model_path, tmp_path / "k", 4, held=HELD, eval_every=2, keep="last")
    assert (tmp_path / "k" / "best" / "adapter.gguf").exists() and not (tmp_path / "k" / "last").exists()
    with pytest.raises(ESError, match="held-out"):
        _run(model_path, tmp_path / "x", 1, eval_every=2)


def test_resume_with_schedule_and_keep_best(model_path, tmp_path):
    kw = dict(held=HELD, eval_every=2, schedule="cosine", horizon=6, final_scale=0.1, lr=0.5)
    straight = _run(model_path, tmp_path / "a", 6, **kw)
    _run(model_path, tmp_path / "b", 3, **kw)
    resumed = _run(model_path, tmp_path / "b", 6, resume=str(tmp_path / "b"), **kw)
    for f in ("adapter.gguf", "best/adapter.gguf", "last/adapter.gguf"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert straight.best["iteration"] == resumed.best["iteration"]
    assert [h["mean"] for h in straight.history] == [h["mean"] for h in resumed.history]
    with pytest.raises(CheckpointError, match="horizon"):
        _run(model_path, tmp_path / "b", 8, resume=str(tmp_path / "b"), **{**kw, "horizon": 8})


@pytest.mark.parametrize("reward", ["acc", "regex:^a", "callable"])
def test_generating_rewards_run(model_path, tmp_path, reward):
    spec = (lambda reply, rec: float(len(reply) > 0)) if reward == "callable" else reward
    t = _run(model_path, tmp_path, 2, reward=spec, max_tokens=4)
    assert len(t.history) == 2 and all(0.0 <= h["mean"] <= 1.0 for h in t.history)


def test_full_mode_writes_a_merged_model(model_path, tmp_path):
    t = _run(model_path, tmp_path, 6, mode="full", sigma=0.02, lr=0.02, targets=["q", "v"], batch=0)
    want = t.ev.center()
    from fucina.train.es import Reward, score_batch
    m, tok, tpl, exs = _setup(str(tmp_path / "model.gguf"))
    got = score_batch(m, tok, [], exs, Reward("nll", False), 8)
    assert math.isclose(got, want, rel_tol=2e-2), (got, want)   # merged weights written F16


# -- bad input --------------------------------------------------------------------------------

def test_empty_dataset(model_path, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    m, tok, tpl, _ = _setup(model_path)
    with pytest.raises(DataError, match="empty"):
        read_es_jsonl(tmp_path / "empty.jsonl", tok, tpl)
    with pytest.raises(DataError, match="prompt"):
        es_example({"text": "no prompt"}, tok, tpl)
    with pytest.raises(ESError, match="empty"):
        ESTrainer(m, tok, tpl, _cfg(), [], "nll", progress=False)


@pytest.mark.parametrize("bad", ["raises", "nan"])
def test_failing_reward_keeps_a_checkpoint(model_path, tmp_path, bad):
    calls = {"n": 0}

    def reward(reply, rec):
        calls["n"] += 1
        if calls["n"] > 8 * 4:            # the second iteration fails
            if bad == "raises":
                raise ValueError("judge offline")
            return float("nan")
        return 1.0
    with pytest.raises(ESError, match="judge offline" if bad == "raises" else "non-finite"):
        _run(model_path, tmp_path, 3, reward=reward, max_tokens=2)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert state["iteration"] == 1 and (tmp_path / "adapter.gguf").exists()


def test_resume_refuses_a_gradient_checkpoint(model_path, tmp_path):
    from fucina.train import checkpoint as ckpt
    ckpt.save(tmp_path, dict(step=1))
    with pytest.raises(FucinaError, match="not an ES checkpoint"):
        _run(model_path, tmp_path / "x", 1, resume=str(tmp_path))


def test_jsonl_answer_field(model_path, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                          {"role": "assistant", "content": "It is 4."}], "answer": "4"}) + "\n")
    m, tok, tpl, _ = _setup(model_path)
    (ex,) = read_es_jsonl(f, tok, tpl)
    assert ex.answer == "4" and ex.reply and ex.prompt
    assert tok.decode(ex.reply).startswith("It is 4.")


# -- the two-spirals toy: ES optimizes from random init ---------------------------------------

def _spirals(n: int = 100, turns: float = 1.0):
    t = torch.linspace(0.15, 1.0, n)
    arm = torch.stack([t * torch.cos(t * turns * 2 * math.pi), t * torch.sin(t * turns * 2 * math.pi)], 1)
    return torch.cat([arm, -arm]), torch.cat([torch.zeros(n), torch.ones(n)]).long()


def _mlp(theta, x):
    w1, b1, w2, b2, w3, b3 = theta
    h = torch.tanh(torch.tanh(x @ w1.T + b1) @ w2.T + b2)
    return h @ w3.T + b3


def test_two_spirals_from_scratch():
    """A 2-16-16-2 tanh MLP from random init, no gradient anywhere: rewards are minus the
    cross-entropy of each member; the centre must classify >= 95% of both arms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matmuls: a thread team costs more than it computes
    try:
        x, y = _spirals()
        g = torch.Generator().manual_seed(0)
        shapes = [(16, 2), (16,), (16, 16), (16,), (2, 16), (2,)]
        theta = [torch.randn(s, generator=g) / math.sqrt(s[-1]) if len(s) > 1 else torch.zeros(s)
                 for s in shapes]
        es = Strategy(theta, ESConfig(population=32, sigma=0.1, lr=0.05, norm="zscore"))
        start = float((_mlp(es.theta, x).argmax(1) == y).float().mean())
        acc = start
        for it in range(600):
            es.update([-float(torch.nn.functional.cross_entropy(_mlp(es.member(m), x), y))
                       for m in range(32)])
            if it % 20 == 19:
                acc = float((_mlp(es.theta, x).argmax(1) == y).float().mean())
                if acc >= 0.95:
                    break
        assert start < 0.7 and acc >= 0.95, (start, acc, es.iteration)
    finally:
        torch.set_num_threads(threads)


# -- the command line -------------------------------------------------------------------------

def test_cli_es(model_path, tmp_path, capsys):
    from fucina.cli.main import main
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / "run"
    argv = ["finetune", model_path, "--method", "es", "--reward", "nll", "--data", str(data), "--out", str(out),
            "--iterations", "2", "--population", "4", "--sigma", "0.05", "--seed", "3", "--targets", "q,v",
            "--rank", "2", "--threads", "1"]
    assert main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "es 1/2: reward mean" in err and "es 2/2" in err and " s\n" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and len(summary["history"]) == 2
    from fucina.weights.lora import read_adapter
    ad = read_adapter(out / "adapter.gguf")
    assert set(ad.pairs) == {f"blk.{i}.attn_{p}.weight" for i in range(2) for p in "qv"}
    more = argv[:11] + ["3"] + argv[12:] + ["--resume", str(out)]   # --iterations 3
    assert main(more) == 0
    assert json.loads((out / "summary.json").read_text())["iterations"] == 3
    assert "resumed at iteration 2" in capsys.readouterr().err
    assert main(["finetune", model_path, "--data", str(data), "--out", str(tmp_path / "x"),
                 "--reward", "nll"]) != 0    # an ES flag without --method es
    assert "only with --method es" in capsys.readouterr().err


def test_cli_es_schedule_and_keep_best(model_path, tmp_path, capsys):
    from fucina.cli.main import main
    data, held = tmp_path / "d.jsonl", tmp_path / "h.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    held.write_text("".join(json.dumps(r) + "\n" for r in HELD))
    out = tmp_path / "run"
    argv = ["finetune", model_path, "--method", "es", "--reward", "nll", "--data", str(data), "--out", str(out),
            "--iterations", "4", "--population", "4", "--sigma", "0.05", "--lr", "0.5", "--targets", "q,v",
            "--rank", "2", "--threads", "1", "--schedule", "cosine", "--final-scale", "0.2",
            "--valid", str(held), "--eval-every", "2"]
    assert main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "es 0/4: held-out reward" in err and "(cosine)" in err and "kept the best held-out theta" in err
    summary = json.loads((out / "summary.json").read_text())
    evals = [h["eval"] for h in summary["history"] if "eval" in h]
    assert len(evals) == 2 and summary["best_eval"] >= max(evals)
    assert (out / "adapter.gguf").read_bytes() == (out / "best" / "adapter.gguf").read_bytes()
    assert main(argv[:-4] + ["--keep", "last"]) != 0
    assert "needs --valid" in capsys.readouterr().err


# -- ternary ES: trit flips on the TQ2_0 bytes the kernels read -------------------------------

from fucina.gguf import GGMLType  # noqa: E402
from fucina.quant import dequantize  # noqa: E402
from fucina.train.es_ternary import TernaryStrategy, pack, read_codes, trits  # noqa: E402


def _ternary_theta(shapes, seed=0, g=None):
    g = g or torch.Generator().manual_seed(seed)
    return [pack(torch.randint(-1, 2, s, generator=g), 1 / math.sqrt(s[1] * 2 / 3)) for s in shapes]


def test_trit_codec_matches_dequantize():
    g = torch.Generator().manual_seed(4)
    t = torch.randint(-1, 2, (3, 512), generator=g)
    raw = pack(t, 0.5)
    assert torch.equal(dequantize(raw.reshape(-1), GGMLType.TQ2_0, t.numel()).reshape(3, 512), t.float() * 0.5)
    assert torch.equal(trits(raw, (3, 512)), t.to(torch.int8))
    idx = torch.tensor([0, 31, 32, 127, 128, 300, 1535])
    assert torch.equal(read_codes(raw, (3, 512), idx), t.reshape(-1)[idx] + 1)


def test_ternary_member_and_vote_update_against_direct_rule():
    """A member moves exactly its drawn trits one bin (mirrored: the other way), clamped; the
    update moves the K trits of largest |sum_j (C+ - C-) d_j| one bin toward the vote's sign."""
    shapes = [(4, 256), (2, 256)]
    cfg = ESConfig(population=6, seed=5, flip_rate=0.05, update_fraction=0.01)
    es = TernaryStrategy(_ternary_theta(shapes), shapes, cfg)
    base = [trits(t, s).long().reshape(-1) for t, s in zip(es.theta, shapes)]
    for m in (2, 3):
        got = [trits(t, s).long().reshape(-1) for t, s in zip(es.member(m), shapes)]
        for k in range(2):
            idx, d = es.flips(1, k)
            want = base[k].clone()
            want[idx] = (want[idx] + (1 if m == 2 else -1) * d).clamp(-1, 1)
            assert torch.equal(got[k], want) and idx.numel() == len(set(idx.tolist()))
    rewards = [0.5, 0.1, -0.3, 0.7, 0.2, 0.2]
    r = np.array(rewards)
    c = (np.array([(r < v).sum() + ((r == v).sum() - 1) / 2 for v in r])) / 5 - 0.5
    want = []
    for k, (n, kk) in enumerate(shapes):
        vote = np.zeros(n * kk)
        for j in range(3):
            idx, d = es.flips(j, k)
            vote[idx.numpy()] += (c[2 * j] - c[2 * j + 1]) * d.numpy()
        K = round(0.01 * n * kk)
        order = sorted(np.nonzero(vote)[0], key=lambda i: (-abs(vote[i]), i))[:K]
        w = base[k].numpy().copy()
        for i in order:
            w[i] = min(1, max(-1, w[i] + np.sign(vote[i])))
        want.append(w)
    es.update(rewards)
    for k, s in enumerate(shapes):
        np.testing.assert_array_equal(trits(es.theta[k], s).long().reshape(-1).numpy(), want[k])
    assert es.iteration == 1


def _spiral_net(h1, theta):
    import fucina.kernels as K
    h = torch.tanh(K.matmul(theta[0], GGMLType.TQ2_0, 256, 256, h1))
    return K.matmul(theta[1], GGMLType.TQ2_0, 2, 256, h) * 4


@pytest.mark.skipif(not __import__("fucina.kernels", fromlist=["available"]).available(),
                    reason="the native TQ2_0 kernels are not built")
def test_ternary_two_spirals():
    """Two spirals (1.5 turns) through a fixed tanh feature layer and two ternary layers
    (256 -> 256 -> 2) trained from random trits by trit flips alone, every member scored by
    the native TQ2_0 kernels on its mutated bytes: the centre must classify >= 95%. Members
    split over two evaluators (as two workers would) give the same bytes."""
    import fucina.kernels as K
    threads = K.get_threads()
    K.set_threads(1)
    try:
        x, y = _spirals(100, 1.5)
        g = torch.Generator().manual_seed(0)
        w1, b1 = torch.randn(256, 2, generator=g) * 2, (torch.rand(256, generator=g) * 2 - 1) * math.pi
        h1 = torch.tanh(x @ w1.T + b1 * 0.5)
        shapes = [(256, 256), (2, 256)]
        cfg = ESConfig(population=32, flip_rate=0.002, update_fraction=0.004)
        es = TernaryStrategy(_ternary_theta(shapes, g=g), shapes, cfg)
        # two "workers": each scores its members on its own copy; both apply every reward
        w0, w1_ = TernaryStrategy(es.theta, shapes, cfg), TernaryStrategy(es.theta, shapes, cfg)

        def loss(th):
            return -float(torch.nn.functional.cross_entropy(_spiral_net(h1, th), y))

        def acc(th):
            return float((_spiral_net(h1, th).argmax(1) == y).float().mean())
        start = acc(es.theta)
        a = start
        for it in range(800):
            r = [loss(es.member(m)) for m in range(32)]
            es.update(r)
            if it < 10:
                split = {m: loss((w0 if m % 2 == 0 else w1_).member(m)) for m in range(32)}
                w0.update([split[m] for m in range(32)])
                w1_.update([split[m] for m in range(32)])
                assert all(torch.equal(p, q) and torch.equal(p, s)
                           for p, q, s in zip(w0.theta, w1_.theta, es.theta))
            if it % 25 == 24:
                a = acc(es.theta)
                if a >= 0.95:
                    break
        assert start < 0.6 and a >= 0.95, (start, a, es.iteration)
    finally:
        K.set_threads(threads)


@pytest.fixture(scope="module")
def tq2_path(tmp_path_factory):
    return str(write_model(tmp_path_factory.mktemp("tq2") / "t.gguf", "qwen3", qtype=Q.TQ2_0, hidden=256, heads=4,
                           kv_heads=2, head_dim=64, ffn=512, layers=2, seed=3))


def test_ternary_mode_on_a_tq2_model(tq2_path, model_path, tmp_path):
    """mode ternary on a TQ2_0 GGUF: the nll reward rises, the trained file holds the trained
    trits (and scores what the trainer's theta scored), the same bytes with 2 workers."""
    from fucina.train.es import Reward, score_batch
    kw = dict(mode="ternary", targets=["q", "v", "o", "up", "down"], flip_rate=0.002, update_fraction=0.002,
              batch=0, population=8)
    t = _run(tq2_path, tmp_path / "a", 6, **kw)
    first, last = t.history[0]["mean"], t.ev.center()
    assert last > first, (first, last)
    m, tok, tpl, exs = _setup(str(tmp_path / "a" / "model.gguf"))
    got = score_batch(m, tok, [], exs, Reward("nll", False), 8)
    assert got == last
    src = load_model(tq2_path)
    from fucina.weights.lora import model_weights
    before, after = model_weights(src), model_weights(m)
    moved = [n for n in t.ev.target.names if not torch.equal(before[n].raw, after[n].raw)]
    assert moved and all(torch.equal(after[n].raw, th) for n, th in zip(t.ev.target.names, t.theta))
    assert all(torch.equal(before[n].raw, after[n].raw) for n in before if n not in t.ev.target.names)
    _run(tq2_path, tmp_path / "b", 6, workers=2, **kw)
    assert (tmp_path / "a" / "model.gguf").read_bytes() == (tmp_path / "b" / "model.gguf").read_bytes()
    with pytest.raises(ESError, match="TQ2_0"):
        _run(model_path, tmp_path / "c", 1, mode="ternary")


def test_cli_es_ternary(tq2_path, tmp_path, capsys):
    from fucina.cli.main import main
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / "run"
    argv = ["finetune", tq2_path, "--method", "es", "--mode", "ternary", "--reward", "nll", "--data", str(data),
            "--out", str(out), "--iterations", "2", "--population", "4", "--flip-rate", "0.002",
            "--update-fraction", "0.002", "--targets", "q,v", "--threads", "1"]
    assert main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "ES ternary on q,v" in err and "flip rate 0.002" in err and "es 2/2: reward mean" in err
    assert json.loads((out / "summary.json").read_text())["out"].endswith("model.gguf")
    m = load_model(str(out / "model.gguf"))
    assert m.layers and m.config.arch == "qwen3"


def test_resume_a_checkpoint_from_before_the_schedule(model_path, tmp_path):
    """A checkpoint written before the schedule and ternary fields existed resumes (it ran
    with their defaults); one that differs in a field it has is still refused."""
    _run(model_path, tmp_path, 2)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    for k in ("schedule", "horizon", "final_scale", "step_every", "step_gamma", "decay_sigma", "flip_rate",
              "update_fraction"):
        del state["config"][k]
    torch.save(state, tmp_path / "checkpoint.pt")
    assert _run(model_path, tmp_path, 3, resume=str(tmp_path)).iteration == 3
    with pytest.raises(CheckpointError, match="schedule"):
        _run(model_path, tmp_path, 4, resume=str(tmp_path), schedule="step")
