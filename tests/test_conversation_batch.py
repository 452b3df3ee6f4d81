"""Lockstep batch decode: N streams in one weight pass == N sequential runs."""
import pytest
import torch

from fucina.errors import FucinaError, KVCacheError
from fucina.text.batch import forward_step_batch, generate_batch
from fucina.text.generate import decode, prefill, run
from fucina.text.sampler import Sampler, SamplingConfig
from test_chat_support import FakeTokenizer, ScriptedDecoder, tiny_llama

PROMPTS = [[5, 6, 7], [100, 3, 4, 9, 12, 40], [250], [17, 17, 17, 17]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_step_batch_matches_sequential(tmp_path, arch):
    m = tiny_llama(str(tmp_path), arch=arch)
    seq, bat = [m.init_cache(32) for _ in PROMPTS], [m.init_cache(32) for _ in PROMPTS]
    for p, a, b in zip(PROMPTS, seq, bat):
        m.forward_step(a, p, 0)
        m.forward_step(b, p, 0)
    nxt = [1, 2, 3, 4]
    want = torch.stack([m.forward_step(c, [t], c.len) for c, t in zip(seq, nxt)])
    got = forward_step_batch(m, bat, nxt)
    assert got.shape == (4, 300)
    assert torch.allclose(got, want, atol=1e-4)
    for a, b in zip(seq, bat):
        assert a.len == b.len
        assert torch.allclose(a.keys(1, a.len).float(), b.keys(1, b.len).float(), atol=1e-3)


def sequential(m, tok, prompts, cfgs, max_tokens):
    out = []
    for p, cfg in zip(prompts, cfgs):
        cache, hist = m.init_cache(64), []
        logits, _ = prefill(m, cache, hist, p)
        out.append(run(decode(m, cache, hist, logits, Sampler(cfg), tok, max_tokens=max_tokens)))
    return out


@pytest.mark.parametrize("sampled", [False, True])
def test_generate_batch_equals_sequential_runs(tmp_path, sampled):
    m = tiny_llama(str(tmp_path))
    tok = FakeTokenizer()
    cfgs = [SamplingConfig(temperature=0.9 if sampled else 0, top_k=20, seed=s) for s in range(4)]
    want = sequential(m, tok, PROMPTS, cfgs, 12)
    got = generate_batch(m, tok, PROMPTS, [Sampler(c) for c in cfgs], max_tokens=12, capacity=64)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.text for r in got] == [r.text for r in want]


def test_streams_stop_independently():
    m = ScriptedDecoder("Hi there")
    tok = FakeTokenizer()
    marker = tok.encode("<|im_start|>assistant\n")
    prompts = [marker, tok.encode("x") + marker, marker]
    pieces = {0: [], 1: [], 2: []}
    got = generate_batch(m, tok, prompts, [Sampler() for _ in prompts], max_tokens=20,
                         stop_ids=[257], stop=["ere"], capacity=64,
                         on_piece=lambda s, p: pieces[s].append(p))
    assert [r.text for r in got] == ["Hi th"] * 3
    assert all(r.fired_stop == 0 for r in got)
    assert "".join(pieces[1]) == "Hi th"


def test_batch_errors(tmp_path):
    m = tiny_llama(str(tmp_path))
    c = m.init_cache(8)
    with pytest.raises(FucinaError):
        forward_step_batch(m, [], [])
    with pytest.raises(FucinaError):
        forward_step_batch(m, [c], [1, 2])
    with pytest.raises(KVCacheError):
        forward_step_batch(m, [c, c], [1, 2])
    full = m.init_cache(1)
    m.forward_step(full, [1], 0)
    with pytest.raises(KVCacheError):
        forward_step_batch(m, [full], [2])


def test_send_batch_equals_plain_sends(tmp_path):
    from fucina.text.chat_template import ChatTemplate
    from fucina.text.conversation import Conversation, send_batch
    from fucina.text.logit_processor import BanTokens
    m = tiny_llama(str(tmp_path))
    tok = FakeTokenizer()
    t = ChatTemplate.builtin("chatml")
    ban = lambda: BanTokens([i for i in range(300) if i not in set(b"abcdefgh ") | {257}])

    def make(i):
        return Conversation(m, tok, t, system=f"S{i}", max_tokens=6, capacity=128, processor=ban(),
                            sampling=SamplingConfig(temperature=0.8, seed=i))

    plain, lock = [make(i) for i in range(3)], [make(i) for i in range(3)]
    users = ["hi", "hello there", "x"]
    for turn in range(2):
        want = [c.send(u) for c, u in zip(plain, users)]
        got = send_batch(lock, users)
        assert got == want
        assert [c.tokens for c in lock] == [c.tokens for c in plain]
        assert [c.messages for c in lock] == [c.messages for c in plain]
    with pytest.raises(FucinaError):
        send_batch([lock[0], lock[0]], ["a", "b"])
