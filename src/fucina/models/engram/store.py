"""A minimal safetensors reader and writer (F32 and I64 tensors, string metadata).

The format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end)}, "__metadata__": {str: str}}, then the tensors' bytes. The
reader checks every entry against the file before it maps anything (dtype, shape times
item size == the byte span, spans inside the data and not overlapping) and returns
copy-on-write memory maps: a large table's rows are read from the file as they are
gathered, never all at once.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from fucina.models.engram.plan import EngramError

DTYPES = {"F32": np.float32, "I64": np.int64}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20


def write(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    arrays, at = [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in NAMES:
            raise EngramError(f"safetensors: {name} has dtype {a.dtype} (F32 or I64 only)")
        header[name] = dict(dtype=NAMES[a.dtype], shape=list(a.shape), data_offsets=[at, at + a.nbytes])
        arrays.append(a)
        at += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for a in arrays:
            fh.write(a.tobytes())
    os.replace(tmp, path)


def read(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> array (a copy-on-write map of the file), metadata); EngramError on a file
    that is not a well-formed safetensors file."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise EngramError(f"{path}: not a safetensors file (header length {n}, file {size} bytes)")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise EngramError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError):
        raise EngramError(f"{path}: the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise EngramError(f"{path}: the safetensors header is not an object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise EngramError(f"{path}: __metadata__ must map strings to strings")
    data, spans, out = 8 + n, [], {}
    for name, e in header.items():
        try:
            dtype, shape, (b, end) = DTYPES[e["dtype"]], [int(d) for d in e["shape"]], e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise EngramError(f"{path}: tensor {name!r} has a malformed entry (F32/I64, shape, offsets)") from None
        count = int(np.prod(shape)) if shape else 1
        if (any(d < 0 for d in shape) or not isinstance(b, int) or not isinstance(end, int) or b < 0
                or end - b != count * np.dtype(dtype).itemsize or data + end > size):
            raise EngramError(f"{path}: tensor {name!r} does not fit the file (shape {shape}, bytes [{b}, {end}))")
        spans.append((b, end, name))
        out[name] = (dtype, shape, b)
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise EngramError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    arrays = {}
    for name, (dtype, shape, b) in out.items():
        count = int(np.prod(shape)) if shape else 1
        a = np.memmap(path, dtype=dtype, mode="c", offset=data + b, shape=(count,)) if count else \
            np.zeros(0, dtype=dtype)
        arrays[name] = a.reshape(shape)
    return arrays, meta
