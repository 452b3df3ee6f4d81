"""SFT data: the pinned loader order, encoding of the three JSONL shapes, masks, errors."""
import json

import pytest

from fucina.gguf import GGUFFile
from fucina.text.chat_template import ChatTemplate
from fucina.text.tokenizer import Tokenizer
from fucina.train.data import (IGNORE, DataError, Loader, encode_record, pack, permutation,
                               read_jsonl, split_validation)
from synth import write_model
from test_train_lora import one_thread  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def tok_tpl(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("d") / "m.gguf", "llama")
    meta = GGUFFile(path).metadata
    tok = Tokenizer.from_metadata(meta)
    return tok, ChatTemplate.from_metadata(meta, tok)


def test_permutation_matches_the_seeds_pin():
    assert permutation(8, 42, 0) == [3, 6, 0, 7, 1, 2, 5, 4]
    assert sorted(permutation(100, 7, 3)) == list(range(100))
    assert permutation(8, 42, 1) != permutation(8, 42, 0)


def test_loader_position_is_the_whole_state():
    a = Loader(8, 42)
    first = a.take(11)   # crosses the epoch boundary
    assert first[:8] == [3, 6, 0, 7, 1, 2, 5, 4]
    b = Loader(8, 42, position=3)
    assert b.take(8) == first[3:11]
    with pytest.raises(DataError, match="empty"):
        Loader(0, 1)


def test_messages_loss_on_assistant_turns_only(tok_tpl):
    tok, tpl = tok_tpl
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                        {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]}
    ex = encode_record(rec, tok, tpl)
    assert len(ex.ids) == len(ex.labels)
    full = tok.encode(tpl.render(rec["messages"], add_generation_prompt=False), add_special=False)
    assert ex.ids == full[:-1]
    supervised = tok.decode([t for t in ex.labels if t != IGNORE])
    assert supervised == "yo<|im_end|>\nok<|im_end|>\n"
    assert ex.labels[0] == IGNORE


def test_prompt_completion_and_text(tok_tpl):
    tok, tpl = tok_tpl
    ex = encode_record({"prompt": "Q: 2+2?", "completion": " 4"}, tok, tpl)
    sup = [t for t in ex.labels if t != IGNORE]
    assert tok.decode(sup[:-1]) == " 4" and sup[-1] == tok.eos_id
    ex = encode_record({"text": "abc"}, tok, tpl)
    assert all(t != IGNORE for t in ex.labels)


@pytest.mark.parametrize("line,why", [
    ("{not json", "invalid JSON"),
    ('{"foo": 1}', "needs 'messages'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    ('{"prompt": "x", "completion": 3}', "must be strings"),
    ('[1, 2]', "expected a JSON object"),
])
def test_malformed_lines_name_line_and_reason(tmp_path, tok_tpl, line, why):
    tok, tpl = tok_tpl
    p = tmp_path / "t.jsonl"
    p.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=rf"t.jsonl:3: .*{why}"):
        read_jsonl(p, tok, tpl, 64)


def test_too_long_is_an_error(tmp_path, tok_tpl):
    tok, tpl = tok_tpl
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"text": "x" * 100}) + "\n")
    with pytest.raises(DataError, match="t.jsonl:1: example is 101 tokens, longer than the context of 50"):
        read_jsonl(p, tok, tpl, 50)
    with pytest.raises(DataError, match="no examples"):
        (tmp_path / "e.jsonl").write_text("\n")
        read_jsonl(tmp_path / "e.jsonl", tok, tpl, 50)


def test_pack_and_split(tok_tpl):
    tok, tpl = tok_tpl
    exs = [encode_record({"text": "x" * n}, tok, tpl) for n in (3, 4, 10, 2)]
    rows = pack(exs, 10)
    assert [len(r.ids) for r in rows] == [7, 10, 2]
    assert sum(r.n_supervised for r in rows) == sum(e.n_supervised for e in exs)
    train, valid = split_validation(exs, 0.25, seed=1)
    assert len(valid) == 1 and len(train) == 3
