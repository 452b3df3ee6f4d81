"""Speculative decoding: the indexes' unit cases, and the decoder's contract: the
speculative stream is the plain stream token for token (and draw for draw)."""
import random

import pytest
import torch

from fucina.errors import FucinaError
from fucina.text.generate import Reply, decode, prefill, run
from fucina.text.sampler import Sampler, SamplingConfig
from fucina.text.speculative import (DEFAULT_COST_TABLE, CostGate, DraftSource, SamIndex, Speculation,
                                     SpeculationIndex, SpeculativeDecoder, TokenRecycling, batch_invariant,
                                     table_cost)
from fucina.text.speculative.gate import default_cost_table as isa_cost_table
from fucina.text.speculative.sam import Cursor, SpeculationError, frozen_index
from test_chat_support import FakeTokenizer, tiny_llama


# -- SamIndex ------------------------------------------------------------------------

def test_sam_seed_case():
    sam = SamIndex()
    sam.append([5, 6, 7, 5, 6])
    assert sam.match_len() == 2
    assert sam.draft(8) == [7, 5, 6]
    assert sam.draft(5, periodic=True) == [7, 5, 6, 7, 5]


def _brute_match(stream):
    n = len(stream)
    for L in range(n - 1, 0, -1):
        suf = stream[n - L:]
        if any(stream[e - L + 1:e + 1] == suf for e in range(L - 1, n - 1)):
            return L
    return 0


@pytest.mark.parametrize("alphabet", [2, 3, 7])
def test_sam_match_len_and_draft_against_brute_force(alphabet):
    rng = random.Random(alphabet)
    sam = SamIndex(min_match=1)
    stream = []
    for _ in range(150):
        t = rng.randrange(alphabet)
        stream.append(t)
        sam.append([t])
        L = sam.match_len()
        assert L == _brute_match(stream)
        d = sam.draft(5)
        if L:   # the draft follows a true earlier occurrence of the matched suffix
            ends = [e for e in range(L - 1, len(stream) - 1) if stream[e - L + 1:e + 1] == stream[-L:]]
            assert any(stream[e + 1:e + 1 + len(d)] == d for e in ends) and d


def test_sam_prefers_the_most_recent_occurrence():
    sam = SamIndex()
    sam.append([1, 2, 9, 9, 1, 2, 8, 8, 1, 2])
    assert sam.draft(2) == [8, 8]


def test_sam_frozen_cursor_and_errors():
    doc = frozen_index([10, 11, 12, 13, 14, 15])
    cur = Cursor()
    for t in [99, 12, 13]:
        doc.advance(cur, t)
    assert cur.len == 2 and doc.draft_from(cur, 3) == [14, 15]
    doc.advance(cur, 7)
    assert cur.len == 0 and doc.draft_from(cur) == []
    with pytest.raises(SpeculationError):
        doc.append([1])


def test_sam_failed_append_poisons():
    sam = SamIndex()
    sam.append([1, 2, 1, 2])
    with pytest.raises(ValueError):
        sam.append([1, "x"])
    assert sam.poisoned and sam.match_len() == 0 and sam.draft() == []
    with pytest.raises(SpeculationError):
        sam.append([3])


# -- token recycling and the cascade -------------------------------------------------

def test_recycling_seed_case_and_promotion():
    rec = TokenRecycling(32)
    rec.update(3, [7, 9])
    rec.update(7, [5])
    assert rec.draft_chain(3, 4) == [7, 5]
    rec.observe([3, 9])                     # the committed bigram wins slot 0
    assert rec.topk_of(3) == [9, 7]
    assert rec.draft_chain(3, 4) == [9]


def test_cascade_seed_case_and_reference():
    index = SpeculationIndex(1024)
    index.observe([1, 2, 3, 4, 1, 2])
    d = index.suggest([1, 2, 3, 4, 1, 2], 16)
    assert d[:2] == [3, 4]
    index.add_reference([7, 8, 9, 10, 11, 12])
    assert index.wants_topk
    index.observe([4, 7, 8, 9])            # the reference now matches [7, 8, 9] (3 > 0)
    assert index.suggest([0], 16)[:3] == [10, 11, 12]


