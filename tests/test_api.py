"""The Python API: LLM.generate/stream/chat over a tiny model; fucina.load on a real one."""
import os

import pytest

from fucina.text.api import LLM
from fucina.text.chat_template import ChatTemplate
from fucina.text.conversation import Conversation
from test_chat_support import FakeTokenizer, ScriptedDecoder, tiny_llama

SMOL = "/root/.cache/fucina/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def llm(tmp_path):
    return LLM(tiny_llama(str(tmp_path)), FakeTokenizer(), n_ctx=128)


def test_generate_greedy_is_deterministic_and_streams_the_same(llm):
    a = llm.generate("hello", max_tokens=8)
    assert llm.last.finish_reason in ("length", "stop") and len(llm.last.tokens) <= 8
    assert llm.generate("hello", max_tokens=8) == a
    assert "".join(llm.stream("hello", max_tokens=8)) == a


def test_sampling_keywords_and_seed(llm):
    kw = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.01, repeat_penalty=1.1,
              frequency_penalty=0.1, presence_penalty=0.1, max_tokens=12)
    a = llm.generate("abc", seed=1, **kw)
    assert llm.generate("abc", seed=1, **kw) == a
    assert any(llm.generate("abc", seed=s, **kw) != a for s in (2, 3, 4))
    with pytest.raises(TypeError):
        llm.generate("abc", temprature=1.0)


def test_prompt_prefix_is_reused(llm):
    llm.generate("the same long prefix", max_tokens=2)
    llm.generate("the same long prefix, continued", max_tokens=2)
    assert llm.last.reused_tokens == len("the same long prefix")


def test_stop_strings():
    m = ScriptedDecoder("one two three")
    llm = LLM(m, FakeTokenizer(), ChatTemplate.builtin("chatml"), n_ctx=64)
    assert llm.generate("<|im_start|>assistant\n", stop="two") == "one "
    assert llm.generate("<|im_start|>assistant\n", stop=["zz", "thr"]) == "one two "
    assert llm.last.fired_stop == 1


def test_chat_returns_a_conversation():
    llm = LLM(ScriptedDecoder("Hi!"), FakeTokenizer(), ChatTemplate.builtin("chatml"), n_ctx=128)
    c = llm.chat(system="Be terse.", max_tokens=10, temperature=0)
    assert isinstance(c, Conversation)
    assert c.send("Hello") == "Hi!"
    assert "".join(c.stream("Again")) == "Hi!"
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user", "assistant"]


@pytest.mark.slow
def test_load_real_model_chat():
    if not os.path.exists(SMOL):
        pytest.skip("SmolLM2 GGUF not cached")
    from fucina.text.api import load
    llm = load(SMOL, n_ctx=256)
    assert llm.template.format == "chatml"
    out = llm.generate("The capital of France is", max_tokens=3)
    assert "Paris" in out
    c = llm.chat(max_tokens=8)
    c.send("Say hello.")
    first = c.last.prompt_tokens + len(c.last.tokens)
    c.send("Again.")
    assert c.last.reused_tokens == first          # the second turn prefilled only its own tokens
