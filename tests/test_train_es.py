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
                             pair_noise, parse_reward, read_es_jsonl)
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


def _run(path, out, iterations, reward="nll", workers=1, resume=None, init=None, **kw):
    m, tok, tpl, exs = _setup(path)
    t = ESTrainer(m, tok, tpl, _cfg(**kw), exs, reward, str(out), workers=workers, model_path=path,
                  progress=False, init=init)
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


def test_bad_config():
    for kw in (dict(population=3), dict(sigma=0.0), dict(lr=float("nan")), dict(mode="x"),
               dict(norm="x"), dict(anchor="l3")):
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
