"""The scripts in examples/ run as a user runs them, on the default model: the local ones
directly, the client ones against a live server (skipped when their package is absent)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = pytest.mark.slow


def run(name: str, *args: str, timeout: int = 600) -> str:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_every_example_is_tested():
    tested = {"conversation.py", "structured_output.py", "lora_finetune.py", "openai_client.py",
              "anthropic_client.py", "langchain_client.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_conversation(smollm2_path):
    out = run("conversation.py", str(smollm2_path))
    assert out.count("> ") == 2 and "(5 messages in the conversation)" in out


def test_structured_output(smollm2_path):
    pytest.importorskip("pydantic")
    lines = run("structured_output.py", str(smollm2_path)).splitlines()
    assert lines[0].startswith("name=") and "population=" in lines[0]
    assert lines[1].split("Answer:")[-1].strip() in ("yes.", "no.")
    assert lines[2].endswith((" red", " blue"))


def test_lora_finetune(smollm2_path):
    out = run("lora_finetune.py", str(smollm2_path), "--steps", "2")
    assert "training summary:" in out and out.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def server_url(smollm2_path):
    from fucina.serve import Server
    from fucina.text.api import load
    from live_server import live

    with live(Server.from_llm(load(smollm2_path, n_ctx=1024))) as url:
        yield url


def test_openai_client(server_url):
    pytest.importorskip("openai")
    lines = run("openai_client.py", server_url).splitlines()
    assert lines[0] and lines[1]
    assert lines[2].startswith("name=") and "country=" in lines[2]


def test_anthropic_client(server_url):
    pytest.importorskip("anthropic")
    lines = run("anthropic_client.py", server_url).splitlines()
    assert len(lines) >= 2 and lines[0]


def test_langchain_client(server_url):
    out = run("langchain_client.py", server_url)
    try:
        import langchain_openai  # noqa: F401
    except ImportError:
        assert out.startswith("skip: langchain-openai is not installed")
        return
    assert out.strip()


