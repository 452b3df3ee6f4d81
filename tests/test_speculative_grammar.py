"""Grammar-aware speculative drafting: under a grammar Constraint (llguidance) the
speculative stream is the plain constrained stream token for token and draw for draw,
forced spans included (committed without a draw, accepted through a draft that spells
them), and a draft is cut at its first token the grammar forbids."""
import pytest

from fucina.models import load_model
from fucina.text import grammar as grammars
from fucina.text.constraint import Constraint
from fucina.text.generate import decode, prefill, run
from fucina.text.sampler import Sampler, SamplingConfig
from fucina.text.speculative import CostGate, Speculation
from fucina.text.tokenizer import Tokenizer
from synth import write_model

SCHEMA = {"type": "object", "properties": {"alpha": {"const": "beta"}, "k": {"enum": ["x", "yy"]},
          "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["alpha", "k", "n"], "additionalProperties": False}
GRAMMARS = {"schema": dict(json_schema=SCHEMA), "regex": dict(regex="(ab|ba)[a-c]{4,12}!")}
SAMPLINGS = {"greedy": SamplingConfig(temperature=0.0),
             "temp": SamplingConfig(temperature=0.9, seed=4),
             "topk-minp": SamplingConfig(temperature=1.1, top_k=20, min_p=0.02, seed=9)}
PROMPT_TEXT = "ab ab"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("sg") / "tiny.gguf", "llama", seed=3)
    return load_model(path), Tokenizer.from_gguf(path)


def constrained(tiny, grammar: dict, cfg: SamplingConfig, spec=None, max_tokens: int = 48):
    model, tok = tiny
    proc = Constraint(tok, grammars.from_options(**grammar), stop_ids=[2])
    cache = model.init_cache(256)
    history: list[int] = []
    logits, _ = prefill(model, cache, history, tok.encode(PROMPT_TEXT, add_special=False))
    sampler = Sampler(cfg, proc)
    pieces: list[str] = []
    reply = run(decode(model, cache, history, logits, sampler, tok, max_tokens=max_tokens,
                       stop_ids=[2], spec=spec), pieces.append)
    assert cache.len == len(history)
    return history, sampler.draws, "".join(pieces), reply.finish_reason, proc.forced


@pytest.mark.parametrize("pin_rows", [False, True], ids=["batched", "row-by-row"])
@pytest.mark.parametrize("cfg", list(SAMPLINGS.values()), ids=list(SAMPLINGS))
@pytest.mark.parametrize("grammar", list(GRAMMARS.values()), ids=list(GRAMMARS))
def test_constrained_speculative_stream_equals_plain(tiny, grammar, cfg, pin_rows):
    model, tok = tiny
    plain = constrained(tiny, grammar, cfg)
    text, reply_ids = plain[2], plain[0][len(tok.encode(PROMPT_TEXT, add_special=False)):]
    assert text and plain[3] == "stop"
    # the reply's own ids as an anchored reference (a Predicted Output: drafts spell the
    # forced spans), a reference that spells it wrongly (drafts cut by the grammar or
    # rejected), and the conversation index alone
    wrong = tok.encode(text.replace("b", "c").replace("y", "q"), add_special=False)
    for refs, anchored in (([reply_ids], True), ([wrong], False), ([], False)):
        spec = Speculation(model.config.n_vocab, pin_rows=pin_rows, gate=CostGate(timed=False))
        for r in refs:
            spec.add_reference(r, anchored)
        got = constrained(tiny, grammar, cfg, spec)
        assert got[:4] == plain[:4], refs
        assert got[4] == plain[4]           # forced spans: fast-forwarded where the plain loop does
        if anchored:                        # (and accepted through the draft that spells them)
            assert spec.stats.accepted > 0 and spec.stats.spec_steps > 0
            assert spec.stats.steps < len(reply_ids)


def test_drafts_are_cut_at_the_first_token_the_grammar_forbids(tiny):
    model, tok = tiny
    cfg = SamplingConfig(temperature=0.0)
    plain = constrained(tiny, GRAMMARS["regex"], cfg)
    # the reference continues past the grammar's end ("!" then more text): drafts are cut
    ref = tok.encode(plain[2] + "abcabc" * 4, add_special=False)
    spec = Speculation(model.config.n_vocab, [ref], gate=CostGate(timed=False))
    cut = []
    orig = spec.decoder._shape

    def shape(rd, draft):
        out = orig(rd, draft)
        cut.append(len(out) < len(draft))
        return out

    spec.decoder._shape = shape
    got = constrained(tiny, GRAMMARS["regex"], cfg, spec)
    assert got[:4] == plain[:4] and any(cut)


def test_anchored_reference_drafts_the_reply_after_the_prompt():
    from fucina.text.speculative import SpeculationIndex
    idx = SpeculationIndex(100, recycling=False)
    idx.add_reference([7, 8, 9, 10], anchored=True)
    idx.sync([1, 2, 3])                     # the prompt does not spell the document
    assert idx.suggest([1, 2, 3], 3) == [7, 8, 9]
    idx.observe([7])
    assert idx.suggest([1, 2, 3, 7], 8) == [8, 9, 10]
    idx.observe([5])                        # the reply left the document: no anchor
    assert idx.suggest([1, 2, 3, 7, 5], 8) == []
