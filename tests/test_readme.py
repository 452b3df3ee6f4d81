"""The README's Python snippets run as printed.

The ```python blocks run in order in one namespace, as a reader runs them (a later
snippet may use the `llm` an earlier one loaded). The server snippet
talks to a live `fucina` server started here on a free port (the one change made to
the text: its port), with the default model from the cache."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_the_snippets_this_test_runs():
    blocks = python_blocks()
    assert any("fucina.load()" in b for b in blocks)
    assert any("OpenAI(base_url=" in b for b in blocks)
    for b in blocks:
        compile(b, "README.md", "exec")          # every snippet is at least valid Python


@pytest.mark.slow
def test_readme_snippets_run_as_printed(smollm2_path, capsys, monkeypatch):
    import itertools

    import fucina.text.api
    import fucina.text.defaults
    from test_serve import live

    seeds = itertools.count(1)              # the snippets' "fresh" seeds, made repeatable
    for mod in (fucina.text.api, fucina.text.defaults):
        monkeypatch.setattr(mod, "fresh_seed", lambda: next(seeds))

    from fucina.serve import Server
    from fucina.text.api import load

    blocks = python_blocks()
    server_blocks = [b for b in blocks if "base_url=" in b]
    ns: dict = {}
    for b in blocks:
        if b not in server_blocks:
            exec(compile(b, "README.md", "exec"), ns)
    out = capsys.readouterr().out
    assert "Paris" in out and out.count("\n") >= 4          # generate, stream + newline, two sends
    with live(Server.from_llm(load(smollm2_path, n_ctx=1024))) as url:
        port = url.rsplit(":", 1)[1]
        for b in server_blocks:
            ns = {}
            exec(compile(b.replace("127.0.0.1:8080", f"127.0.0.1:{port}"), "README.md", "exec"), ns)
            assert ns["r"].choices[0].message.content
