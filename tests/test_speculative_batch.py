"""Per-stream speculation inside the server's ragged batch pass (issue 12 item 7).

A speculative stream's verify rows [carried, draft...] ride the same ragged forward as
the other streams' single rows; the kernels are batch invariant, so each of its rows is
the bits of a single step and the served tokens (and logprobs) equal the plain server's,
greedy and seeded, with plain and speculative streams beside it."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import fucina.kernels as kernels
from fucina.serve import Server
from live_server import live
from test_serve_invariance import GEN, one_thread, prompt, synth_llm  # noqa: F401

pytestmark = pytest.mark.skipif(not kernels.batch_invariant(),
                                reason="needs the native kernels on their canonical (batch-invariant) route")


class PassSpy:
    """Records each batch pass's segments and every-row flags; a short pause per pass
    keeps a tiny model's requests in flight long enough to share passes."""

    def __init__(self, monkeypatch, pause: float):
        import time

        import fucina.serve.engine as engine_mod
        self.passes: list[tuple[list, list]] = []
        real = engine_mod.ragged_step

        def spy(model, caches, tokens, want, every=()):
            self.passes.append((list(tokens), list(every) or [False] * len(tokens)))
            time.sleep(pause)
            return real(model, caches, tokens, want, every)
        monkeypatch.setattr(engine_mod, "ragged_step", spy)


def complete(url: str, ids: list[int], **kw) -> tuple:
    body = {"prompt": ids, "max_tokens": 3 * GEN, "temperature": 0, "logprobs": 1, **kw}
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]


def looping(seed: int, n_vocab: int) -> list[int]:
    """A prompt that repeats itself (the conversation index drafts from it)."""
    unit = prompt(seed, 9, n_vocab)
    return unit * 4


def check_batched_spec_equals_plain(llm, monkeypatch, reqs, pause: float) -> None:
    """`reqs` ((prompt, options) each) sent one at a time to a plain server, then all at
    once to a --spec server: the same texts, tokens and logprobs; some verify rows rode
    a shared pass and some drafts were accepted."""
    import fucina.text.speculative.gate as gate_mod

    monkeypatch.setattr(gate_mod, "SHARED_MARGIN", 0.0)   # the rows, not the economics, are under test
    with live(Server.from_llm(llm, slots=len(reqs), batch=len(reqs))) as url:
        want = [complete(url, ids, **kw) for ids, kw in reqs]
    spy = PassSpy(monkeypatch, pause)
    server = Server.from_llm(llm, slots=len(reqs), batch=len(reqs), spec=True)
    with live(server) as url:
        gate = threading.Barrier(len(reqs))

        def send(req):
            gate.wait()
            return complete(url, req[0], **req[1])
        with ThreadPoolExecutor(len(reqs)) as pool:
            got = list(pool.map(send, reqs))
    assert got == want
    # verify rows rode shared passes: a pass with a multi-row every-row segment beside others
    shared = [(segs, every) for segs, every in spy.passes
              if len(segs) >= 2 and any(e and len(t) > 1 for t, e in zip(segs, every))]
    assert shared, "no speculative verify rode a shared batch pass"
    specs = [s.spec for s in server.engine.pool.slots if getattr(s, "spec", None) is not None]
    assert sum(sp.stats.accepted for sp in specs) > 0


def test_spec_streams_in_the_batch_pass_equal_the_plain_server(synth_llm, monkeypatch):
    n_vocab = synth_llm.tokenizer.n_vocab
    reqs = [(looping(1, n_vocab), {}), (looping(2, n_vocab), {"temperature": 0.9, "seed": 5}),
            (prompt(3, 11, n_vocab), {}), (looping(4, n_vocab), {"temperature": 0.7, "top_k": 5, "seed": 2}),
            (looping(1, n_vocab)[:20], {"speculative": False})]
    check_batched_spec_equals_plain(synth_llm, monkeypatch, reqs, pause=0.003)


@pytest.mark.slow
def test_spec_streams_in_the_batch_pass_equal_the_plain_server_smollm2(smollm2_path, monkeypatch):
    from fucina.text.api import load

    copy = ("Repeat exactly: It was the best of times, it was the worst of times, it was the age of "
            "wisdom, it was the age of foolishness.\nIt was the best of times,")
    reqs = [(copy, {}), (copy, {"temperature": 0.8, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1,
                                "seed": 7}),
            ("Once upon a time", {}), (copy, {"stop": ["foolish"]})]
    check_batched_spec_equals_plain(load(smollm2_path, n_ctx=512), monkeypatch, reqs, pause=0.0)


def test_a_failing_pass_rewinds_the_speculative_stream(synth_llm, monkeypatch):
    """The shared pass fails mid-reply: the speculative stream ends with the error, its
    cache rewound to the committed tokens, and the next request is served as usual."""
    import fucina.serve.engine as engine_mod

    n_vocab = synth_llm.tokenizer.n_vocab
    real, calls = engine_mod.ragged_step, []

    def flaky(model, caches, tokens, want, every=()):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected pass failure")
        return real(model, caches, tokens, want, every)
    monkeypatch.setattr(engine_mod, "ragged_step", flaky)
    server = Server.from_llm(synth_llm, slots=1, batch=1, spec=True)
    with live(server) as url:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"prompt": looping(1, n_vocab), "max_tokens": GEN, "temperature": 0})
        assert r.status_code >= 500
        slot = server.engine.pool.slots[0]
        assert slot.cache.len <= len(slot.tokens)
        monkeypatch.setattr(engine_mod, "ragged_step", real)
        assert complete(url, looping(1, n_vocab)) == complete(url, looping(1, n_vocab))


def test_the_draft_budget_weighs_the_rows_a_shared_pass_already_carries():
    from fucina.text.speculative import DEFAULT_COST_TABLE, CostGate

    g = CostGate(max_draft=16, timed=False, cost_table=DEFAULT_COST_TABLE)   # AVX-512's rows, on any host
    assert g.budget(0) == g.budget()                 # alone: the solo budget
    for _ in range(4):
        g.settle(4, 2, 3)                            # 50% acceptance
    assert g.budget(0) >= 1
    assert g.budget(3) == 0       # 3 other rows: a draft pushes the pass past 4 rows and does not pay
    for _ in range(16):
        g.settle(4, 4, 5)                            # every draft token accepted
    assert g.budget(1) >= 2 and g.budget(3) >= 4     # then drafting pays in a batch too


def test_a_bucket_probe_beside_other_streams_stays_cheap():
    from fucina.text.speculative import DEFAULT_COST_TABLE, CostGate
    from fucina.text.speculative.gate import BUCKET_PROBE, SHARED_PROBE_EXTRA, match_bucket

    g = CostGate(max_draft=16, timed=False, cost_table=DEFAULT_COST_TABLE)   # AVX-512's rows, on any host
    short = match_bucket(1)
    for _ in range(6):
        g.settle(2, 0, 1, short)                     # the chain never pays: skipped
    # beside 7 other rows a probe row makes the pass a 9-row one (past the decode GEMV's
    # 8): never worth a probe there
    assert g.pass_cost(9) - g.pass_cost(8) > SHARED_PROBE_EXTRA
    assert [g.budget(7, short) for _ in range(3 * BUCKET_PROBE)] == [0] * (3 * BUCKET_PROBE)
    probe = g.budget(1, short)                       # the wait is over: probed at a cheap pass
    assert probe >= 1 and g.pass_cost(2 + probe) - g.pass_cost(2) <= SHARED_PROBE_EXTRA
    assert g.budget(0, short) == 0                   # once: then the wait starts again
