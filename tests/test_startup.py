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


# -- a load that computes nothing (issue 18: "no torch import on paths that do not compute") --

LAZY_PROBE = """
import sys
import fucina
from fucina.errors import InvalidArgument
llm = fucina.load(sys.argv[1], n_ctx=64)
ids = llm.tokenize("ab ba")
for bad in (dict(n_ctx=0), dict(cache_type="q4")):      # argument errors need no decoder either
    try:
        fucina.load(sys.argv[1], **bad)
    except InvalidArgument:
        pass
    else:
        raise SystemExit("accepted " + repr(bad))
assert "ab" in llm.template.render([{"role": "user", "content": "ab"}], add_generation_prompt=True)
print(repr(llm), llm.n_ctx, llm.arch, llm.detokenize(ids) == "ab ba", llm.built,
      llm.has_chat_template, llm.template.name, llm.metadata["general.architecture"])
print("TORCH=" + str("torch" in sys.modules))
"""


def test_load_and_tokenize_leave_torch_unimported(tmp_path):
    from synth import write_model

    path = write_model(tmp_path / "m.gguf", "llama")
    r = subprocess.run([sys.executable, "-c", LAZY_PROBE, path], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=SRC))
    assert r.returncode == 0, r.stderr
    assert "TORCH=False" in r.stdout, r.stdout
    assert "64 llama True False True chatml llama" in r.stdout, r.stdout


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3moe"])
def test_generate_after_a_lazy_load_equals_the_eager_path(tmp_path, arch):
    import fucina
    from fucina.models import load_model
    from fucina.text.api import LLM
    from fucina.text.tokenizer import Tokenizer
    from synth import write_model

    path = write_model(tmp_path / "m.gguf", arch)
    lazy = fucina.load(path, n_ctx=64)
    model = load_model(path)
    eager = LLM(model, Tokenizer.from_metadata(model.gguf.metadata), n_ctx=64)
    assert not lazy.built
    assert lazy.generate("abc", 12, temperature=0) == eager.generate("abc", 12, temperature=0)
    assert lazy.built and lazy.last.tokens == eager.last.tokens and len(lazy.last.tokens) == 12
    assert lazy.config == eager.config
    sampled = dict(temperature=0.9, seed=7)            # a seeded sample too, through the chat path
    assert lazy.chat(max_tokens=8, **sampled).send("hi") == eager.chat(max_tokens=8, **sampled).send("hi")


def test_the_deferred_context_length_is_the_configs(tmp_path):
    from fucina.models import load_model
    from fucina.models.registry import context_length
    from synth import ARCHS, write_model

    for arch in ARCHS:
        f = load_model(write_model(tmp_path / f"{arch}.gguf", arch, ctx=1536)).gguf
        assert context_length(f) == 1536, arch
    m = load_model(write_model(tmp_path / "c.gguf", "llama", ctx=0))      # zero: the default
    assert context_length(m.gguf) == m.config.n_ctx_train == 4096


def test_cache_types_agree():
    from fucina.models.cache_q8 import CACHE_TYPES as built
    from fucina.text.api import CACHE_TYPES

    assert CACHE_TYPES == built


def test_the_decoder_is_built_once_across_threads(tmp_path):
    import threading

    import fucina
    from synth import write_model

    llm = fucina.load(write_model(tmp_path / "m.gguf", "llama"))
    real, calls = llm._build, []

    def counted():
        calls.append(1)
        return real()
    llm._build = counted
    seen, go = [], threading.Barrier(4)

    def use():
        go.wait()
        seen.append(llm.model)
    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(seen) == 4 and all(m is seen[0] for m in seen)


def test_load_errors_still_come_from_load(tmp_path):
    import fucina
    from fucina.errors import FucinaError, GGUFError, InvalidArgument, UnsupportedArchitecture
    from synth import write_model

    with pytest.raises(FucinaError, match="model not found"):
        fucina.load(tmp_path / "absent.gguf")
    good = write_model(tmp_path / "m.gguf", "llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(good, "rb").read()[:-4096])          # tensor data runs past the end
    with pytest.raises(GGUFError, match="cut.gguf"):
        fucina.load(cut)
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba-9000")
    w.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 32), "float32"))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedArchitecture, match="mamba-9000"):
        fucina.load(tmp_path / "x.gguf")
    with pytest.raises(InvalidArgument, match="moe_ram"):       # moe_ram/lora build the decoder in load()
        fucina.load(good, moe_ram="50%")
    with pytest.raises(GGUFError, match="nope"):
        fucina.load(good, lora=str(tmp_path / "nope.gguf"))


def test_a_schema_error_surfaces_at_load_and_from_a_direct_build(tmp_path):
    # the family's tensor schema is torch-free (models/schema/): load() checks it, and the
    # decoder build runs the same check (tests/test_load_schema.py: every family, every kind)
    import fucina
    from fucina.errors import GGUFError
    from fucina.models import load_model
    from synth import write_model

    good = write_model(tmp_path / "m.gguf", "llama")
    raw = open(good, "rb").read()
    assert raw.count(b"blk.1.ffn_up.weight") == 1
    bad = tmp_path / "bad.gguf"                       # a valid file whose layer 1 lacks ffn_up
    bad.write_bytes(raw.replace(b"blk.1.ffn_up.weight", b"blk.1.ffn_uq.weight"))
    for _ in range(2):
        with pytest.raises(GGUFError, match="missing tensor 'blk.1.ffn_up.weight'"):
            fucina.load(bad)
        with pytest.raises(GGUFError, match="missing tensor 'blk.1.ffn_up.weight'"):
            load_model(bad)


ONE_GOMP = """
import sys
import fucina
llm = fucina.load(sys.argv[1])                   # the tokenizer's native module loads before torch
llm.generate("ab", 2, temperature=0)
import fucina.kernels as kernels, torch
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
kernels.set_threads(2)
print(len(maps), kernels.get_threads(), torch.get_num_threads(), kernels.available())
"""


def test_torch_and_the_kernels_share_one_openmp_runtime(tmp_path):
    from fucina import kernels
    from synth import write_model

    if not kernels.available():
        pytest.skip("native kernels not built")
    path = write_model(tmp_path / "m.gguf", "llama")
    r = subprocess.run([sys.executable, "-c", ONE_GOMP, path], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=SRC))
    assert r.returncode == 0, r.stderr
    mapped, native, torch_threads, built = r.stdout.split()
    assert mapped == "1" and built == "True", r.stdout    # one libgomp: one pool, one set_threads
    assert native == torch_threads == "2"