def test_cascade_mutes_a_source_that_stops_paying():
    index = SpeculationIndex(64, mute_commits=10)
    stream = [1, 2, 3, 4] * 3
    index.observe(stream)
    gate = index.conv_gate
    for _ in range(3):                     # 12 drafted, none accepted: too few to judge
        gate.settle(4, 0)
    assert not gate.muted()
    gate.settle(4, 0)                      # 16: muted
    assert gate.muted()
    assert index.suggest(stream, 4) == [1, 2, 3, 4]
    assert index._pending[0] is index.rec_gate   # from recycling: the conversation is muted
    index.observe([6] * 10)                # muted for 10 committed tokens, then re-probed
    assert not gate.muted() and index.suggest(stream + [6] * 10, 4) == [6, 6, 6, 6]


def test_sync_rebuilds_after_a_rewind():
    index = SpeculationIndex(64)
    index.sync([1, 2, 3, 1, 2])
    assert index.suggest([1, 2, 3, 1, 2], 4)[:1] == [3]
    index.sync([4, 5, 6, 4, 5])            # not an extension: rebuilt from this history
    assert index.conv.tokens == [4, 5, 6, 4, 5] and index.suggest([4, 5], 4)[:1] == [6]


# -- the cost gate ---------------------------------------------------------------------

@pytest.fixture(autouse=True)
def avx512_cost_table(monkeypatch):
    """The gate's unit cases price on AVX-512's table whatever ISA the host runs (an
    AVX2-only machine's default table is AVX2's)."""
    from fucina.text.speculative import gate as gate_mod
    monkeypatch.setattr(gate_mod, "default_cost_table", lambda: DEFAULT_COST_TABLE)


def test_the_default_cost_table_is_the_running_isas():
    from fucina import kernels
    from fucina.text.speculative.gate import COST_TABLES

    before = kernels.isa()
    try:
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            assert isa_cost_table() == COST_TABLES.get(isa, DEFAULT_COST_TABLE)
    finally:
        kernels.set_isa(before)
    assert COST_TABLES["avx2"][4][1] > COST_TABLES["avx2vnni"][4][1] > DEFAULT_COST_TABLE[4][1]

def test_cost_gate_switches_off_reprobes_with_backoff_and_recovers():
    g = CostGate(max_draft=8, reprobe_after=4, reprobe_max=16, probe_steps=2, timed=False)
    for _ in range(3):
        g.settle(8, 0, 1)                  # 1 token for ~1.9 steps of cost
    assert g.active()                      # four passes before a verdict
    g.settle(8, 0, 1)
    assert not g.active()
    for _ in range(4):
        g.tick()
    assert g.active()                      # probing
    g.settle(8, 0, 1)
    g.settle(8, 0, 1)
    assert not g.active() and g.off_for == 4 and g.backoff == 8
    for _ in range(4):
        g.tick()
    g.settle(8, 8, 9)
    g.settle(8, 8, 9)                      # the probe pays: back on, backoff reset
    assert g.active() and g.on and g.backoff == 4
    assert g.budget() >= 2


def test_cost_gate_rescales_by_measured_times():
    g = CostGate()
    g.record(4, 0.500)                     # the first pass of a shape is warm-up: not timed
    for _ in range(4):
        g.record(0, 0.010)
        g.record(4, 0.0175)                # 1.75 steps where the table says 1.5
    assert g.cost(4) == pytest.approx(1.75)
    # every length follows one factor on the table's extra-row cost (0.75 / 0.5 here)
    assert g.cost(2) == pytest.approx(1 + 1.5 * (table_cost(DEFAULT_COST_TABLE, 2) - 1))
    for _ in range(4):
        g.record(8, 0.500)                 # a noisy outlier: the factor is clamped at 2
    assert g.cost(8) == pytest.approx(1 + 2 * (table_cost(DEFAULT_COST_TABLE, 8) - 1))
    assert all(g.cost(k) <= g.cost(k + 1) for k in range(1, 16))   # more rows never cost less


