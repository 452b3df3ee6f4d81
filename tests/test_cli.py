"""The `fucina` command on a tiny in-process model: each subcommand's output contract."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from fucina import kernels
from fucina.cli.main import main, parse_ids
from fucina.errors import FucinaError
from synth import write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", "llama", layers=2)


def test_parse_ids(tmp_path):
    assert parse_ids("1,2, 3") == [1, 2, 3]
    f = tmp_path / "ids.txt"
    f.write_text("4\n5 6,7\n")
    assert parse_ids(f"@{f}") == [4, 5, 6, 7]
    for bad in ("", "1,x", f"@{tmp_path}/missing"):
        with pytest.raises(FucinaError):
            parse_ids(bad)


def test_logits_format(tiny, tmp_path, capsys):
    out = tmp_path / "l.f32"
    assert main(["logits", tiny, "--tokens", "5,6,7,8", "--out", str(out)]) == 0
    a = np.fromfile(out, dtype="<f4")
    assert a.size == 4 * 260
    assert main(["logits", tiny, "--tokens", "5,6,7,8", "--out", str(out), "--last", "1"]) == 0
    b = np.fromfile(out, dtype="<f4")
    np.testing.assert_allclose(b, a.reshape(4, 260)[-1], rtol=1e-4, atol=1e-4)


def test_run_writes_ids(tiny, tmp_path, capsys):
    ids = tmp_path / "out.txt"
    assert main(["run", tiny, "--tokens", "10,11,12", "--gen", "5", "--ids-out", str(ids)]) == 0
    got = [int(x) for x in ids.read_text().split()]
    assert 0 < len(got) <= 5 and all(0 <= t < 260 for t in got)


def test_tokenize_info_bench(tiny, capsys):
    assert main(["tokenize", tiny, "--prompt", "hi"]) == 0
    assert capsys.readouterr().out.split() == [str(4 + ord("h")), str(4 + ord("i"))]
    assert main(["info", tiny]) == 0
    assert "architecture  llama" in capsys.readouterr().out
    assert main(["bench", tiny, "--pp", "8", "--tg", "4", "--reps", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["prefill_tok_s"] > 0 and d["decode_tok_s"] > 0 and d["load_s"] >= 0
    assert d["kernels"] == kernels.status()
    assert d["results"] == [{"test": "pp8", "depth": 0, "tok_s": d["prefill_tok_s"]},
                            {"test": "tg4", "depth": 0, "tok_s": d["decode_tok_s"]}]


def test_bench_sweeps_prompt_lengths_and_depths(tiny, capsys):
    assert main(["bench", tiny, "--pp", "1,4,0,16", "--tg", "3", "-d", "0,5", "--reps", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tests = [(r["test"], r["depth"]) for r in d["results"]]
    assert tests == [(t, depth) for depth in (0, 5) for t in ("pp1", "pp4", "pp16", "tg3")]
    assert all(r["tok_s"] > 0 for r in d["results"]) and d["pp"] == [1, 4, 0, 16] and d["depth"] == [0, 5]
    assert "prefill_tok_s" not in d
    assert main(["bench", tiny, "--pp", "2,3", "--tg", "0", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^pp2 +0 +[0-9.]+$", out, re.M) and re.search(r"^pp3 +0 +[0-9.]+$", out, re.M)
    with pytest.raises(SystemExit):
        main(["bench", tiny, "--pp", "1,,2"])


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nope.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fucina: error:") and err.count("\n") == 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 40)
    assert main(["run", str(bad), "--tokens", "1"]) == 1
    assert "fucina: error:" in capsys.readouterr().err


def test_python_dash_m(tiny):
    r = subprocess.run([sys.executable, "-m", "fucina", "info", tiny], capture_output=True, text=True)
    assert r.returncode == 0 and "llama" in r.stdout
