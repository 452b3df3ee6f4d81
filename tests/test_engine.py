"""The serving engine's scheduler, driven step by step (no HTTP): streams join and
leave mid-batch, a long prompt is chunked while others decode, disconnects free
their rows, shared prefixes are computed once, admission respects the KV budget,
and a greedy request gets the same tokens alone or under load."""
import pytest
import torch

import fucina.kernels
import fucina.serve.engine as engine_mod
from fucina.serve.engine import Engine, Finished, GenRequest, Job, Piece, Scheduler, Started
from test_chat_support import FakeTokenizer, tiny_llama


class NoTemplate:
    def stop_ids(self, tokenizer):
        return []


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = tiny_llama(str(tmp_path_factory.mktemp("engine")), n_layer=2, n_embd=64)
    m.use_native_step = False         # the torch path: rows exact whatever the batch
    return m


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * j) % 250 + 1 for j in range(n)]


class Harness:
    """Runs Engine.run with a take() that submits scripted arrivals at given steps
    (take is called once per step) and records each pass's segments and every event."""

    def __init__(self, engine: Engine, monkeypatch, max_queue: int = 64):
        self.engine, self.sched = engine, Scheduler(engine, max_queue)
        self.step = 0
        self.arrivals: dict[int, list[Job]] = {}
        self.cancels: dict[int, list[Job]] = {}
        self.events: dict[int, list[tuple[int, object]]] = {}      # job index -> (step, event)
        self.passes: list[list[tuple[int, int]]] = []              # per pass: (cache id, rows)
        self.jobs: list[Job] = []
        real = engine_mod.ragged_step

        def spy(model, caches, tokens, want):
            self.passes.append([(id(c), len(t)) for c, t in zip(caches, tokens)])
            return real(model, caches, tokens, want)
        monkeypatch.setattr(engine_mod, "ragged_step", spy)

    def job(self, ids, max_tokens=8, at=1, **kw) -> Job:
        i = len(self.jobs)
        self.events[i] = []
        job = Job(GenRequest(list(ids), max_tokens, **kw), lambda ev, i=i: self.events[i].append((self.step, ev)))
        self.jobs.append(job)
        self.arrivals.setdefault(at, []).append(job)
        return job

    def run(self, max_steps=2000):
        def take(n, block, fits):
            self.step += 1
            for job in self.arrivals.pop(self.step, []):
                self.sched.submit(job)
            for job in self.cancels.pop(self.step, []):
                job.cancel()
            if self.step > max_steps or (block and not self.arrivals and not self.sched.depth):
                return None
            return self.sched._take(n, False, fits)
        self.engine.run(take)
        return self

    def finished(self, i) -> Finished:
        ends = [ev for _, ev in self.events[i] if isinstance(ev, Finished)]
        assert len(ends) == 1, f"job {i}: {len(ends)} Finished events"
        return ends[0]

    def tokens(self, i) -> list[int]:
        return self.finished(i).reply.tokens


def make_engine(model, **kw) -> Engine:
    kw.setdefault("batch", 4)
    return Engine(model, FakeTokenizer(), NoTemplate(), n_ctx=256, **kw)


def alone(model, ids, max_tokens, monkeypatch) -> list[int]:
    h = Harness(make_engine(model, batch=1), monkeypatch)
    h.job(ids, max_tokens)
    return h.run().tokens(0)


def test_streams_join_and_leave_mid_batch(model, monkeypatch):
    h = Harness(make_engine(model), monkeypatch)
    h.job(prompt(1, 12), max_tokens=24, at=1)
    h.job(prompt(2, 9), max_tokens=3, at=4)        # joins while 0 decodes, leaves early
    h.job(prompt(3, 15), max_tokens=6, at=9)       # joins after 1 has left
    h.run()
    for i, n in enumerate((24, 3, 6)):
        f = h.finished(i)
        assert f.error is None and len(f.reply.tokens) == n and f.reply.finish_reason == "length"
    started = {i: next(s for s, ev in h.events[i] if isinstance(ev, Started)) for i in range(3)}
    end = {i: next(s for s, ev in h.events[i] if isinstance(ev, Finished)) for i in range(3)}
    assert started[0] < started[1] < end[1] < started[2] < end[0]     # really overlapping
    # stream 0 forwarded a row in every pass from its first token to its end
    c0 = {c for p in h.passes for c, rows in p if rows == 12}
    assert len(c0) == 1
    ids0 = [any(c in c0 for c, _ in p) for p in h.passes]
    first, last = ids0.index(True), len(ids0) - 1 - ids0[::-1].index(True)
    assert all(ids0[first:last + 1])
    assert max(len(p) for p in h.passes) >= 2                            # batched passes happened
    assert not any(s.busy for s in h.engine.pool.slots)


