"""GGUF reader: round trip with the gguf writer, split files, metadata policy, and
corrupt files that must raise GGUFError (never crash)."""
import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fucina.errors import GGUFError, InvalidConfig, MissingMetadata
from fucina.gguf import GGUFFile, Zero, meta_float, meta_int, meta_int_opt, meta_per_layer
from synth import write_model


def _write(path, tensors=None, kv=None, arch="llama"):
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (kv or {}).items():
        w.add_uint32(k, v) if isinstance(v, int) else w.add_string(k, v)
    for name, a in (tensors or {"t": np.arange(64, dtype=np.float32).reshape(2, 32)}).items():
        w.add_tensor(name, a)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def test_round_trip_zero_copy(tmp_path):
    a = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    h = np.arange(32, dtype=np.float16)
    f = GGUFFile(_write(tmp_path / "a.gguf", {"a": a, "h": h}, {"x.count": 7, "x.name": "hi"}))
    assert f.architecture == "llama"
    assert f.metadata["x.count"] == 7 and f.metadata["x.name"] == "hi"
    t = f.tensor("a")
    assert t.shape == (3, 64) and t.ne == (64, 3) and t.ggml_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(t.data.view(np.float32).reshape(3, 64), a)
    assert not t.data.flags.writeable and not t.data.flags.owndata  # a view of the mmap
    np.testing.assert_array_equal(f.tensor("h").data.view(np.float16), h)
    with pytest.raises(GGUFError, match="missing tensor"):
        f.tensor("nope")


def test_real_model_metadata(tmp_path):
    f = GGUFFile(write_model(tmp_path / "m.gguf", "qwen3"))
    assert isinstance(f.metadata["tokenizer.ggml.tokens"], list)
    assert meta_int(f.metadata, "qwen3", "block_count") == 2


def test_split_files(tmp_path):
    rng = np.random.default_rng(1)
    parts = {f"t{i}": rng.standard_normal((2, 32)).astype(np.float32) for i in range(3)}
    names = list(parts)
    for i, name in enumerate(names):
        w = gguf.GGUFWriter(str(tmp_path / f"m-{i + 1:05d}-of-00003.gguf"), "llama")
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", 3)
        w.add_int32("split.tensors.count", 3)
        w.add_tensor(name, parts[name])
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    f = GGUFFile(tmp_path / "m-00001-of-00003.gguf")
    assert sorted(f.tensors) == names
    for n in names:
        np.testing.assert_array_equal(f.tensor(n).data.view(np.float32).reshape(2, 32), parts[n])
    with pytest.raises(GGUFError, match="first part"):
        GGUFFile(tmp_path / "m-00002-of-00003.gguf")
    (tmp_path / "m-00003-of-00003.gguf").unlink()
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "m-00001-of-00003.gguf")


def test_meta_zero_policy():
    m = {"a.block_count": 24, "a.shared_kv_layers": 0, "a.neg": -1, "a.eps": 1e-6, "a.s": "x",
         "a.heads": np.array([4, 4, 8], dtype=np.int32), "a.one": 2}
    assert meta_int(m, "a", "block_count") == 24
    with pytest.raises(InvalidConfig):
        meta_int(m, "a", "shared_kv_layers")
    assert meta_int(m, "a", "shared_kv_layers", Zero.ACCEPT) == 0
    assert meta_int_opt(m, "a", "missing", Zero.ACCEPT) is None
    assert meta_int_opt(m, "a", "neg", Zero.ACCEPT) is None
    with pytest.raises(MissingMetadata):
        meta_int(m, "a", "missing")
    with pytest.raises(InvalidConfig):
        meta_float(m, "a", "s")
    assert meta_float(m, "a", "eps") == pytest.approx(1e-6)
    assert meta_per_layer(m, "a.heads", 3) == [4, 4, 8]
    assert meta_per_layer(m, "a.one", 3) == [2, 2, 2]
    with pytest.raises(InvalidConfig):
        meta_per_layer(m, "a.heads", 4)


@pytest.fixture(scope="module")
def good_bytes(tmp_path_factory):
    p = write_model(tmp_path_factory.mktemp("g") / "g.gguf", "llama", layers=1, hidden=32,
                    heads=2, kv_heads=1, head_dim=16, ffn=32)
    return open(p, "rb").read()


def _open_bytes(tmp_path, data: bytes):
    p = tmp_path / "c.gguf"
    p.write_bytes(data)
    return GGUFFile(p)


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b"GGML" + b[4:], "bad magic"),
    (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], "version"),
    (lambda b: b[:4] + struct.pack("<I", 1 << 24) + b[8:], "big-endian"),
    (lambda b: b[:100], "truncated|more than the file"),
    (lambda b: b[:-100], "past the end"),
    (lambda b: b[:8] + struct.pack("<Q", 1 << 60) + b[16:], "more than the file"),
    (lambda b: b[:16] + struct.pack("<Q", 1 << 40) + b[24:], "more than the file"),
    (lambda b: b[:10], "too small"),
])
def test_corrupt_headers(tmp_path, good_bytes, mutate, match):
    with pytest.raises(GGUFError, match=match):
        _open_bytes(tmp_path, mutate(good_bytes))


def test_bad_tensor_fields(tmp_path):
    a = np.zeros((2, 32), dtype=np.float32)
    data = bytearray(open(_write(tmp_path / "t.gguf", {"weight": a}), "rb").read())
    at = data.find(b"weight") + len(b"weight")  # then n_dims u32, dims u64..., type u32, offset u64
    for patch, match in [
        ((at, struct.pack("<I", 9)), "dims"),
        ((at + 4, struct.pack("<Q", 1 << 50)), "absurd shape"),
        ((at + 4, struct.pack("<Q", 0)), "absurd shape"),
        ((at + 20, struct.pack("<I", 99)), "unknown type"),
        ((at + 24, struct.pack("<Q", 1 << 40)), "past the end|aligned"),
        ((at + 24, struct.pack("<Q", 3)), "aligned"),
    ]:
        bad = bytearray(data)
        off, b = patch
        bad[off:off + len(b)] = b
        with pytest.raises(GGUFError, match=match):
            _open_bytes(tmp_path, bytes(bad))


def test_not_a_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="directory"):
        GGUFFile(tmp_path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_headers_never_crash(tmp_path, good_bytes, data):
    """Random byte flips and truncations in the header region: GGUFError or a valid file."""
    b = bytearray(good_bytes)
    header_end = min(len(b), 4096)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, header_end - 1))
        b[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(b))))
    if cut is not None:
        b = b[:cut]
    try:
        f = _open_bytes(tmp_path, bytes(b))
    except GGUFError:
        return
    for t in f.tensors.values():   # whatever parsed must be in bounds
        assert t.offset + t.nbytes <= f.file_size and t.data.size == t.nbytes
