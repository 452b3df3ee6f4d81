"""The Python API: LLM.generate/stream/chat over a tiny model; fucina.load on a real one."""
import warnings

import pytest

from fucina.errors import InvalidArgument, SamplingError
from fucina.text.api import LLM
from fucina.text.chat_template import ChatTemplate
from fucina.text.conversation import Conversation
from test_chat_support import FakeTokenizer, ScriptedDecoder, tiny_llama


@pytest.fixture
def llm(tmp_path):
    return LLM(tiny_llama(str(tmp_path)), FakeTokenizer(), n_ctx=128)


def test_generate_greedy_is_deterministic_and_streams_the_same(llm):
    a = llm.generate("hello", max_tokens=8, temperature=0)
    assert llm.last.finish_reason in ("length", "stop") and len(llm.last.tokens) <= 8
    assert llm.generate("hello", max_tokens=8, temperature=0) == a
    assert "".join(llm.stream("hello", max_tokens=8, temperature=0)) == a


def test_default_sampling_is_llama_cpp_with_a_fresh_seed_per_call(llm):
    assert (llm.sampling.temperature, llm.sampling.top_k, llm.sampling.top_p, llm.sampling.min_p) == \
        (0.8, 40, 0.95, 0.05)
    outs = {llm.generate("hello", max_tokens=12) for _ in range(4)}
    assert len(outs) > 1                      # no seed: not the same draw every call
    assert llm.generate("hello", max_tokens=12, seed=7) == llm.generate("hello", max_tokens=12, seed=7)


@pytest.mark.parametrize("kw, name", [
    (dict(temperature="hot"), "temperature"), (dict(top_p=2), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(top_k=1.5), "top_k"), (dict(seed="x"), "seed"),
    (dict(temperature=float("nan")), "temperature"), (dict(repeat_penalty=True), "repeat_penalty")])
def test_bad_sampling_arguments_are_typed_errors_naming_them(llm, kw, name):
    with pytest.raises(SamplingError, match=name):
        llm.generate("hello", max_tokens=2, **kw)
    with pytest.raises(SamplingError, match=name):
        llm.chat(**kw)


@pytest.mark.parametrize("kw, name", [(dict(max_tokens=-1), "max_tokens"), (dict(max_tokens="3"), "max_tokens"),
                                      (dict(stop=3), "stop"), (dict(prompt=[1, -2]), "prompt"),
                                      (dict(prompt=[1, 10**9]), "prompt"), (dict(prompt=3.5), "prompt")])
def test_bad_generate_arguments_are_typed_errors_naming_them(llm, kw, name):
    prompt = kw.pop("prompt", "hello")
    with pytest.raises(InvalidArgument, match=name):
        llm.generate(prompt, **kw)
    assert issubclass(InvalidArgument, ValueError)


def test_bad_load_arguments_are_typed(llm):
    with pytest.raises(InvalidArgument, match="n_ctx"):
        LLM(llm.model, llm.tokenizer, n_ctx=-5)
    with pytest.raises(InvalidArgument, match="cache_type"):
        LLM(llm.model, llm.tokenizer, cache_type="q4")


def test_a_model_without_a_chat_template_warns_on_chat(llm, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert llm.has_chat_template
        llm.chat()
    base = LLM(tiny_llama(str(tmp_path / "base"), chat_template=None), FakeTokenizer(), n_ctx=64)
    assert not base.has_chat_template
    with pytest.warns(UserWarning, match="no chat template"):
        base.chat()


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
    assert llm.generate("<|im_start|>assistant\n", stop="two", temperature=0) == "one "
    assert llm.generate("<|im_start|>assistant\n", stop=["zz", "thr"], temperature=0) == "one two "
    assert llm.last.fired_stop == 1


def test_chat_returns_a_conversation():
    llm = LLM(ScriptedDecoder("Hi!"), FakeTokenizer(), ChatTemplate.builtin("chatml"), n_ctx=128)
    c = llm.chat(system="Be terse.", max_tokens=10, temperature=0)
    assert isinstance(c, Conversation)
    assert c.send("Hello") == "Hi!"
    assert "".join(c.stream("Again")) == "Hi!"
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user", "assistant"]


@pytest.mark.slow
def test_load_real_model_chat(smollm2_path):
    from fucina.text.api import load
    llm = load(smollm2_path, n_ctx=256)
    assert llm.template.format == "chatml" and llm.has_chat_template
    out = llm.generate("The capital of France is", max_tokens=3, temperature=0)
    assert "Paris" in out
    c = llm.chat(max_tokens=8)
    c.send("Say hello.")
    first = c.last.prompt_tokens + len(c.last.tokens)
    c.send("Again.")
    assert c.last.reused_tokens == first          # the second turn prefilled only its own tokens
