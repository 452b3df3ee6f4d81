"""Grammar-constrained decoding without a real model: the llguidance tokenizer bridge,
the Constraint processor's hooks, the sampler's mask-on-miss path (same distribution as
masking first), grammar errors, template-aware wrappers, and generate/chat over a tiny
random model whose outputs must still match."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from fucina.errors import FucinaError, GrammarError, SchemaWarning
from fucina.text import grammar as grammars
from fucina.text.constraint import Constraint, apply_mask, lltokenizer, mask_bools, special_ids
from fucina.text.sampler import Sampler, SamplingConfig
from fucina.text.tokenizer import Tokenizer
from synth import write_model

SMOL = "/root/.cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("c") / "tiny.gguf", "llama", seed=3)


@pytest.fixture(scope="module")
def tok(tiny_path):
    return Tokenizer.from_gguf(tiny_path)      # 260 ids: 3 control, "ab", 256 bytes


@pytest.fixture(scope="module")
def qwen_tok(qwen3_vocab):
    return Tokenizer.from_gguf(qwen3_vocab)


def constraint(tok, g, **kw) -> Constraint:
    return Constraint(tok, g, stop_ids=[2], **kw)


def consume_text(c: Constraint, tok, text: str) -> None:
    for t in tok.encode_raw(text, parse_special=False):
        assert c.allows(t), (text, t)
        c.commit(t)


# -- the tokenizer bridge ---------------------------------------------------------------

def test_bridge_bytes_specials_and_cache(tok):
    llt = lltokenizer(tok, stop_ids=[2])
    assert lltokenizer(tok, stop_ids=[2]) is llt                  # built once, cached
    assert llt.vocab_size == 260 and llt.eos_token == 2
    for i in range(3, 260):               # the lone 0xFF byte is toktrie's special marker (never UTF-8)
        assert llt.decode_bytes([i]) == (tok.token_to_piece(i) if tok.token_to_piece(i) != b"\xff" else b"")
    assert all(llt.is_special_token(i) for i in range(3)) and not llt.is_special_token(3)
    padded = lltokenizer(tok, n_vocab=300, stop_ids=[2])          # a model padding its vocab
    c = Constraint(tok, grammars.check(grammars.regex("(?s:.*)")), stop_ids=[2], n_vocab=300)
    assert padded.vocab_size == 300 and c.allows(5) and not any(c.allows(i) for i in range(260, 300))


def test_bridge_qwen3_markers_special(qwen_tok):
    sp = special_ids(qwen_tok)
    for text in ("<|im_end|>", "<think>", "</think>", "<tool_call>"):
        assert qwen_tok.token_id(text) in sp
    llt = lltokenizer(qwen_tok)
    assert llt.vocab_size >= qwen_tok.n_vocab
    ids = qwen_tok.encode_raw("héllo wörld 123", parse_special=False)
    assert llt.decode_bytes(ids) == "héllo wörld 123".encode()


def test_grammar_text_cannot_reach_a_special_token(qwen_tok):
    for marker in ("<|im_end|>", "<think>"):      # control; user-defined (always split by our encode)
        tid = qwen_tok.token_id(marker)
        c = Constraint(qwen_tok, grammars.check(grammars.lark(f'start: "{marker}" "x" /[0-9]+/')))
        assert not c.allows(tid)                  # spelled as text, never the special token
        forced = c.forced_tokens()
        assert tid not in forced and qwen_tok.decode(forced).startswith(marker)
        assert c.fast_forward(99) == forced and c.error is None


@pytest.mark.slow
def test_bridge_spm_byte_fallback():
    import os
    path = "/root/.cache/fucina/gemma-3-270m-q4_k_m.gguf"
    if not os.path.exists(path):
        pytest.skip("gemma3 GGUF unavailable")
    t = Tokenizer.from_gguf(path)
    llt = lltokenizer(t)
    byte_a = t.token_id("<0x41>")
    assert llt.decode_bytes([byte_a]) == b"A"
    sp = t.token_id("\u2581the")
    assert llt.decode_bytes([sp]) == b" the"


# -- the Constraint ---------------------------------------------------------------------

def test_mask_commit_complete_then_only_stop(tok):
    c = constraint(tok, grammars.check(grammars.regex("a[0-9]{2}")))
    bits = mask_bools(c.allowed_words(), 260)
    assert bits[ord("a") + 4] and not bits[ord("b") + 4] and not bits[2]
    consume_text(c, tok, "a12")
    assert c.is_accepting()
    assert np.flatnonzero(mask_bools(c.allowed_words(), 260)).tolist() == [2]   # EOS forced
    c.reset()
    assert c.allows(ord("a") + 4) and not c.is_accepting()


def test_forced_tokens_fast_forward_and_prefix(tok):
    c = constraint(tok, grammars.check(grammars.json_schema(
        {"type": "object", "properties": {"abc": {"type": "integer"}}, "required": ["abc"],
         "additionalProperties": False})))
    forced = c.forced_tokens()
    assert tok.decode(forced) == '{"abc": '
    assert c.valid_prefix_len(tok.encode_raw('{"abc": 12}x', parse_special=False)) == len('{"abc": 12}') - 1
    assert c.fast_forward(3) == forced[:3] and c.forced == 3
    assert c.valid_prefix_len(forced[3:]) == len(forced) - 3


def test_mask_admits_only_the_canonical_spelling_of_forced_bytes(tok):
    """Why `allows` reads the mask rather than the one-token validate_tokens: after
    `{"` the key "ab" is forced, and the mask admits its canonical token only."""
    c = constraint(tok, grammars.from_options(json_schema={
        "type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"]}))
    consume_text(c, tok, '{"')
    a = ord("a") + 4
    assert c.matcher.validate_tokens([a]) == 1 and not c.allows(a) and c.allows(3)


def test_clone_is_independent(tok):
    c = constraint(tok, grammars.check(grammars.choice(["ab", "cd"])))
    twin = c.clone()
    consume_text(c, tok, "c")
    assert not c.allows(ord("a") + 4)
    assert twin.allows(ord("a") + 4) and twin.allows(ord("c") + 4)


def test_rejected_token_degrades_to_stop(tok):
    c = constraint(tok, grammars.check(grammars.regex("a+")))
    c.commit(ord("z") + 4)
    assert c.error and np.flatnonzero(mask_bools(c.allowed_words(), 260)).tolist() == [2]
    assert c.forced_tokens() == [] and c.valid_prefix_len([5]) == 0


def test_apply_mask_matches_bits(tok):
    c = constraint(tok, grammars.check(grammars.regex("[a-f]+")))
    row = torch.zeros(264)
    apply_mask(row, c.allowed_words())
    ok = torch.isfinite(row)
    assert ok.sum() == 6 + 1 and not ok[260:].any()     # a..f, "ab"; padding past the vocab masked


# -- the sampler's mask-on-miss path ------------------------------------------------------

def _masked_probs(logits: torch.Tensor, c: Constraint, temp: float) -> np.ndarray:
    row = logits.clone()
    apply_mask(row, c.allowed_words())
    return torch.softmax(row / temp, -1).double().numpy()


def test_sample_first_has_the_masked_distribution(tok):
    """Draw-then-test (fast path) against the exact masked distribution: chi-square over
    4000 seeded draws, on logits where half of the allowed mass is out of the mask."""
    g = grammars.check(grammars.regex("[a-h]"))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(260, generator=gen) * 2
    logits[ord("a") + 4:ord("h") + 5] -= 1.5          # the allowed tokens less likely than the rest
    base = constraint(tok, g)
    p = _masked_probs(logits, base, 0.8)
    counts = np.zeros(260)
    misses = 0
    s = Sampler(SamplingConfig(temperature=0.8, seed=7), base.clone())
    for _ in range(4000):
        s.processor.reset()
        before = s.draws
        counts[s.next(logits)] += 1
        misses += s.draws - before - 1
    assert counts[p == 0].sum() == 0
    assert misses > 500                                 # the fallback path was exercised
    keep = p > 0
    expected = p[keep] * counts.sum()
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, chi2                            # 7 dof, p = 0.001


def test_truncated_and_greedy_paths_equal_mask_first(tok):
    """With top-k/top-p/min-p the mask is applied before truncation: token for token
    the same as masking the row and running the plain pipeline with the same draw."""
    g = grammars.check(grammars.regex("[a-p]+"))
    gen = torch.Generator().manual_seed(1)
    for cfg in (SamplingConfig(temperature=0.9, top_k=5, seed=3), SamplingConfig(temperature=0.7, top_p=0.8,
                min_p=0.05, seed=4), SamplingConfig(temperature=0, seed=0)):
        s = Sampler(cfg, constraint(tok, g))
        ref = Sampler(cfg)
        for _ in range(50):
            logits = torch.randn(260, generator=gen) * 3
            masked = logits.clone()
            apply_mask(masked, s.processor.allowed_words())
            want = ref.next(masked)
            assert s.next(logits) == want


def test_all_masked_is_a_sampling_error(tok):
    s = Sampler(SamplingConfig(temperature=0.5), constraint(tok, grammars.check(grammars.regex("a"))))
    logits = torch.zeros(260)
    logits[ord("a") + 4] = float("-inf")
    logits[2] = float("-inf")
    with pytest.raises(FucinaError):
        s.next(logits)


# -- grammars and their errors ------------------------------------------------------------

@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "not": {"required": ["a"]}}, "not"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if"),
])
def test_unsupported_schema_keyword_is_named(schema, keyword):
    with pytest.raises(GrammarError, match=re.escape(keyword)):
        grammars.from_options(json_schema=schema, strict=True)
    with pytest.warns(SchemaWarning, match=re.escape(keyword)):       # lenient: the rest is enforced
        g = grammars.from_options(json_schema=schema)
    assert g.schema == schema and keyword in " ".join(g.unenforced)


def test_lenient_schema_enforces_the_rest_and_checks_the_reply(tok):
    schema = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3, "uniqueItems": True}
    with pytest.warns(SchemaWarning, match="uniqueItems"):
        g = grammars.from_options(json_schema=schema)
    for text, broken in (("[1, 1]", "non-unique"), ("[2, 1]", None)):
        c = constraint(tok, g)
        assert not c.allows(tok.encode_raw("[3", parse_special=False)[1])     # items still enforced
        consume_text(c, tok, text)
        assert c.violation is None and c.allows(2)
        c.commit(2)                                               # the stop token ends the reply
        assert (c.violation is None) if broken is None else (broken in c.violation)
        c.reset()
        assert c.violation is None and c.reply_ids == []
    wrapped = grammars.think_wrapped(g, tok, primed=False)
    assert wrapped.schema == schema                               # the think block keeps the check
    c = constraint(tok, wrapped)
    consume_text(c, tok, "<think>hm</think>\n[2, 2]")
    c.commit(2)
    assert "non-unique" in c.violation
    assert grammars.reply_problem(schema, "[1,") .startswith("the reply is not JSON")


def test_strict_tool_schema_and_strict_keyword_elsewhere():
    params = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    with pytest.warns(SchemaWarning, match="uniqueItems"):
        grammars.tool_call_grammar([{"function": {"name": "f", "parameters": params}}], None)
    with pytest.raises(GrammarError, match="uniqueItems"):
        grammars.tool_call_grammar([{"function": {"name": "f", "strict": True, "parameters": params}}], None)
    assert grammars.from_options(regex="a+", strict=True)       # strict speaks only of schemas


def test_grammar_errors_name_the_problem():
    with pytest.raises(GrammarError, match="unclosed group"):
        grammars.from_options(regex="(a")
    with pytest.raises(GrammarError, match="unknown name"):
        grammars.from_options(lark="start: nothing_here")
    with pytest.raises(GrammarError, match="not valid JSON"):
        grammars.from_options(json_schema="{nope")
    with pytest.raises(GrammarError, match="not regex and lark|json_schema and regex"):
        grammars.from_options(json_schema={}, regex="a")
    with pytest.raises(GrammarError):
        grammars.from_options(grammar='root ::= undefined_rule')
    assert grammars.from_options() is None


def test_gbnf_and_choices_and_pydantic(tok):
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        n: int

    for opts, text in ((dict(grammar='root ::= "yes" | "no"'), "no"), (dict(choices=["red", "blue"]), "blue"),
                       (dict(json_schema=Item), '{"n": 5}'), (dict(json_schema='{"type": "object"}'), "{}")):
        c = constraint(tok, grammars.from_options(**opts))
        consume_text(c, tok, text)
        assert c.is_accepting(), opts


def test_tool_call_grammar_hermes(qwen_tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
    g = grammars.tool_call_grammar(tools, qwen_tok, name="get_weather")
    c = Constraint(qwen_tok, g)
    call_open = qwen_tok.token_id("<tool_call>")
    assert c.forced_tokens()[:1] == [call_open]        # the model's own marker token
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = qwen_tok.encode_raw(text, parse_special=True)
    assert c.valid_prefix_len(ids) == len(ids)
    bad = qwen_tok.encode_raw('<tool_call>\n{"name": "noop", "arguments": {}}', parse_special=True)
    assert c.valid_prefix_len(bad) < len(bad)
    any_tool = Constraint(qwen_tok, grammars.tool_call_grammar(tools, qwen_tok))
    assert any_tool.valid_prefix_len(bad) == len(bad)
    with pytest.raises(GrammarError):
        grammars.tool_call_grammar(tools, qwen_tok, name="missing")


def test_think_block_with_text_markers(tok):
    for body, primed, text in ((grammars.json_object(), False, '<think>\nhmm {x} </thi\n</think>\n\n{"a": 1}'),
                               (grammars.json_object(), False, '{"a": 1}'),
                               (grammars.lark('start: "ok"'), True, 'no json here</think>ok'),
                               (grammars.regex("a+"), True, '</think>\naa')):
        c = constraint(tok, grammars.think_wrapped(body, tok, primed=primed))
        consume_text(c, tok, text)
        assert c.is_accepting(), text
    c = constraint(tok, grammars.think_wrapped(grammars.json_object(), tok, primed=True))
    consume_text(c, tok, "free</think>\n")
    assert not c.allows(ord("x") + 4)


def test_think_block_is_free_then_the_grammar(qwen_tok):
    g = grammars.think_wrapped(grammars.json_object(), qwen_tok, primed=False)
    c = Constraint(qwen_tok, g)
    ids = qwen_tok.encode_raw("<think>\nLet me see: {not json} ...\n</think>\n\n", parse_special=True)
    assert c.valid_prefix_len(ids) == len(ids)
    for t in ids:
        c.commit(t)
    assert not c.allows(qwen_tok.encode_raw("x", parse_special=False)[0])
    assert c.allows(qwen_tok.encode_raw("{", parse_special=False)[0])


# -- generate / chat over a tiny random model ---------------------------------------------

@pytest.fixture(scope="module")
def tiny_llm(tiny_path, tok):
    from fucina.models import load_model
    from fucina.text.api import LLM
    return LLM(load_model(tiny_path), tok, n_ctx=256)


def test_random_model_obeys_regex_and_schema(tiny_llm):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "yy"]}, "n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["k", "n"], "additionalProperties": False}
    for seed in range(3):
        out = tiny_llm.generate("ab", max_tokens=40, temperature=0.8, seed=seed, regex="[a-c]{2,5}!")
        assert re.fullmatch("[a-c]{2,5}!", out) and tiny_llm.last.finish_reason == "stop"
        out = tiny_llm.generate("ab", max_tokens=40, temperature=0.8, seed=seed, json_schema=schema)
        jsonschema.validate(json.loads(out), schema)
    chat = tiny_llm.chat(temperature=0.8, seed=1, choices=["left", "right"])
    assert chat.send("go") in ("left", "right") and chat.send("again") in ("left", "right")


def test_stream_equals_generate_and_fast_forward_counts(tiny_llm):
    schema = {"type": "object", "properties": {"alpha": {"const": "beta"}}, "required": ["alpha"]}
    a = tiny_llm.generate("ab", max_tokens=30, temperature=0.8, seed=5, json_schema=schema)
    b = "".join(tiny_llm.stream("ab", max_tokens=30, temperature=0.8, seed=5, json_schema=schema))
    assert a == b == '{"alpha": "beta"}'


def test_send_batch_needs_one_processor_per_stream(tiny_llm):
    from fucina.text.conversation import Conversation, send_batch
    c = Constraint(tiny_llm.tokenizer, grammars.from_options(regex="a+"), stop_ids=[2])
    convs = [Conversation(tiny_llm.model, tiny_llm.tokenizer, tiny_llm.template, processor=p,
                          sampling=SamplingConfig(temperature=0.8, seed=i), max_tokens=6)
             for i, p in enumerate((c, c))]
    with pytest.raises(FucinaError, match="clone"):
        send_batch(convs, ["x", "y"])
    convs[1].sampler.processor = c.clone()
    outs = send_batch(convs, ["x", "y"])
    assert all(re.fullmatch("a+", o) for o in outs)
