"""Sampler: llama.cpp's chain, hand-computed penalties and truncation steps, seeding."""
import math

import numpy as np
import pytest
import torch

from fucina.errors import SamplingError
from fucina.text.logit_processor import BanTokens, LogitBias, LogitProcessor, ProcessorChain
from fucina.text.sampler import MT19937, SamplingConfig, Sampler, apply_penalties, sample_candidates


def test_greedy_default_never_touches_rng():
    s = Sampler()
    before = s.rng._rs.get_state()[1].copy()
    assert s.next(torch.tensor([0.1, 0.2, 0.9, 0.3, 0.0])) == 2
    assert s.draws == 0
    assert (s.rng._rs.get_state()[1] == before).all()


def test_greedy_first_maximum():
    assert Sampler().next(torch.tensor([1.0, 3.0, 3.0, 0.0])) == 1


def test_mt19937_matches_libstdcxx_uniform_real_distribution():
    # printed by: std::mt19937 g(s); std::uniform_real_distribution<double> d(0, 1); d(g)
    golden = {0: [0.59284461651668263, 0.84426574425659828, 0.85794561998982988],
              42: [0.79654298428784598, 0.18343478789336848, 0.77969099761266125],
              5489: [0.1354770042967805, 0.8350085899945795, 0.96886777112423139]}
    for seed, want in golden.items():
        r = MT19937(seed)
        assert [r.uniform() for _ in want] == want


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.zeros(50)
    cfg = SamplingConfig(temperature=1.0, seed=7)
    a, b = Sampler(cfg), Sampler(cfg)
    seq_a = [a.next(logits) for _ in range(40)]
    assert seq_a == [b.next(logits) for _ in range(40)]
    c = Sampler(SamplingConfig(temperature=1.0, seed=8))
    assert seq_a != [c.next(logits) for _ in range(40)]
    assert a.draws == 40
    a.reseed()
    assert [a.next(logits) for _ in range(40)] == seq_a


