"""A broken file fails at `fucina.load()`, without torch (issue 18's follow-up): every
family's torch-free schema (models/schema/<family>.py) checks the config and every tensor
the decoder reads, and the decoder build runs the same check, so both raise one error.

Each case starts from a good synthetic model of a family and breaks one thing in its bytes
(a name or a dimension of the same width, so the file stays well-formed): a tensor dropped,
a tensor mis-shaped, a required metadata key missing, or an inconsistent config."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from synth import ARCHS, write_model

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

# a required key of the family's own config (the common ones are checked for every family)
FAMILY_KEY = {"qwen35": "ssm.conv_kernel", "qwen35moe": "expert_count",
              "qwen3moe": "expert_count", "deepseek2": "attention.kv_lora_rank",
              "gemma4": "attention.sliding_window_pattern", "kimi-linear": "kda.head_dim",
              "kimi-k3": "attn_res.block_size",
              "deepseek4": "hyper_connection.count"}
TENSOR = "blk.1.attn_output.weight"     # every family's layer 1 has one (qwen35's is an attention layer)
FAMILY_TENSOR = {"deepseek4": "blk.1.attn_output_b.weight"}   # its output is two low-rank halves


def _gguf_string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def _once(raw: bytes, needle: bytes) -> int:
    assert raw.count(needle) == 1, needle
    return raw.index(needle)


def renamed(raw: bytes, name: str) -> bytes:
    """`name` (a metadata key or a tensor) renamed in place: the file no longer has it."""
    at = _once(raw, _gguf_string(name)) + 8 + len(name) - 1
    return raw[:at] + (b"x" if raw[at:at + 1] != b"x" else b"y") + raw[at + 1:]


def shrunk(raw: bytes, name: str) -> bytes:
    """Tensor `name` one row short: its outermost GGML dim minus one (its data still in bounds)."""
    at = _once(raw, _gguf_string(name)) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    last = at + 4 + 8 * (n_dims - 1)
    ne = struct.unpack_from("<Q", raw, last)[0]
    return raw[:last] + struct.pack("<Q", ne - 1) + raw[last + 8:]


def broken_files(tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (path, what the error must name)."""
    out = {}

    def put(case: str, raw: bytes, named: str):
        p = tmp_path / f"{case}.gguf"
        p.write_bytes(raw)
        out[case] = (str(p), named)

    for arch in ARCHS:
        raw = open(write_model(tmp_path / f"{arch}.gguf", arch), "rb").read()
        name = FAMILY_TENSOR.get(arch, TENSOR)
        put(f"{arch}-dropped", renamed(raw, name), f"missing tensor '{name}'")
        put(f"{arch}-shape", shrunk(raw, name), f"tensor '{name}' has shape")
        put(f"{arch}-norm", shrunk(raw, "output_norm.weight"),
            "tensor 'output_norm.weight' has 63 elements, expected 64")
        for key in ("block_count", FAMILY_KEY.get(arch, "attention.layer_norm_rms_epsilon")):
            put(f"{arch}-{key}", renamed(raw, f"{arch}.{key}"), f"missing metadata key {arch}.{key}")
    # the combinations a family's layers need, and inconsistent configs
    put("gemma4-no-attn_k", renamed(open(tmp_path / "gemma4.gguf", "rb").read(), "blk.0.attn_k.weight"),
        "layer 0 stores K/V but has no attn_k")
    put("deepseek2-no-k_b", renamed(open(tmp_path / "deepseek2.gguf", "rb").read(), "blk.0.attn_k_b.weight"),
        "blk.0: needs attn_k_b + attn_v_b or attn_kv_b")
    put("qwen3moe-experts", open(write_model(tmp_path / "e.gguf", "qwen3moe", experts=4, experts_used=5), "rb").read(),
        "5 experts used of 4")
    put("qwen35-geometry", open(write_model(tmp_path / "g.gguf", "qwen35", kv_heads=3), "rb").read(),
        "is not a valid DeltaNet")
    return out


PROBE = """
import json, sys
import fucina
from fucina.errors import FucinaError
seen = {}
for case, path in json.loads(sys.argv[1]).items():
    try:
        fucina.load(path)
        seen[case] = None
    except FucinaError as e:
        seen[case] = [type(e).__name__, str(e)]
print(json.dumps(dict(seen=seen, torch="torch" in sys.modules)))
"""


def test_a_broken_file_fails_at_load_without_torch_with_the_builds_error(tmp_path):
    from fucina.models import load_model

    cases = broken_files(tmp_path)
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps({k: p for k, (p, _) in cases.items()})],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=SRC))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["torch"] is False
    for case, (path, named) in cases.items():
        got = out["seen"][case]
        assert got is not None, f"{case}: load() accepted it"
        assert got[0] == "GGUFError" and named in got[1], (case, got)
        with pytest.raises(Exception) as built:     # the decoder build raises the very same error
            load_model(path)
        assert [type(built.value).__name__, str(built.value)] == got, case


def test_the_good_files_load_unbuilt_and_the_table_holds_only_what_the_schema_lists(tmp_path):
    import fucina
    from fucina.errors import FucinaError
    from fucina.models.registry import check

    for arch in ARCHS:
        llm = fucina.load(write_model(tmp_path / f"{arch}.gguf", arch))
        assert not llm.built and llm.arch == arch
        t = check(llm.gguf)
        assert t.config.n_layer == 2 and "token_embd.weight" in t and FAMILY_TENSOR.get(arch, TENSOR) in t, arch
        with pytest.raises(FucinaError, match="schema does not list tensor 'blk.9.attn_q.weight'"):
            t["blk.9.attn_q.weight"]       # a build reading past its schema fails loudly