def test_long_prompt_is_chunked_while_others_decode(model, monkeypatch):
    eng = make_engine(model, chunk=16)
    h = Harness(eng, monkeypatch)
    h.job(prompt(4, 10), max_tokens=40, at=1)
    h.job(prompt(5, 10), max_tokens=40, at=1)
    h.job(prompt(6, 150), max_tokens=4, at=6)       # long prompt arrives mid-decode
    h.run()
    assert [len(h.tokens(i)) for i in range(3)] == [40, 40, 4]
    # while the long prompt prefills, every pass also carries both decoders' rows (one
    # token each: their time per token is one pass), and the pass holds at most
    # `chunk` prompt rows
    totals: dict[int, int] = {}
    for p in h.passes:
        for c, rows in p:
            totals[c] = totals.get(c, 0) + rows
    long_cache = next(c for c, n in totals.items() if n >= 150)
    long_passes = [p for p in h.passes if any(c == long_cache and rows > 1 for c, rows in p)]
    assert len(long_passes) >= 150 // 16
    for p in long_passes:
        assert sum(rows for _, rows in p if rows > 1) <= 16
        assert sum(1 for _, rows in p if rows == 1) == 2
    # and the decoders lose nothing: the same tokens as alone
    assert h.tokens(0) == alone(model, prompt(4, 10), 40, monkeypatch)


def test_disconnect_mid_batch_frees_its_row(model, monkeypatch):
    h = Harness(make_engine(model, batch=2), monkeypatch)
    a = h.job(prompt(7, 8), max_tokens=30, at=1)
    b = h.job(prompt(8, 8), max_tokens=30, at=1)
    h.cancels[6] = [b]                                   # client gone mid-batch
    h.job(prompt(9, 8), max_tokens=5, at=7)             # takes the freed stream at once
    h.run()
    assert a.cancelled is False and len(h.tokens(0)) == 30
    fb = h.finished(1)
    assert fb.error is None and 0 < len(fb.reply.tokens) < 30
    assert h.engine.stats["cancelled"] == 1
    assert len(h.tokens(2)) == 5
    start_c = next(s for s, ev in h.events[2] if isinstance(ev, Started))
    assert start_c < next(s for s, ev in h.events[0] if isinstance(ev, Finished))   # joined mid-batch
    assert max(len(p) for p in h.passes) <= 2            # batch 2: b's row was given up
    assert not any(s.busy for s in h.engine.pool.slots)
    # the cancelled slot's history still matches its cache (reusable rows)
    for s in h.engine.pool.slots:
        if s.cache is not None:
            assert len(s.tokens) == s.cache.len


@pytest.mark.parametrize("sampled", [False, True])
def test_same_output_alone_and_under_load(model, monkeypatch, sampled):
    from fucina.text.sampler import SamplingConfig

    cfg = SamplingConfig(temperature=0.9, top_k=40, seed=7) if sampled else SamplingConfig()
    target = prompt(10, 20)
    want = Harness(make_engine(model, batch=1), monkeypatch)
    want.job(target, 16, sampling=cfg)
    want = want.run().tokens(0)
    h = Harness(make_engine(model, batch=6, chunk=8), monkeypatch)
    for k in range(5):
        h.job(prompt(20 + k, 5 + 7 * k), max_tokens=10 + k, at=1 + 2 * k)
    h.job(target, 16, at=4, sampling=cfg)
    h.run()
    assert h.tokens(5) == want


def test_shared_prefix_is_computed_once(model, monkeypatch):
    system = prompt(30, 60)
    h = Harness(make_engine(model, chunk=16), monkeypatch)
    for k in range(3):
        h.job(system + prompt(40 + k, 3), max_tokens=4, at=1)     # arrive together
    h.run()
    assert [len(h.tokens(i)) for i in range(3)] == [4, 4, 4]
    prefill_rows = sum(rows for p in h.passes for _, rows in p if rows > 1)
    assert prefill_rows == 63 + 3 + 3                 # the 60 shared rows once, not three times
    m = h.engine.metrics
    assert m.copied_tokens == 2 * 60 and m.prefix_hits == 2
    started = [next(ev for _, ev in h.events[i] if isinstance(ev, Started)) for i in range(3)]
    assert [s.reused_tokens for s in started] == [0, 60, 60]
    alone_out = alone(model, system + prompt(41, 3), 4, monkeypatch)
    assert h.tokens(1) == alone_out                    # copied rows give the same reply


