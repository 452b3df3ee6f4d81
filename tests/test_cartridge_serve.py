"""Serving behind a cartridge: the Python API, the CLI and the server agree, and an
untrained corpus cartridge answers exactly as the corpus in the prompt does."""
import json

import pytest
import torch

import fucina
from fucina.errors import CartridgeError, FucinaError
from fucina.models.cartridge import Cartridge
from synth import write_model

DOC = "The lighthouse keeper on Skerry Point is called Morwenna and she owns nine cats. " * 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    path = write_model(d / "m.gguf", "qwen3", hidden=64, heads=4, kv_heads=2, head_dim=32, layers=2)
    llm = fucina.load(path, n_ctx=256)
    ids = llm.tokenize(DOC)
    cart = Cartridge.capture(llm.model, ids, corpus=ids)
    cpath = cart.save(d / "c.safetensors")
    return str(path), cpath, ids


def test_generate_behind_a_capture_equals_the_corpus_in_the_prompt(setup):
    path, cpath, ids = setup
    plain = fucina.load(path, n_ctx=256)
    behind = fucina.load(path, n_ctx=256, cartridge=cpath)
    prompt = [40, 41, 42, 43]
    want = plain.generate(ids + prompt, max_tokens=8, temperature=0)
    got = behind.generate(prompt, max_tokens=8, temperature=0)
    assert got == want and behind.last.tokens == plain.last.tokens
    assert behind.last.prompt_tokens == len(prompt)
    # the cache is reused past the prefix on the next call
    behind.generate(prompt + [44], max_tokens=2, temperature=0)
    assert behind.last.reused_tokens >= len(prompt) and behind.last.prompt_tokens == len(prompt) + 1


def test_chat_behind_a_cartridge_reuses_and_resets(setup):
    path, cpath, ids = setup
    llm = fucina.load(path, n_ctx=256, cartridge=cpath)
    chat = llm.chat(max_tokens=6, temperature=0)
    first = chat.send("hello")
    assert chat.cache.len == len(chat.tokens) and chat.tokens[:len(ids)] == [-1 - i for i in range(len(ids))]
    chat.send("again")
    assert chat.last.reused_tokens > 0 and chat.last.prompt_tokens < chat.cache.len
    chat.reset()
    assert chat.cache.len == len(ids)
    assert chat.send("hello") == first
    # a stateless history through send_messages: the same answer
    fresh = llm.chat(max_tokens=6, temperature=0)
    assert fresh.send_messages([{"role": "user", "content": "hello"}]) == first


def test_cli_server_and_api_agree(setup, tmp_path, capsys):
    from starlette.testclient import TestClient

    from fucina.cli.main import main
    from fucina.serve import Server
    from fucina.serve.app import create_app

    path, cpath, _ = setup
    llm = fucina.load(path, n_ctx=256, cartridge=cpath)
    conv = llm.chat(max_tokens=6, temperature=0)
    api = conv.send("hello")
    out = tmp_path / "ids.txt"
    assert main(["run", path, "--tokens", "40,41,42", "--gen", "6", "--cartridge", cpath,
                 "--ids-out", str(out)]) == 0
    capsys.readouterr()
    api_run = fucina.load(path, n_ctx=256, cartridge=cpath)
    api_run.generate([40, 41, 42], max_tokens=6, temperature=0)
    assert [int(x) for x in out.read_text().split()] == api_run.last.tokens
    server = Server.from_llm(fucina.load(path, n_ctx=256, cartridge=cpath), slots=2)
    with TestClient(create_app(server)) as c:
        for _ in range(2):      # the second request reuses the slot behind the cartridge
            r = c.post("/v1/chat/completions", json={"model": "x", "max_tokens": 6, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "hello"}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == api
    assert r.json()["usage"]["prompt_tokens"] == conv.last.prompt_tokens   # the cartridge's rows are not counted


def test_wrong_model_or_file_is_refused(setup, tmp_path):
    path, cpath, _ = setup
    other = write_model(tmp_path / "o.gguf", "qwen3", hidden=64, heads=4, kv_heads=1, head_dim=32, layers=2)
    with pytest.raises(CartridgeError, match="layer 0"):
        fucina.load(other, cartridge=cpath).generate([1, 2], max_tokens=1)
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    from fucina.cli.main import main
    assert main(["run", str(path), "--tokens", "1", "--cartridge", str(tmp_path / "bad.safetensors")]) == 1
    with pytest.raises(FucinaError, match="no room"):
        fucina.load(path, n_ctx=8, cartridge=cpath).generate([1], max_tokens=1)


def test_two_cartridges_compose_at_load(setup, tmp_path):
    """--cartridge A --cartridge B: A's rows then B's; two halves of one capture are the whole."""
    path, cpath, ids = setup
    whole = Cartridge.load(cpath)
    cut = len(ids) // 2
    halves = []
    for lo, hi, frozen in ((0, cut, 1), (cut, len(ids), 0)):
        part = Cartridge([None if k is None else k[lo:hi] for k in whole.k],
                         [None if v is None else v[lo:hi] for v in whole.v], whole.geometry, whole.identity,
                         frozen=frozen)
        halves.append(part.save(tmp_path / f"h{lo}.safetensors"))
    a = fucina.load(path, n_ctx=256, cartridge=cpath)
    b = fucina.load(path, n_ctx=256, cartridge=halves)
    assert a.generate([40, 41], max_tokens=6, temperature=0) == b.generate([40, 41], max_tokens=6, temperature=0)
    assert b.prefix.p == len(ids)