def test_penalties_hand_computed():
    cfg = SamplingConfig(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    x = torch.tensor([2.0, -1.0, 0.5, 3.0])
    apply_penalties(x, [0, 1, 0, 3], cfg)
    # t0: count 2, 2.0/2 = 1.0, - (2*0.5 + 0.25) = -0.25
    # t1: count 1, -1.0*2 = -2.0, - 0.75 = -2.75; t2 untouched; t3: 3/2 - 0.75 = 0.75
    assert x.tolist() == [-0.25, -2.75, 0.5, 0.75]


def test_penalty_window_is_last_n():
    cfg = SamplingConfig(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=2)
    x = torch.tensor([2.0, -1.0, 0.5, 3.0])
    apply_penalties(x, [0, 1, 0, 3], cfg)  # window [0, 3]: each count 1
    assert x.tolist() == [0.25, -1.0, 0.5, 0.75]


def test_penalties_disabled_by_window_zero_and_neutral_values():
    x = torch.tensor([2.0, -1.0])
    apply_penalties(x, [0, 1], SamplingConfig(repeat_penalty=2.0, repeat_last_n=0))
    apply_penalties(x, [0, 1], SamplingConfig())
    assert x.tolist() == [2.0, -1.0]


def test_penalties_steer_greedy():
    s = Sampler(SamplingConfig(repeat_penalty=4.0))
    logits = torch.tensor([1.0, 0.9, 0.1])
    assert s.next(logits, history=[0]) == 1   # 1.0/4 = 0.25 < 0.9
    assert logits.tolist() == pytest.approx([1.0, 0.9, 0.1])  # the caller's row is untouched


# five tokens with probabilities 0.5, 0.2, 0.15, 0.1, 0.05, placed out of order
PROBS = {3: 0.5, 0: 0.2, 4: 0.15, 1: 0.1, 2: 0.05}
LOGITS = np.array([math.log(PROBS[i]) for i in range(5)], dtype=np.float32)


def draw(u, **kw):
    kw.setdefault("temperature", 1.0)
    return sample_candidates(LOGITS, SamplingConfig(**kw), u)


def test_top_p_keeps_smallest_prefix_reaching_p():
    # sorted cum: 0.5, 0.7, 0.85 >= 0.8 -> keep {3, 0, 4}; renormalized .588 .235 .176
    assert draw(0.0, top_p=0.8) == 3
    assert draw(0.58, top_p=0.8) == 3
    assert draw(0.60, top_p=0.8) == 0
    assert draw(0.82, top_p=0.8) == 0
    assert draw(0.83, top_p=0.8) == 4
    assert draw(0.99999, top_p=0.8) == 4


def test_min_p_floor_relative_to_best():
    # min-p alone keeps vocab order (llama.cpp's unsorted path)
    # floor 0.15 keeps ids 0, 3, 4 (0.2, 0.5, 0.15 -> cum .235 .823 1.0)
    assert [draw(u, min_p=0.3) for u in (0.2, 0.3, 0.9)] == [0, 3, 4]
    # floor 0.175 keeps ids 0, 3 (cum .286, 1.0)
    assert [draw(u, min_p=0.35) for u in (0.2, 0.3, 0.99999)] == [0, 3, 3]


def test_top_k_then_renormalize():
    # top-2: 0.5, 0.2 -> 0.714, 0.286
    assert draw(0.70, top_k=2) == 3
    assert draw(0.72, top_k=2) == 0
    assert draw(0.99999, top_k=1) == 3


def test_temperature_scales_survivors():
    # top-2 at T=0.5: 0.25 : 0.04 -> 0.862, 0.138
    assert draw(0.85, top_k=2, temperature=0.5) == 3
    assert draw(0.87, top_k=2, temperature=0.5) == 0


def test_top_p_measured_at_temperature_one_as_llama_cpp():
    # llama.cpp's chain runs temperature last: top_p 0.8 keeps three tokens even at
    # T=0.5 (tempered, only two would reach 0.8)
    assert draw(0.99999, top_p=0.8, temperature=0.5) == 4


def test_no_truncation_walks_vocab_order():
    # unsorted candidates: cumulative in id order 0.2, 0.3, 0.35, 0.85, 1.0
    assert draw(0.1) == 0
    assert draw(0.25) == 1
    assert draw(0.5) == 3
    assert draw(0.9) == 4


def test_large_vocab_nucleus_matches_full_sort():
    rng = np.random.default_rng(0)
    for top_p in (0.5, 0.9, 0.999):
        x = (rng.standard_normal(5000) * 3).astype(np.float32)
        order = np.argsort(-x, kind="stable")
        p = np.exp(x[order] - x[order[0]], dtype=np.float32)
        p /= np.cumsum(p, dtype=np.float32)[-1]
        keep = int(np.nonzero(np.cumsum(p, dtype=np.float32) >= np.float32(top_p))[0][0]) + 1
        for u in (0.0, 0.3, 0.999999):
            got = sample_candidates(x, SamplingConfig(temperature=1.0, top_p=top_p), u)
            assert got in set(order[:keep].tolist())
        assert sample_candidates(x, SamplingConfig(temperature=1.0, top_p=top_p), 0.999999) == order[keep - 1]


def test_sampled_frequencies_follow_softmax():
    s = Sampler(SamplingConfig(temperature=1.0, seed=123))
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    counts = np.bincount([s.next(logits) for _ in range(3000)], minlength=3) / 3000
    assert counts == pytest.approx([0.6, 0.3, 0.1], abs=0.03)


class OddMask(LogitProcessor):
    def __init__(self):
        self.commits = []

    def process(self, logits, history):
        logits[1::2] = float("-inf")

    def commit(self, token):
        self.commits.append(token)


def test_processor_masks_before_sampling_and_observes_every_pick():
    mask = OddMask()
    s = Sampler(processor=mask)
    assert s.next(torch.tensor([0.1, 0.9, 0.5, 0.8])) == 2
    s2 = Sampler(SamplingConfig(temperature=1.5, seed=3), processor=mask)
    picks = [s2.next(torch.tensor([0.1, 0.9, 0.5, 0.8])) for _ in range(30)]
    assert all(t % 2 == 0 for t in picks)
    assert mask.commits == [2] + picks
    assert not mask.has_structure()


def test_all_masked_is_typed_error():
    with pytest.raises(SamplingError):
        Sampler(processor=BanTokens([0, 1, 2])).next(torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(SamplingError):
        Sampler(SamplingConfig(temperature=1.0)).next(torch.full((4,), float("-inf")))
    with pytest.raises(SamplingError):
        Sampler().next(torch.tensor([0.0, float("nan")]))


def test_a_nan_anywhere_is_a_typed_error_and_ties_take_the_first():
    from fucina.text.sampler import first_argmax
    row = torch.randn(49152)
    row[7] = row[40000] = row.max() + 1.0
    assert first_argmax(row) == 7 == int(torch.argmax(row))       # the first maximum
    for where in (0, 123, 49151):                  # a NaN below the top still stops the draw
        bad = row.clone()
        bad[where] = float("nan")
        for cfg in (SamplingConfig(), SamplingConfig(temperature=0.8, seed=1)):
            with pytest.raises(SamplingError, match="NaN"):
                Sampler(cfg).next(bad)


def test_the_callers_logits_are_left_as_they_were():
    row = torch.tensor([0.5, 2.0, 1.0, -1.0])
    kept = row.clone()
    Sampler(SamplingConfig(repeat_penalty=1.5, frequency_penalty=0.5)).next(row, [1, 1, 2])
    Sampler(processor=BanTokens([1])).next(row)
    Sampler(SamplingConfig(temperature=0.7, seed=3)).next(row)
    assert torch.equal(row, kept)


def test_masked_tokens_never_drawn():
    s = Sampler(SamplingConfig(temperature=1.0, seed=1), processor=BanTokens([0]))
    assert all(s.next(torch.tensor([5.0, 0.0, 0.0])) != 0 for _ in range(200))


def test_logit_bias_and_chain():
    chain = ProcessorChain([LogitBias({0: 10.0}), BanTokens([0])])
    assert Sampler(processor=LogitBias({2: 1.0})).next(torch.tensor([1.0, 0.0, 0.5])) == 2
    assert Sampler(processor=chain).next(torch.tensor([1.0, 0.0, 0.5])) == 2


def test_config_from_kwargs():
    c = SamplingConfig.from_kwargs(temp=0.7, top_k=None, seed=5)
    assert (c.temperature, c.top_k, c.seed) == (0.7, 0, 5)
    with pytest.raises(TypeError):
        SamplingConfig.from_kwargs(tempreature=1)
    with pytest.raises(SamplingError):
        SamplingConfig(repeat_penalty=0)