def test_streams_on_one_model_share_their_measured_costs():
    from fucina.text.speculative.gate import TIMED_AFTER, shared_costs

    class M:
        pass
    model, other = M(), M()
    a, b = CostGate(), CostGate()
    a.bind(shared_costs(model))
    assert b.cost(4) == table_cost(DEFAULT_COST_TABLE, 4)
    for _ in range(TIMED_AFTER):                 # stream a times its passes ...
        a.record(0, 0.010)
        a.record(4, 0.0175)
    b.bind(shared_costs(model))                  # ... a later stream on the model starts from them
    assert b.cost(4) == pytest.approx(1.75) == a.cost(4)
    c = CostGate()
    c.bind(shared_costs(other))                  # another model: its own
    assert c.cost(4) == table_cost(DEFAULT_COST_TABLE, 4)


def test_cost_gate_never_counts_a_verify_row_as_free():
    g = CostGate(max_draft=4)
    for _ in range(4):                     # a loaded box's wall clock: 2 rows "cheaper" than 1
        g.record(0, 0.010)
        g.record(1, 0.008)
    assert g.cost(1) > 1.0
    for _ in range(4):                     # so zero-acceptance passes switch speculation off
        g.settle(1, 0, 1)
    assert not g.on


# -- the decoder: speculative == plain ------------------------------------------------

class OracleSource(DraftSource):
    """Drafts the plain run's own continuation, corrupted at every `bad`-th position,
    so acceptance, corrections and bonus tokens all happen. Speed only: never correctness."""

    def __init__(self, expected, bad=5, n_vocab=300):
        self.expected, self.bad, self.n_vocab = list(expected), bad, n_vocab
        self.observed = []

    def suggest(self, context, n):
        pos = len(context)
        d = self.expected[pos:pos + n + 3]          # too long on purpose: the decoder clamps
        return [(t + 1) % self.n_vocab if (pos + j) % self.bad == 0 else t for j, t in enumerate(d)]

    def observe(self, committed):
        self.observed.extend(committed)


SAMPLINGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.8, seed=7),
    SamplingConfig(temperature=1.1, top_k=20, top_p=0.9, seed=3),
    SamplingConfig(temperature=0.7, min_p=0.05, repeat_penalty=1.2, frequency_penalty=0.3,
                   presence_penalty=0.2, seed=11),
]
PROMPT = [ord(c) for c in "abcabcabc the cat sat; the cat sat; the cat"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    m = tiny_llama(str(tmp_path_factory.mktemp("spec")))
    yield m


def generate_ids(model, cfg, *, spec=None, max_tokens=40, stop=(), stop_ids=(), capacity=256, prompt=PROMPT):
    cache = model.init_cache(capacity)
    history: list[int] = []
    logits, _ = prefill(model, cache, history, prompt)
    sampler = Sampler(cfg)
    pieces = []
    reply = run(decode(model, cache, history, logits, sampler, FakeTokenizer(), max_tokens=max_tokens,
                       stop=stop, stop_ids=stop_ids, spec=spec), pieces.append)
    assert cache.len == len(history)
    return reply, history, sampler.draws, "".join(pieces)


@pytest.mark.parametrize("cfg", SAMPLINGS, ids=["greedy", "temp", "topk-topp", "minp-penalties"])
def test_spec_equals_plain_with_the_cascade(tiny, cfg):
    plain = generate_ids(tiny, cfg, max_tokens=60)
    spec = Speculation(300, pin_rows=True, gate=CostGate(timed=False))
    got = generate_ids(tiny, cfg, spec=spec, max_tokens=60)
    assert got[1] == plain[1] and got[2] == plain[2] and got[3] == plain[3]
    assert got[0].finish_reason == plain[0].finish_reason
    assert spec.stats.committed == len(plain[0].tokens)


@pytest.mark.parametrize("cfg", SAMPLINGS, ids=["greedy", "temp", "topk-topp", "minp-penalties"])
def test_spec_equals_plain_through_accepts_corrections_and_bonus(tiny, cfg):
    plain = generate_ids(tiny, cfg, max_tokens=32)
    oracle = OracleSource(plain[1], bad=6)
    dec = SpeculativeDecoder(oracle, max_draft=4, pin_rows=True, gate=CostGate(timed=False, adapt_budget=False))
    got = generate_ids(tiny, cfg, spec=dec, max_tokens=32)
    assert got[1] == plain[1] and got[2] == plain[2] and got[3] == plain[3]
    s = dec.stats
    assert s.accepted > 0 and s.rejected_steps > 0 and s.bonus > 0
    assert s.committed == len(plain[0].tokens) and s.steps < s.committed
    assert oracle.observed == plain[1][len(PROMPT):]         # every committed token observed once


def test_spec_equals_plain_at_stops_and_limits(tiny):
    cfg = SamplingConfig(temperature=0.9, seed=5)
    free = generate_ids(tiny, cfg, max_tokens=40)
    text, toks = free[0].text, free[0].tokens
    cases = [dict(stop=[text[20:23]]), dict(stop_ids=[toks[17]]), dict(max_tokens=13),
             dict(capacity=len(PROMPT) + 9)]
    for kw in cases:
        plain = generate_ids(tiny, cfg, **{"max_tokens": 40, **kw})
        dec = SpeculativeDecoder(OracleSource(free[1], bad=9), pin_rows=True, gate=CostGate(timed=False))
        got = generate_ids(tiny, cfg, spec=dec, **{"max_tokens": 40, **kw})
        assert (got[1], got[2], got[3]) == (plain[1], plain[2], plain[3]), kw
        assert (got[0].finish_reason, got[0].fired_stop, got[0].stop_token) == \
            (plain[0].finish_reason, plain[0].fired_stop, plain[0].stop_token), kw
        assert dec.stats.accepted > 0, kw


@pytest.mark.skipif(not batch_invariant(), reason="needs batch-invariant kernels (issue 10): "
                    "until then a batched verify row may differ from a single step in the last bits")
@pytest.mark.parametrize("native", [False, True])
def test_batched_verify_equals_plain(tiny, native):
    tiny.use_native_step = native
    try:
        for cfg in SAMPLINGS:
            plain = generate_ids(tiny, cfg, max_tokens=48)
            dec = SpeculativeDecoder(OracleSource(plain[1], bad=6), gate=CostGate(timed=False))
            got = generate_ids(tiny, cfg, spec=dec, max_tokens=48)
            assert got[1] == plain[1] and got[2] == plain[2]
    finally:
        del tiny.use_native_step


def test_batched_verify_is_lossless_relative_to_its_rows(tiny, monkeypatch):
    """Any kernels: every committed token is what the full sampler draws from the verify
    row it came from (the contract relative to the verify pass; the batched verify is
    forced on for the recording wrapper, which has no native cache of its own)."""
    monkeypatch.setattr("fucina.text.speculative.decoder.rows_invariant", lambda m, c: True)
    cfg = SamplingConfig(temperature=0.8, seed=2)
    seen = []

    class Recorder:
        def __init__(self, m):
            self.m, self.config, self.init_cache = m, m.config, m.init_cache

        def forward_step(self, cache, tokens, pos0):
            out = self.m.forward_step(cache, tokens, pos0)
            seen.append((list(tokens), [out]))
            return out

        def forward_step_all_logits(self, cache, tokens, pos0):
            out = self.m.forward_step_all_logits(cache, tokens, pos0)
            seen.append((list(tokens), list(out)))
            return out

    plain = generate_ids(tiny, cfg, max_tokens=40)
    dec = SpeculativeDecoder(OracleSource(plain[1], bad=5), gate=CostGate(timed=False))
    reply, hist, _, _ = generate_ids(Recorder(tiny), cfg, spec=dec, max_tokens=40)
    replay = Sampler(cfg)
    out = hist[:len(PROMPT)]
    expected = list(hist[len(PROMPT):])
    # replay: each committed token is sampled from the row after the token before it
    for toks, rs in seen:
        for j, row in enumerate(rs):
            if len(out) - len(PROMPT) >= len(expected):
                break
            tok = replay.next(row, out)
            if tok != expected[len(out) - len(PROMPT)]:
                raise AssertionError("committed token differs from its verify row's sample")
            out.append(tok)
            if j + 1 < len(toks) and toks[j + 1] != tok:
                break
    assert out == hist and any(len(rs) > 1 for _, rs in seen)


def test_verify_error_restores_the_cache(tiny, monkeypatch):
    monkeypatch.setattr("fucina.text.speculative.decoder.rows_invariant", lambda m, c: True)
    class Broken:
        def __init__(self, m):
            self.m, self.config = m, m.config

        def forward_step(self, cache, tokens, pos0):
            return self.m.forward_step(cache, tokens, pos0)

        def forward_step_all_logits(self, cache, tokens, pos0):
            self.m.forward_step_all_logits(cache, tokens, pos0)   # rows written, then a failure
            raise RuntimeError("verify failed")

    plain = generate_ids(tiny, SamplingConfig(), max_tokens=20)
    model = Broken(tiny)
    cache = model.m.init_cache(128)
    history: list[int] = []
    logits, _ = prefill(model, cache, history, PROMPT)
    dec = SpeculativeDecoder(OracleSource(plain[1], bad=100), gate=CostGate(timed=False))
    with pytest.raises(RuntimeError):
        run(decode(model, cache, history, logits, Sampler(), FakeTokenizer(), max_tokens=20, spec=dec))
    assert cache.len == len(history) == len(PROMPT)


def test_decoder_rejects_bad_options_and_bad_drafts(tiny):
    with pytest.raises(FucinaError):
        SpeculativeDecoder(DraftSource(), min_draft=0)
    with pytest.raises(FucinaError):
        SpeculativeDecoder(SpeculationIndex(300), topk_feedback=0)

    class Liar(DraftSource):
        def suggest(self, context, n):
            return [10 ** 9, -1, 5]                        # out-of-vocab: dropped, plain step

    plain = generate_ids(tiny, SamplingConfig(), max_tokens=12)
    dec = SpeculativeDecoder(Liar(), gate=CostGate(timed=False))
    assert generate_ids(tiny, SamplingConfig(), spec=dec, max_tokens=12)[1] == plain[1]
    assert dec.stats.spec_steps == 0 and dec.stats.fallback_steps > 0


# -- front ends: Conversation and the Python API --------------------------------------

@pytest.fixture
def exact(monkeypatch):
    """Row-by-row verify: bitwise single steps on today's kernels."""
    monkeypatch.setattr(Speculation, "pin_rows_default", True)


def test_conversation_spec_equals_plain_across_turns(tiny, exact):
    from fucina.text.chat_template import ChatTemplate
    from fucina.text.conversation import Conversation
    chatml = ChatTemplate.builtin("chatml", bos_token="<s>", eos_token="</s>")
    turns = ["say abc abc abc", "and again: abc abc abc abc", "quote your first reply"]
    for cfg in (SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, seed=4)):
        plain = Conversation(tiny, FakeTokenizer(), chatml, sampling=cfg, max_tokens=20, stop=["c a"])
        spec = Conversation(tiny, FakeTokenizer(), chatml, sampling=cfg, max_tokens=20, stop=["c a"],
                            speculative=True, references=["abc abc abc abc"])
        for t in turns:
            assert spec.send(t) == plain.send(t)
            assert spec.tokens == plain.tokens and spec.cache.len == len(spec.tokens)
            assert spec.sampler.draws == plain.sampler.draws
            assert (spec.last.finish_reason, spec.last.fired_stop) == (plain.last.finish_reason,
                                                                       plain.last.fired_stop)
        assert spec.spec_stats.committed >= sum(1 for m in spec.messages if m["role"] == "assistant")
    with pytest.raises(FucinaError):
        plain.add_reference("x")