def test_admission_by_kv_budget(model, monkeypatch):
    eng = Engine(model, FakeTokenizer(), NoTemplate(), n_ctx=64, batch=4, kv_budget=150)
    h = Harness(eng, monkeypatch)                     # each reserves 10 + 30: three fit
    for k in range(4):
        h.job(prompt(50 + k, 10), max_tokens=30, at=1)
    h.run()
    assert all(len(h.tokens(i)) == 30 for i in range(4))
    assert max(len(p) for p in h.passes) == 3
    started3 = next(s for s, ev in h.events[3] if isinstance(ev, Started))
    ended = min(next(s for s, ev in h.events[i] if isinstance(ev, Finished)) for i in range(3))
    assert started3 > ended


def test_auto_stream_count_follows_the_kv_budget(model):
    assert make_engine(model, batch=None, kv_budget=256 * 5).batch == 5
    assert make_engine(model, batch=None, kv_budget=10).batch == 1        # at least one full context
    assert make_engine(model, batch=None, kv_budget=10 ** 9).batch == engine_mod.MAX_AUTO_STREAMS
    assert make_engine(model, batch=7, kv_budget=256).batch == 7          # the flag overrides


def test_metrics_exposition(model, monkeypatch):
    h = Harness(make_engine(model), monkeypatch)
    h.job(prompt(60, 30), max_tokens=5, at=1)
    h.job(prompt(60, 30), max_tokens=5, at=12)          # the same prompt again: its rows reused
    h.run()
    text = h.engine.metrics.render(queue_depth=0, streams=h.engine.batch)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert lines['fucina_requests_total{outcome="completed"}'] == "2"
    assert lines["fucina_generation_tokens_total"] == "10"
    assert lines["fucina_prompt_tokens_total"] == "60"
    assert lines['fucina_prompt_tokens_cached_total{source="own"}'] == "29"
    assert lines["fucina_time_to_first_token_seconds_count"] == "2"
    assert lines['fucina_time_to_first_token_seconds_bucket{le="+Inf"}'] == "2"
    assert lines["fucina_streams_active"] == "0" and lines["fucina_streams_max"] == "4"
    assert float(lines["fucina_prefix_cache_hit_ratio"]) == pytest.approx(29 / 60, abs=1e-3)


@pytest.mark.slow
def test_native_rows_alone_and_under_load(smollm2_path, monkeypatch):
    """The real model on the native step: a greedy request under load gets the tokens
    it gets alone where the kernels are batch-invariant; otherwise it must at least
    complete its budget beside the others (rows may differ in the last bits)."""
    from fucina.models import load_model

    from fucina.text.tokenizer import Tokenizer

    m = load_model(smollm2_path)
    tok = Tokenizer.from_metadata(m.gguf.metadata)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 30, 2, 198]
    h1 = Harness(Engine(m, tok, NoTemplate(), n_ctx=256, batch=1), monkeypatch)
    h1.job(ids, 12)
    want = h1.run().tokens(0)
    h = Harness(Engine(m, tok, NoTemplate(), n_ctx=256, batch=8, chunk=16), monkeypatch)
    for k in range(6):
        h.job([1] + prompt(70 + k, 8 + 5 * k), max_tokens=12, at=1 + k)
    h.job(ids, 12, at=3)
    got = h.run().tokens(6)
    if getattr(fucina.kernels, "batch_invariant", lambda: False)():
        assert got == want
    else:
        assert len(got) == len(want) == 12


def test_greedy_fast_path_matches_the_sampler():
    from fucina.errors import SamplingError
    from fucina.serve.engine import ServeSampler
    from fucina.text.sampler import Sampler, SamplingConfig

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        row = torch.randn(300, generator=g)
        assert ServeSampler(SamplingConfig(), None).next(row) == Sampler(SamplingConfig()).next(row)
    assert ServeSampler(SamplingConfig(), None).fast
    assert not ServeSampler(SamplingConfig(repeat_penalty=1.3), None).fast
    assert not ServeSampler(SamplingConfig(temperature=0.7), None).fast
    for bad in (torch.tensor([0.0, float("nan"), 1.0]), torch.full((3,), float("-inf"))):
        with pytest.raises(SamplingError):
            ServeSampler(SamplingConfig(), None).next(bad)
    tie = torch.tensor([1.0, 3.0, 3.0])
    assert ServeSampler(SamplingConfig(), None).next(tie) == Sampler(SamplingConfig()).next(tie)
