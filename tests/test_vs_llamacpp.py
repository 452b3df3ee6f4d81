"""benchmarks/vs_llamacpp.py without llama.cpp: the skip, the scoreboard table, the
sweep's synthetic vocabulary (both engines must load it)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_llamacpp.py"


def _module():
    spec = importlib.util.spec_from_file_location("vs_llamacpp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_absent_llama_cpp_is_a_skip(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FUCINA_LLAMA_CPP"}
    env["PATH"] = str(tmp_path)              # no llama-bench there
    p = subprocess.run([sys.executable, str(SCRIPT), "--sweep"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("skip: llama.cpp's llama-bench not found"), p.stderr


def test_scoreboard_rows_and_decode_bandwidth(tmp_path):
    mod = _module()
    rows = [{"model": "m.gguf", "isa": "native", "test": "pp16", "depth": 0, "fucina": 30.0, "llama_cpp": 20.0,
             "ratio": 1.5},
            {"model": "m.gguf", "isa": "avx2", "test": "tg64", "depth": 512, "fucina": 10.0, "llama_cpp": 12.5,
             "ratio": 0.8, "fucina_gb_s": 4.0, "llama_cpp_gb_s": 5.0}]
    table = mod.markdown(rows, SimpleNamespace(threads=2, rounds=2, reps=3)).splitlines()
    assert "2 threads" in table[0] and "commit" in table[0]
    assert table[4] == "| m | native | pp16 | 30.0 | 20.0 | 1.50 |  |"
    assert table[5] == "| m | avx2 | tg64 @ d512 | 10.0 | 12.5 | 0.80 | 4.0 / 5.0 |"
    # the grid: a line per model and ISA, a column per prompt length and decode depth, losses bold
    assert table[7:] == ["| model | ISA | pp16 | tg d512 |", "| --- | --- | ---: | ---: |",
                         "| m | native | 1.50 |  |", "| m | avx2 |  | **0.80** |"]
    assert mod.grid(rows[:1]) == ""


def test_sweep_vocabulary_loads(tmp_path):
    from fucina.text.tokenizer import Tokenizer

    mod = _module()
    sys.path.insert(0, str(ROOT / "tests"))
    path = str(tmp_path / "v.gguf")
    w = gguf.GGUFWriter(path, "qwen3")
    mod._byte_vocab_writer(w, 400)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(path)
    assert tok.n_vocab == 400
    assert tok.decode(tok.encode_raw("héllo", parse_special=False)) == "héllo"


def test_read_bandwidth_pairs_decode_with_the_sum(tmp_path):
    """--model: one line with the decode GB/s, the sum's and their paired share (a tiny
    model's share means nothing; the format and the byte count are what is checked)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_chat_support import tiny_llama_gguf

    path = tiny_llama_gguf(tmp_path / "t.gguf")
    mod = _module()
    nbytes = mod.read_bytes(path)
    assert nbytes == sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name != "token_embd.weight")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "read_bandwidth.py"), "--model", path,
                        "--threads", "1", "--rounds", "2", "--tokens", "2", "--gib", "0.01"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip()
    assert line.startswith("t.gguf, ISA ") and "1 thread(s)" in line and f"{nbytes / 1e9:.3f} GB a token" in line
    assert "paired share median" in line and "2 rounds" in line