def test_api_generate_stream_chat_speculative(tiny, exact):
    from fucina.text.api import LLM
    from fucina.text.chat_template import ChatTemplate
    llm = LLM(tiny, FakeTokenizer(), ChatTemplate.builtin("chatml", bos_token="<s>", eos_token="</s>"))
    prompt = "the cat sat; the cat sat; the cat"
    for opts in (dict(temperature=0.0), dict(temperature=0.8, seed=9, top_k=40)):
        want = llm.generate(prompt, max_tokens=30, **opts)
        assert llm.generate(prompt, max_tokens=30, speculative=True, references=["the cat sat"],
                            **opts) == want
        assert "".join(llm.stream(prompt, max_tokens=30, speculative=True, **opts)) == want
    assert llm.spec.stats.committed > 0 and llm.spec.stats.steps > 0
    a, b = llm.chat(speculative=True, temperature=0.0), llm.chat(temperature=0.0)
    assert a.send("hi hi hi") == b.send("hi hi hi")


# -- the CLI ---------------------------------------------------------------------------

def test_cli_run_and_chat_spec_match_plain(tmp_path, capsys, exact):
    from fucina.cli.main import main
    from synth import write_model
    model = write_model(tmp_path / "t.gguf", "llama")
    ref = tmp_path / "ref.txt"
    ref.write_text("abc abc abc abc")
    ids = {}
    for name, extra in (("plain", []), ("spec", ["--spec", "--spec-ref", str(ref), "--spec-max", "4", "-v"])):
        for cmd in ("run", "chat"):
            out = tmp_path / f"{cmd}-{name}.ids"
            args = ([cmd, model, "--prompt", "abc abc abc"] if cmd == "run" else [cmd, model, "abc abc abc"])
            assert main(args + ["-n", "24", "--temp", "0.7", "--seed", "3", "-t", "1",
                                "--ids-out", str(out)] + extra) == 0
            ids[cmd, name] = out.read_text()
            cap = capsys.readouterr()
            assert ("speculative:" in cap.err) == (name == "spec")
    assert ids["run", "plain"] == ids["run", "spec"] and ids["chat", "plain"] == ids["chat", "spec"]
    assert len(ids["chat", "spec"].split()) > 0
    assert main(["run", model, "--prompt", "x", "--spec-ref", str(tmp_path / "missing")]) == 1


