"""`fucina chat` with no MODEL talks to the chat default (Qwen2.5-Coder-0.5B-Instruct);
every other command keeps SmolLM2 (issue 18: the chat-default decision)."""
from __future__ import annotations

import shutil

import pytest

import fucina.cli.chat as chat_cli
from fucina.cli.main import main
from fucina.models.hub import PACKAGED, QWEN25_CODER, SMOLLM2, resolve_model
from synth import write_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    d.mkdir()
    shutil.copy(write_model(tmp_path / "chat.gguf", "llama"), d / QWEN25_CODER.filename)
    shutil.copy(write_model(tmp_path / "small.gguf", "llama", seed=1), d / SMOLLM2.filename)
    monkeypatch.setenv("FUCINA_CACHE", str(d))
    monkeypatch.setenv("FUCINA_PROGRESS", "0")
    return d


def test_chat_without_a_model_loads_the_chat_default(cache, monkeypatch, capsys):
    assert chat_cli.CHAT_DEFAULT in PACKAGED
    seen = []
    real = chat_cli.load_llm

    def spy(model_arg, **kw):
        seen.append(resolve_model(model_arg))
        return real(model_arg, **kw)
    monkeypatch.setattr(chat_cli, "load_llm", spy)
    assert main(["chat", "hello", "--gen", "2", "-t", "1"]) == 0
    assert main(["chat", "smollm2", "hello", "--gen", "2", "-t", "1"]) == 0    # a MODEL still wins
    assert [p.name for p in seen] == [QWEN25_CODER.filename, SMOLLM2.filename]
    assert resolve_model(None).name == SMOLLM2.filename                        # run/info/serve/load
    capsys.readouterr()


def test_chat_help_names_the_chat_default(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    assert f"default: {chat_cli.CHAT_DEFAULT}" in capsys.readouterr().out


@pytest.mark.slow
def test_the_chat_default_answers_the_question_smollm2_missed(capsys):
    from conftest import present_model

    present_model(chat_cli.CHAT_DEFAULT)                  # skips rather than fetch 491 MB
    assert main(["chat", "What is the capital of France?", "--greedy", "--gen", "16", "-t", "1"]) == 0
    assert "Paris" in capsys.readouterr().out
