"""`fucina template` and `fucina chat`."""
import json
from argparse import Namespace

import pytest

from fucina.cli.chat import _split_positionals
from fucina.cli.main import main
from fucina.errors import FucinaError
from fucina.gguf import GGUFFile
from test_chat_template import QWEN3, TOOLS, plain_jinja
from conftest import present_model
from test_chat_support import tiny_llama_gguf

MSGS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]


def test_template_prints_exact_rendering(tmp_path, capsys):
    model = tiny_llama_gguf(tmp_path / "q.gguf", chat_template=QWEN3)
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"messages": MSGS, "tools": TOOLS, "enable_thinking": False}))
    assert main(["template", model, "--messages", str(f)]) == 0
    want = plain_jinja(QWEN3, messages=MSGS, tools=TOOLS, enable_thinking=False,
                       add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert capsys.readouterr().out == want
    f.write_text(json.dumps(MSGS))
    assert main(["template", model, "--messages", str(f), "--no-generation-prompt"]) == 0
    assert capsys.readouterr().out == plain_jinja(QWEN3, messages=MSGS, add_generation_prompt=False,
                                                  bos_token="<s>", eos_token="</s>")


def test_template_smollm2(tmp_path, capsys):
    SMOL = str(present_model("smollm2"))
    f = tmp_path / "m.json"
    f.write_text(json.dumps(MSGS))
    assert main(["template", SMOL, "--messages", str(f)]) == 0
    src = GGUFFile(SMOL).metadata["tokenizer.chat_template"]
    assert capsys.readouterr().out == plain_jinja(src, messages=MSGS, add_generation_prompt=True,
                                                  bos_token="<|im_start|>", eos_token="<|im_end|>")


def test_template_bad_input(tmp_path, capsys):
    model = tiny_llama_gguf(tmp_path / "q.gguf")
    f = tmp_path / "m.json"
    f.write_text("{not json")
    assert main(["template", model, "--messages", str(f)]) == 1
    f.write_text(json.dumps([{"content": "no role"}]))
    assert main(["template", model, "--messages", str(f)]) == 1
    assert "role" in capsys.readouterr().err


def test_chat_positionals():
    ns = lambda *a, repl=False: Namespace(args=list(a), repl=repl)
    assert _split_positionals(ns("hello")) == (None, "hello")
    assert _split_positionals(ns("m.gguf", "hello")) == ("m.gguf", "hello")
    assert _split_positionals(ns("m.gguf", repl=True)) == ("m.gguf", None)
    assert _split_positionals(ns(repl=True)) == (None, None)
    with pytest.raises(FucinaError):
        _split_positionals(ns())


@pytest.mark.slow
def test_chat_command_real_model(capsys, monkeypatch, smollm2_path):
    SMOL = str(smollm2_path)
    assert main(["chat", SMOL, "What is the capital of France?", "--gen", "6", "-t", "2"]) == 0
    assert capsys.readouterr().out.strip()
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nBye\n"))
    assert main(["chat", SMOL, "--repl", "--gen", "3", "--temp", "0.7", "--seed", "1"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) >= 2