def test_structured_processor_cuts_drafts_and_batch_send_stays_plain(tiny, exact):
    from fucina.text.chat_template import ChatTemplate
    from fucina.text.conversation import Conversation, send_batch
    from fucina.text.logit_processor import LogitProcessor

    class Structured(LogitProcessor):            # a "grammar" that accepts one draft token
        def forced_tokens(self):
            return []

        def valid_prefix_len(self, tokens):
            return 1

    cfg = SamplingConfig(temperature=0.7, seed=1)
    plain = generate_ids(tiny, cfg, max_tokens=24)
    dec = SpeculativeDecoder(OracleSource(plain[1], bad=50), pin_rows=True, min_draft=1,
                             gate=CostGate(timed=False))
    cache = tiny.init_cache(128)
    history: list[int] = []
    logits, _ = prefill(tiny, cache, history, PROMPT)
    run(decode(tiny, cache, history, logits, Sampler(cfg, Structured()), FakeTokenizer(),
               max_tokens=24, spec=dec))
    assert history == plain[1] and dec.stats.drafted == dec.stats.spec_steps   # one token a draft

    chatml = ChatTemplate.builtin("chatml", bos_token="<s>", eos_token="</s>")
    a, b = (Conversation(tiny, FakeTokenizer(), chatml, max_tokens=12, speculative=s) for s in (True, False))
    assert send_batch([a], ["abc abc"]) == send_batch([b], ["abc abc"])
    assert a.send("abc abc abc") == b.send("abc abc abc") and a.tokens == b.tokens


