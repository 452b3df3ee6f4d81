"""Start-up cost: what `fucina.load()` and `fucina run` import, and the GGML type table that
replaced the `gguf` package on that path (issue 18, "a fast start")."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import pytest

from fucina.gguf import TYPE_SIZES, GGMLType

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def test_type_table_matches_gguf_py():
    assert {t.name: int(t) for t in GGMLType} == {t.name: int(t) for t in gguf.GGMLQuantizationType}
    ours = {t.name: TYPE_SIZES[t] for t in GGMLType}
    theirs = {t.name: tuple(gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    theirs["Q8_1"] = (32, 36)            # ggml's block_q8_1 (two f16 + 32 int8); gguf-py says 40
    assert ours == theirs
    # gguf-py's enum keys our dicts and ours keys theirs (tests and the exporter mix them)
    assert TYPE_SIZES[gguf.GGMLQuantizationType.Q4_K] == (256, 144)
    assert gguf.GGML_QUANT_SIZES[GGMLType.Q6_K] == (256, 210)


PROBE = """
import sys
import fucina
from fucina.cli import main, chat, grammar_args, progress, finetune
from fucina.text import api
from fucina.models import load_model
heavy = [m for m in ("gguf", "jinja2", "llguidance", "yaml") if m in sys.modules]
print("HEAVY=" + ",".join(heavy))
"""


def test_the_load_and_run_path_imports_no_template_grammar_or_gguf_py():
    # jinja2 (chat templates), llguidance (grammars) and gguf-py (writer, name tables, yaml)
    # cost ~0.15 s of a start-up that only loads a model and decodes; they load on first use
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=SRC))
    assert r.returncode == 0, r.stderr
    assert "HEAVY=\n" in r.stdout, r.stdout


def test_lazy_imports_still_work_on_first_use():
    from fucina.text import grammar
    from fucina.text.chat_template import ChatTemplate, ChatTemplateError

    t = ChatTemplate.builtin("chatml")
    assert "<|im_start|>user\nhi<|im_end|>" in t.render([{"role": "user", "content": "hi"}])
    bad = ChatTemplate("{% if %}", name="bad")
    try:
        bad.render([{"role": "user", "content": "hi"}])
    except ChatTemplateError as e:
        assert "does not compile" in str(e)
    else:
        raise AssertionError("a broken template rendered")
    assert grammar.regex("[ab]+")


def test_the_start_up_gc_pause_always_ends(tmp_path, capsys):
    import gc

    import fucina
    from fucina.cli import main as cli
    from synth import write_model

    path = write_model(tmp_path / "m.gguf", "llama")
    seen = []
    real = cli.resume_gc

    def spy():
        real()
        seen.append(gc.isenabled())
    cli.resume_gc = spy
    try:
        assert cli.main(["run", path, "--prompt", "ab", "--gen", "2", "-t", "1"]) == 0
        assert seen[0] is True                    # generation runs with the collector back on
        assert cli.main(["info", path]) == 0
        with pytest.raises(SystemExit):           # an argument error leaves through argparse
            cli.main(["run", "--gen", "-1"])
    finally:
        cli.resume_gc = real
    assert gc.isenabled() and gc.get_freeze_count() == 0     # main() unfroze what it froze
    gc.disable()                                  # a caller's own choice survives load()
    try:
        fucina.load(path)
        assert not gc.isenabled()
    finally:
        gc.enable()
    fucina.load(path)
    assert gc.isenabled()
    capsys.readouterr()