def test_fast_forwarding_grammar_equals_the_plain_loop(tiny):
    from fucina.text.logit_processor import LogitProcessor

    class Forcing(LogitProcessor):           # forces token 97 after every 4th sampled token
        def __init__(self):
            self.n = 0

        def commit(self, token):
            self.n += 1

        def fast_forward(self, room):
            return [97] if self.n % 4 == 0 and room > 0 else []

    cfg = SamplingConfig(temperature=0.8, seed=2)
    runs = []
    for spec in (None, Speculation(300, gate=CostGate(timed=False))):
        cache = tiny.init_cache(128)
        history: list[int] = []
        logits, _ = prefill(tiny, cache, history, PROMPT)
        sampler = Sampler(cfg, Forcing())
        run(decode(tiny, cache, history, logits, sampler, FakeTokenizer(), max_tokens=20, spec=spec))
        runs.append((history, sampler.draws))
    assert runs[0] == runs[1] and runs[0][0].count(97) >= 3


def test_cost_gate_budgets_by_the_match_behind_the_draft():
    from fucina.text.speculative.gate import BUCKET_PROBE, match_bucket

    g = CostGate(max_draft=8, timed=False)
    short, long_ = match_bucket(1), match_bucket(12)
    assert short != long_
    for _ in range(6):
        g.settle(2, 0, 1, short)            # drafts after a short match: never accepted
        g.settle(4, 4, 5, long_)            # after a long one: always
    assert g.budget(0, long_) >= 3          # long matches draft long
    skipped = [g.budget(0, short) for _ in range(BUCKET_PROBE)]   # a plain step instead of a losing verify,
    assert skipped[:-1] == [0] * (BUCKET_PROBE - 1) and skipped[-1] >= 1   # then a re-probe


def test_a_bucket_probe_that_fails_waits_twice_as_long():
    from fucina.text.speculative.gate import BUCKET_PROBE, BUCKET_PROBE_MAX, match_bucket

    g = CostGate(max_draft=8, timed=False)
    short = match_bucket(1)
    for _ in range(6):
        g.settle(2, 0, 1, short)                 # the chain never pays: the budget skips it

    def steps_to_probe():
        for n in range(1, 4 * BUCKET_PROBE_MAX):
            if g.budget(0, short) > 0:
                return n
        raise AssertionError("never re-probed")
    assert steps_to_probe() == BUCKET_PROBE
    g.settle(2, 0, 1, short)                     # the probe accepted nothing
    assert steps_to_probe() == 2 * BUCKET_PROBE
    g.settle(2, 0, 1, short)
    assert steps_to_probe() == 4 * BUCKET_PROBE
    g.settle(1, 1, 2, short)                     # a probe that pays: back to the short wait
    g.bucket_drafted[short] = g.bucket_accepted[short] = 0.0
    for _ in range(6):
        g.settle(2, 0, 1, short)
    assert steps_to_probe() == BUCKET_PROBE


def test_timings_reach_the_memoized_budget():
    from fucina.text.speculative.gate import BUDGET_REFRESH, TIMED_AFTER

    def timed(g, factor, n):                     # verify rows at `factor` x the table's extra cost
        for _ in range(n):
            g.record(0, 1.0)
            for k in range(1, 9):
                g.record(k, 1 + factor * (table_cost(DEFAULT_COST_TABLE, k) - 1))

    g = CostGate(max_draft=8)
    for _ in range(8):
        g.settle(4, 3, 4, 3)                     # 75% acceptance after 8-15-token matches
    assert g.budget(0, 3) == 4
    timed(g, 0.5, TIMED_AFTER)                   # rows half as dear: seen from the first timed samples on
    assert g.scale() == pytest.approx(0.5) and g.budget(0, 3) == 5
    timed(g, 6.0, BUDGET_REFRESH - TIMED_AFTER)  # then the memo is refreshed every BUDGET_REFRESH
    assert g.scale() == 2.0                      # clamped
    assert g.cost(4) == pytest.approx(2.0) and g.budget_cost(4) == table_cost(DEFAULT_COST_TABLE, 4)
    assert g.budget(0, 3) == 4                   # dearer rows never lengthen nor shorten the budget ...
    for _ in range(3):
        g.settle(4, 0, 1, 3)                     # ... but the on/off estimate reads them
    assert g.window[-1][3] == pytest.approx(2.0)


def test_the_recycling_chain_is_muted_after_a_few_losing_drafts():
    from fucina.text.speculative.cascade import RECYCLING_DECIDE_AFTER

    index = SpeculationIndex(64, mute_commits=10, accounting_min_draft=1)
    index.observe([1, 2])
    for i in range(RECYCLING_DECIDE_AFTER):
        assert not index.rec_gate.muted()
        index.observe([1])                       # a one-token match: the chain after 1 drafts
        assert len(index.suggest(index.conv.tokens, 1)) == 1 and index._pending[0] is index.rec_gate
        index.observe([40 + i])                  # never the chain's token
    assert index.rec_gate.muted()
    assert index.conv_gate.total_drafted == 0


def test_a_one_token_match_drafts_on_its_own_gate_before_the_recycling_chain():
    from fucina.text.speculative.cascade import RECYCLING_DECIDE_AFTER

    index = SpeculationIndex(64, mute_commits=10, accounting_min_draft=1, short_matches=True)
    index.observe([5, 6, 7, 8, 9])
    index.observe([5])                           # "5" seen before: what followed it drafts
    assert index.conv.match_len() == 1
    assert index.suggest(index.conv.tokens, 3) == [6, 7, 8] and index._pending[0] is index.short_gate
    index.observe([6, 7, 8])
    assert index.short_gate.total_accepted == 3
    for i in range(4 * RECYCLING_DECIDE_AFTER):  # losing one-token drafts mute that source alone
        if index.short_gate.muted():
            break
        index.observe([7])                       # after a new token: a match of one
        assert index.conv.match_len() == 1 and index.suggest(index.conv.tokens, 1)
        assert index._pending[0] is index.short_gate
        index.observe([50 + i])                  # never the drafted token
    assert index.short_gate.muted() and not index.conv_gate.muted()
    index.observe([7])                           # muted: the recycling chain drafts instead
    assert index.suggest(index.conv.tokens, 1) and index._pending[0] is index.rec_gate


def test_a_draft_is_clamped_to_the_rows_the_cache_can_take_back():
    from types import SimpleNamespace

    class Cache:                                  # a window / recurrent memory's limits
        capacity, len = 1000, 10

        def __init__(self, reach, limit):
            self.reach, self.limit, self.asked = reach, limit, 0

        def rewind_reach(self):
            self.asked += 1
            return self.reach

        def step_limit(self):
            return self.limit

    class Long(DraftSource):
        def __init__(self, draft):
            self.draft, self.cut = draft, None

        def suggest(self, context, n):
            return self.draft[:n]

        def truncate_pending(self, new_len):
            self.cut = new_len

    for reach, limit, want in ((6, 100, 5), (100, 4, 3), (100, 100, 8), (2, 100, 0)):
        src, cache = Long(list(range(1, 9))), Cache(reach, limit)
        rd = SimpleNamespace(history=[1] * 10, cache=cache, max_tokens=100, reply=Reply(),
                             sampler=SimpleNamespace(processor=None))
        dec = SpeculativeDecoder(src, max_draft=8, min_draft=2, gate=CostGate(max_draft=8, adapt_budget=False))
        assert dec._draft(rd, 300, 1) == list(range(1, 9))[:want]     # one carried row besides the draft
        assert src.cut == (None if want == 8 else want)
    src, cache = Long([]), Cache(6, 100)                # no draft: the cache's limits are not walked
    rd = SimpleNamespace(history=[1] * 10, cache=cache, max_tokens=100, reply=Reply(),
                         sampler=SimpleNamespace(processor=None))
    assert SpeculativeDecoder(src, max_draft=8)._draft(rd, 300, 1) == [] and cache.asked == 0
